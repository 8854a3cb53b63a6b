"""HTTP errors as the platform reports them: `{"error": {"type", "message"}}`, and the
status each of the control plane's own errors (`ember_platform.errors`) answers with."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ember.errors import InvalidError
from ember_platform.errors import (
    DiskFull,
    Forbidden,
    InvalidRequest,
    PlatformError,
    QueueFull,
    RateLimited,
    StoreUnavailable,
    TokenRefused,
    Unauthorized,
    UnknownEndpoint,
    UnknownWorkspace,
    WorkspaceLimitReached,
)
from ember_platform.errors import error_body as error_body  # where callers found it
from ember_platform.security.rate_limits import retry_after_header

T = TypeVar("T")

# The one place that says which HTTP status each of the platform's errors is.
STATUS_OF: dict[type[PlatformError], int] = {
    InvalidRequest: 400,
    Unauthorized: 401,
    Forbidden: 403,
    UnknownEndpoint: 404,
    UnknownWorkspace: 404,
    QueueFull: 429,
    RateLimited: 429,
    WorkspaceLimitReached: 429,
    StoreUnavailable: 503,
    DiskFull: 507,
}
# Headers some of them carry: a full queue tells the caller when to try again.
HEADERS_OF: dict[type[PlatformError], dict[str, str]] = {
    QueueFull: {"Retry-After": "1"},
    StoreUnavailable: {"Retry-After": "5"},
    TokenRefused: {"WWW-Authenticate": "Bearer"},
}


class HttpError(Exception):
    def __init__(
        self, status: int, error_type: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(self.error_type, self.message)


def http_error(error: HttpError | PlatformError) -> HttpError:
    """The HTTP answer to an error: one of the platform's with its status (500 for one
    not listed), an `HttpError` as it is."""
    if isinstance(error, HttpError):
        return error
    kind = type(error)
    status = next((STATUS_OF[k] for k in kind.__mro__ if k in STATUS_OF), 500)
    headers = dict(next((HEADERS_OF[k] for k in kind.__mro__ if k in HEADERS_OF), {}))
    if isinstance(error, WorkspaceLimitReached | RateLimited):  # a rate's wait: its own
        headers["Retry-After"] = retry_after_header(error.retry_after)
    return HttpError(status, error.error_type, error.message, headers)


def checked_header(headers: dict[bytes, bytes], name: str, check: Callable[[str], T]) -> T | None:
    """A request header's value as `check` makes it (None when absent); 400 naming the
    header when `check` refuses it."""
    value = headers.get(name.lower().encode())
    if value is None:
        return None
    try:
        return check(value.decode("latin-1"))
    except InvalidError as exc:
        raise HttpError(400, "invalid_request", f"{name}: {exc}") from None
