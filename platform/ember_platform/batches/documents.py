"""The OpenAI Batch API's objects as its clients read them (files, batches, and the lines
of output and error files), pure."""

from __future__ import annotations

import json
from typing import Any

from ember_platform.batches.input_files import LineError
from ember_platform.storage.records import BatchRecord, CallRecord, OpenAIFileRecord

COMPLETION_WINDOWS = {"24h": 86400}  # OpenAI's one window
MAX_TEXT_BODY = 1024 * 1024  # of an answer kept as text because JSON could not hold it
# Statuses from which a batch moves no more.
ENDED = frozenset({"completed", "failed", "expired", "cancelled"})


def file_object(record: OpenAIFileRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": int(record.created_at),
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "status_details": None,
    }


def new_batch(
    batch_id: str,
    endpoint: str,
    input_file_id: str,
    window: str,
    metadata: dict[str, str] | None,
    now: float,
) -> dict[str, Any]:
    """A batch just made, before its input file was read."""
    return {
        "id": batch_id,
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": int(now),
        "in_progress_at": None,
        "expires_at": int(now) + COMPLETION_WINDOWS[window],
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
    }


def batch_object(record: BatchRecord) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(record.document)
    return document


def failed_validation(document: dict[str, Any], error: LineError, now: float) -> None:
    """The batch fails as a whole, before any request runs (a custom_id used twice)."""
    document["status"] = "failed"
    document["failed_at"] = int(now)
    document["errors"] = {
        "object": "list",
        "data": [
            {"code": error.code, "message": error.message, "param": "custom_id", "line": error.line}
        ],
    }


def answered_line(request_id: str, custom_id: str, record: CallRecord) -> dict[str, Any]:
    """A request's line in the output file (a 200) or the error file (any other status):
    the endpoint's answer as its own route would give it."""
    body: Any = None
    if record.result is not None:
        try:
            body = json.loads(record.result)
        except (ValueError, RecursionError):  # a file, text, or JSON nested too deep: text
            body = record.result.decode("utf-8", "replace")
    return {
        "id": request_id,
        "custom_id": custom_id,
        "response": {"status_code": record.http_status, "request_id": record.id, "body": body},
        "error": None,
    }


def error_line(request_id: str, custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """A line that never ran: malformed, or left when the batch expired."""
    return {
        "id": request_id,
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def encoded(line: dict[str, Any]) -> bytes:
    """One JSONL line; an answer too deep to write again as JSON is kept as text."""
    try:
        return json.dumps(line).encode() + b"\n"
    except (ValueError, RecursionError):
        response = line["response"]
        response["body"] = json.dumps(str(response["body"])[:MAX_TEXT_BODY])
        return json.dumps(line).encode() + b"\n"
