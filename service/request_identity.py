"""The request id that follows a call through Envoy, the service, the engine and the logs."""

from __future__ import annotations

import re
import uuid

import grpc

REQUEST_ID_HEADER = "x-request-id"
# Accepted from callers as is; anything else is replaced, so ids stay safe to log and echo.
ACCEPTABLE_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")


def request_id(context: grpc.aio.ServicerContext) -> str:
    """The caller's (or Envoy's) x-request-id when it is sane, else a new one."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_HEADER and isinstance(value, str) and ACCEPTABLE_ID.match(value):
            return value
    return uuid.uuid4().hex
