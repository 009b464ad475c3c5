"""The kubelet's probe of a gRPC health service that serves TLS: an exec probe, run in the
container (`python health_probe.py --port 50051 --ca-file /etc/llm-completions/tls/ca.crt`).

The kubelet's own gRPC probe speaks plaintext only (Kubernetes 1.37 adds `grpc.mode: TLS`), so
against a TLS listener it fails. This one dials the pod's own port on 127.0.0.1 over TLS,
trusting the CA of the pod's certificate, which must also name `localhost` (the name it checks;
the certificates of deploy/components/cert-manager do), and asks grpc.health.v1's Check.

Exit status 0 when the service answers SERVING (with --alive: when it answers at all, as a
server that is loading or draining answers NOT_SERVING), else 1 with the reason on stderr,
which `kubectl describe pod` shows. It runs with the image's Python and gRPC, and costs about
0.25 s of CPU per run.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="the pod's gRPC port")
    parser.add_argument(
        "--ca-file", required=True, help="PEM CA certificates that signed the server's"
    )
    parser.add_argument(
        "--server-name",
        default="localhost",
        help="the name the server's certificate must carry (default: localhost)",
    )
    parser.add_argument(
        "--service", default="", help="the health service asked (default: the server's)"
    )
    parser.add_argument(
        "--alive",
        action="store_true",
        help="pass on any answer, NOT_SERVING included (a liveness probe)",
    )
    parser.add_argument("--cert-file", help="a PEM client certificate, for mutual TLS")
    parser.add_argument("--key-file", help="its PEM private key")
    parser.add_argument("--timeout", type=float, default=4.0, help="seconds (default: 4)")
    return parser.parse_args(argv)


def credentials(args: argparse.Namespace) -> grpc.ChannelCredentials:
    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as file:
            return file.read()

    return grpc.ssl_channel_credentials(
        read(args.ca_file), read(args.key_file), read(args.cert_file)
    )


def problem(args: argparse.Namespace) -> str | None:
    """None when the probe passes, else why not."""
    try:
        tls = credentials(args)
    except OSError as error:
        return f"cannot read the probe's certificate files: {error}"
    options = [("grpc.ssl_target_name_override", args.server_name)]
    with grpc.secure_channel(f"127.0.0.1:{args.port}", tls, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            answer = stub.Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as error:
            return (
                f"health check of port {args.port} failed: {error.code().name}: {error.details()}"
            )
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    if answer.status != SERVING and not args.alive:
        return f"port {args.port} answers {status} for service {args.service!r}"
    return None


def main(argv: list[str] | None = None) -> int:
    reason = problem(parse_args(argv))
    if reason is not None:
        print(reason, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
