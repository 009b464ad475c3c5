"""Transport: the gRPC server, its interceptor chain, the REST bridge, metrics and logs."""
