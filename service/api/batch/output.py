"""A job's output file, LLM Engine's: a JSON list in input order, each item the body the
synchronous endpoint answers for that line, or the error it answered with, or, for a line that
did not run (the job was cancelled, expired or failed), an error saying so. Written whole
(replaced atomically, or one PUT to a bucket) when the job ends."""

from __future__ import annotations

import json
from typing import Any

from service.api.batch import files
from service.api.batch.store import Job

# The status a line that did not run is marked with: the job's end, as HTTP would say it.
NOT_RUN_STATUS = {"cancelled": 499, "expired": 504, "failed": 500}


def not_run(ended: str) -> dict[str, Any]:
    reasons = {
        "cancelled": "the job was cancelled",
        "expired": "the job's max_runtime_sec passed",
        "failed": "the job failed",
    }
    return {
        "error": {
            "status_code": NOT_RUN_STATUS.get(ended, 500),
            "detail": f"not run: {reasons.get(ended, 'the job ended')}",
        }
    }


def item(result: dict[str, Any]) -> dict[str, Any]:
    return result["response"] if "response" in result else {"error": result["error"]}


def write_output(job: Job, results: dict[int, dict[str, Any]], ended: str) -> None:
    items = [
        item(results[index]) if index in results else not_run(ended) for index in range(job.total)
    ]
    files.write_text(job.output_file, json.dumps(items))
