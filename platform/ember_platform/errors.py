"""HTTP errors as the platform reports them: `{"error": {"type", "message"}}`."""

from __future__ import annotations

import json


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
