"""The replica's default gRPC port: where the service listens and where the facade looks for
it when it is told no other."""

DEFAULT_GRPC_PORT = 50051
