"""The control plane's own errors, as its core, call handling and security raise them.

Each names its error `type` as the API reports it (`{"error": {"type", "message"}}`);
which HTTP status it answers with is the HTTP layer's to say (`edge/errors.py`), so that
nothing below it knows of HTTP.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar


class PlatformError(Exception):
    """Refused or failed for a reason the caller is told: `message` says why."""

    error_type: ClassVar[str] = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def body(self) -> bytes:
        return error_body(self.error_type, self.message)


class InvalidRequest(PlatformError):
    """What the caller sent cannot be taken as it is (a header, an address)."""

    error_type = "invalid_request"


class Unauthorized(PlatformError):
    """No token, or one that is not valid (unknown, revoked, expired)."""

    error_type = "unauthorized"


class TokenRefused(Unauthorized):
    """A call's token missing or not valid: its caller is asked for a bearer token."""


class RateLimited(PlatformError):
    """A token past its rate limit: the caller retries after `retry_after` seconds."""

    error_type = "rate_limited"

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Forbidden(PlatformError):
    """A valid token whose scope does not allow this."""

    error_type = "forbidden"


class UnknownEndpoint(PlatformError):
    """A call of an endpoint that is not deployed (or no longer is)."""

    error_type = "not_found"


class UnknownWorkspace(PlatformError):
    """A workspace that does not exist (`ember workspace ls` lists them)."""

    error_type = "not_found"


class QueueFull(PlatformError):
    """The endpoint's queue holds its `max_queue` inputs: the caller retries later."""

    error_type = "queue_full"


class WorkspaceLimitReached(PlatformError):
    """The workspace of the endpoint called is at one of its admission limits
    (`limits/admission.py`): the caller retries after `retry_after` seconds."""

    error_type = "workspace_limit"

    def __init__(self, message: str, limit: str, retry_after: float) -> None:
        super().__init__(message)
        self.limit = limit  # "max_queued", "max_running" or "rate"
        self.retry_after = retry_after


class DiskFull(PlatformError):
    """What had to be recorded first could not be: the state dir's disk is full."""

    error_type = "insufficient_storage"


class StoreUnavailable(PlatformError):
    """What had to be recorded first could not be: the state database is out of reach."""

    error_type = "state_store_unavailable"


def error_body(error_type: str, message: str, fields: dict[str, Any] | None = None) -> bytes:
    """An error as callers get it, whatever carries it: `{"error": {"type", "message"}}`,
    plus `fields` (OpenAI's `param` and `code`, from an ember.InputError that gives them)."""
    return json.dumps(
        {"error": {"type": error_type, "message": message, **(fields or {})}}
    ).encode()
