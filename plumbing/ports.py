"""The replica's ports: its default gRPC port (where the service listens and where the facade
looks for it when told no other), and its frontends' own ports when it runs several."""

DEFAULT_GRPC_PORT = 50051


def frontend_ports(port: int, count: int, given: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Each frontend's own port in a replica of `count` frontend processes: as given, else the
    `count` ports after the replica's `port` (which they all share)."""
    return given or tuple(port + 1 + index for index in range(count))
