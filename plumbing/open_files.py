"""The open-files limit a server process runs with. Every connection is an open file (in
Envoy, each REST call in flight holds one): a soft limit of 1,024, common on desktops and in
some service managers, would refuse connections long before a replica's engine is full. Raised
to the hard limit the host allows, as vLLM's own server raises it."""

from __future__ import annotations

import resource
import sys


def raise_open_files_limit() -> int:
    """Raise the soft limit to the hard one (where allowed); the soft limit in force after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return sys.maxsize
    # An unlimited hard limit still stops at the kernel's per-process maximum (1,048,576).
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # kept as it was; the caller reports what it got
    return soft
