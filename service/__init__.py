"""gRPC completion service over vLLM's async engine."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("llm-completions")  # pyproject.toml's, the one source
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "unknown"
