"""Side-by-side serving benchmark: vLLM's OpenAI server, our REST through Envoy, our gRPC."""
