"""HTTP errors as the platform reports them: `{"error": {"type", "message"}}`."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TypeVar

from ember.errors import InvalidError

T = TypeVar("T")


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


def error_body(error_type: str, message: str) -> bytes:
    return json.dumps({"error": {"type": error_type, "message": message}}).encode()


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
