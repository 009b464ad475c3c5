"""gRPC completion service over vLLM's async engine."""

__version__ = "0.1.0"
