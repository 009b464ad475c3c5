"""Server CPU per streamed message of the two transports a streaming token pays for: a bare
grpc.aio server-streaming method (our frontend's transport, on uvloop as the service runs it,
and on asyncio's own loop) and a bare Starlette/uvicorn SSE response (vLLM's OpenAI server's),
each streaming the same small completion chunk to 64 concurrent streams over loopback. Nothing
else runs in either server, so the figure is the transport's own cost per token.

Usage: python -m bench.per_message [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from multiprocessing.synchronize import Event

import grpc
import httpx
import psutil
import uvloop
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import (
    Choice,
    CreateCompletionRequest,
    CreateCompletionResponse,
)

from tests.processes import free_port

STREAMS = 64
MESSAGES = 200  # per stream
CHUNK = CreateCompletionResponse(
    id="cmpl-0123456789abcdef0123456789abcdef",
    object="text_completion",
    created=1796000000,
    model="smollm2-135m-instruct",
    choices=[Choice(index=0, text=" word")],
)
EVENT = (
    'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion",'
    '"created":1796000000,"model":"smollm2-135m-instruct","choices":[{"index":0,'
    '"text":" word","logprobs":null,"finish_reason":null}]}\n\n'
)


class Streamer(completions_pb2_grpc.CompletionServiceServicer):
    async def CreateCompletion(
        self, request: CreateCompletionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[CreateCompletionResponse]:
        for _ in range(MESSAGES):
            yield CHUNK
            await asyncio.sleep(0)  # as a token stream does: other streams run in between


async def serve_streamer(port: int, ready: Event) -> None:
    server = grpc.aio.server()
    completions_pb2_grpc.add_CompletionServiceServicer_to_server(Streamer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    ready.set()
    await server.wait_for_termination()


def serve_grpc(port: int, ready: Event) -> None:
    """On uvloop, as our service (and uvicorn, by default) runs."""
    uvloop.run(serve_streamer(port, ready))


def serve_grpc_asyncio(port: int, ready: Event) -> None:
    asyncio.run(serve_streamer(port, ready))


def serve_sse(port: int, ready: Event) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def events() -> AsyncIterator[str]:
        for _ in range(MESSAGES):
            yield EVENT
            await asyncio.sleep(0)

    async def stream(request: Request) -> StreamingResponse:
        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/stream", stream)])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    ready.set()
    server.run()


async def read_grpc(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)

        async def one() -> int:
            return len([m async for m in stub.CreateCompletion(CreateCompletionRequest())])

        return sum(await asyncio.gather(*(one() for _ in range(STREAMS))))


async def read_sse(port: int) -> int:
    async with httpx.AsyncClient(timeout=60) as client:

        async def one() -> int:
            async with client.stream("GET", f"http://127.0.0.1:{port}/stream") as reply:
                return len([line async for line in reply.aiter_lines() if line])

        return sum(await asyncio.gather(*(one() for _ in range(STREAMS))))


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def microseconds_per_message(
    serve: Callable[[int, Event], None], read: Callable[[int], Awaitable[int]], rounds: int
) -> list[float]:
    """The server's CPU per message received by the clients, once per round."""
    port = free_port()
    ready = multiprocessing.Event()
    server = multiprocessing.Process(target=serve, args=(port, ready), daemon=True)
    server.start()
    ready.wait()
    time.sleep(1.0)  # uvicorn binds after `ready`
    process = psutil.Process(server.pid)
    asyncio.run(read(port))  # warm up
    figures = []
    for _ in range(rounds):
        before = cpu_seconds(process)
        messages = asyncio.run(read(port))
        figures.append((cpu_seconds(process) - before) / messages * 1e6)
    server.terminate()
    server.join()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    grpc_figures = microseconds_per_message(serve_grpc, read_grpc, rounds)
    asyncio_figures = microseconds_per_message(serve_grpc_asyncio, read_grpc, rounds)
    sse_figures = microseconds_per_message(serve_sse, read_sse, rounds)
    for name, figures in (
        ("grpc.aio on uvloop", grpc_figures),
        ("grpc.aio on asyncio's loop", asyncio_figures),
        ("Starlette/uvicorn SSE", sse_figures),
    ):
        shown = ", ".join(f"{figure:.1f}" for figure in figures)
        print(f"{name}: server CPU per message {min(figures):.1f} us (rounds: {shown})")
    print(f"ratio grpc.aio on uvloop / SSE: {min(grpc_figures) / min(sse_figures):.1f}x")


if __name__ == "__main__":
    main()
