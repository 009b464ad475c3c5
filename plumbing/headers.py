"""gRPC metadata names that the facade (Envoy's configuration, its Lua filters and its
launcher) and the replicas both use: an agreement between the two sides, stated once."""

# The largest whole JSON reply the facade carries, set by Envoy's route on every REST call.
MAX_REPLY_HEADER = "x-max-reply-bytes"
# Every pool's models (a ListModelsResponse, binary metadata: Envoy sends it base64-encoded,
# a replica receives the bytes), passed with the calls that no single pool owns.
ENDPOINT_MODELS_HEADER = "x-endpoint-models-bin"
