"""gRPC metadata names that the facade (Envoy's configuration, its Lua filters and its
launcher) and the replicas both use: an agreement between the two sides, stated once."""

# The largest whole JSON reply the facade carries, set by Envoy's route on every REST call.
MAX_REPLY_HEADER = "x-max-reply-bytes"
# Every pool's models (a ListModelsResponse, binary metadata: Envoy sends it base64-encoded,
# a replica receives the bytes), passed with the calls that no single pool owns.
ENDPOINT_MODELS_HEADER = "x-endpoint-models-bin"
# A load or unload of an adapter goes to every replica of a pool: Envoy marks each attempt with
# this header and tries the next replica while the last one answers with it set to
# FANOUT_CONTINUE (its x-envoy-attempt-count says how many were tried).
FANOUT_HEADER = "x-llm-completions-fanout"
FANOUT_CONTINUE = "continue"
ATTEMPT_COUNT_HEADER = "x-envoy-attempt-count"
# In a replica's ORCA load report (endpoint-load-metrics-bin): a named metric (1) for each
# adapter in its engine's memory, this prefix then the adapter's name.
ADAPTER_METRIC_PREFIX = "adapter."
