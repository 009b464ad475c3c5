"""The service with a fault-injecting engine, for tests only: `python -m tests.fault_injection
serve ...` takes the same arguments as `python -m service serve`.

A request whose id (x-request-id) is `inject-engine-error-after-N` has its engine output stream
fail after N outputs, as an engine failure in the middle of a stream would. The real engine
cannot be made to fail on demand; everything else, before and after the failure, is real.
The shipped server has no such hook.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import AsyncIterator
from typing import Any

from service import cli
from service.model.standby_core import Standby, torch_loaded_single_threaded

with torch_loaded_single_threaded():  # as the server loads it: its engine core is its copy
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.exceptions import EngineGenerateError

    from service.model.engine import ServedModel, start_engine
    from service.model.frontends import FrontendLink
    from service.settings import EngineSettings
    from service.transport import server

# Engine request ids start with the request id (service.api.completions).
FAULT = re.compile(r"^(?:chatcmpl-)?inject-engine-error-after-(\d{1,6})-")


def fault_request_id(after: int) -> str:
    return f"inject-engine-error-after-{after}"


class FaultInjectingEngine:
    """The real engine, except that `generate` fails on request."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        request_id = kwargs.get("request_id", args[2] if len(args) > 2 else "")
        match = FAULT.match(request_id)
        fail_after = int(match.group(1)) if match else None
        seen = 0
        async for output in self._engine.generate(*args, **kwargs):
            if seen == fail_after:
                raise EngineGenerateError("injected engine failure")
            seen += 1
            yield output


def start_faulty_engine(
    settings: EngineSettings, link: FrontendLink | None = None, standby: Standby | None = None
) -> ServedModel:
    model = start_engine(settings, link, standby)
    return dataclasses.replace(model, engine=FaultInjectingEngine(model.engine))


if __name__ == "__main__":
    server.start_engine = start_faulty_engine
    cli.main()
