"""plumbing/call_backlog.py on a real grpc.aio server: a burst of calls far past
grpcio's default pending-call bounds (1,000 soft, 3,000 hard) reaches the servicer whole."""

from __future__ import annotations

import asyncio
import collections

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from plumbing.call_backlog import call_backlog_options

BURST = 3000
HOLD_SECONDS = 4.0


class HeldWatch(health_pb2_grpc.HealthServicer):
    """Each Watch call stays open a while, so that the whole burst is in flight at once."""

    def __init__(self) -> None:
        self.running = 0
        self.peak = 0

    async def Watch(self, request, context):
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(HOLD_SECONDS)
        self.running -= 1
        yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def burst() -> tuple[collections.Counter[str], int]:
    servicer = HeldWatch()
    server = grpc.aio.server(options=call_backlog_options())
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def one() -> str:
                try:
                    async for _ in stub.Watch(health_pb2.HealthCheckRequest(), timeout=60):
                        pass
                except grpc.aio.AioRpcError as error:
                    return error.code().name
                return "OK"

            outcomes = collections.Counter(await asyncio.gather(*(one() for _ in range(BURST))))
    finally:
        await server.stop(None)
    return outcomes, servicer.peak


def test_a_burst_of_calls_on_one_connection_is_served_whole() -> None:
    outcomes, peak = asyncio.run(burst())
    assert outcomes == {"OK": BURST}
    # Past grpcio's default bound at once (how many depends on how fast the client opens them).
    assert peak > 1000
