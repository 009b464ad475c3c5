"""Where the frontends of a replica keep their metrics: prometheus_client's multiprocess
directory, which the parent scrapes as one.

prometheus_client chooses how a metric keeps its value when it is imported, and vLLM's imports
and ours make metrics at import. The frontends are copies of the parent made after its imports
(service/model/standby_core.py), so the directory is named in the environment before the
parent imports either (`metrics_directory`, in the command line), not when it starts them.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"


@contextlib.contextmanager
def metrics_directory() -> Iterator[str]:
    """A fresh directory for the frontends' metrics, named in the environment while held."""
    with tempfile.TemporaryDirectory(prefix="llm-completions-metrics-") as path:
        os.environ[MULTIPROCESS_ENV] = path
        try:
            yield path
        finally:
            os.environ.pop(MULTIPROCESS_ENV, None)


def require_metrics_directory() -> None:
    if not os.path.isdir(os.environ.get(MULTIPROCESS_ENV, "")):
        raise RuntimeError(
            f"several frontends need {MULTIPROCESS_ENV} set to a directory before "
            "prometheus_client is imported: start the replica within metrics_directory()"
        )
