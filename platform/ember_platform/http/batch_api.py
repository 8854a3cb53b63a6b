"""OpenAI's Batch API on an endpoint that serves OpenAI routes: `{label}/v1/files` and
`{label}/v1/batches`, in OpenAI's shapes, so that its client's `files` and `batches`
work with the endpoint's URL as `base_url` and an Ember token as the API key.

Files and batches are the endpoint's: found only under the label they were made at, by
a token that may call it (a public endpoint's too: its files are not public).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ember.wire.labels import Route
from ember_platform.batches.documents import COMPLETION_WINDOWS, file_object
from ember_platform.batches.openai_files import OpenAIFiles
from ember_platform.batches.runner import BatchRunner
from ember_platform.edge.asgi_types import Send
from ember_platform.edge.errors import HttpError
from ember_platform.errors import error_body
from ember_platform.http.call_arguments import form_fields
from ember_platform.http.call_responses import send_body, send_json
from ember_platform.runtime.cluster_model import EndpointRuntime

# The routes an endpoint's batch may run: OpenAI's that take a batch.
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
LIST_LIMIT = 100


class OpenAIError(HttpError):
    """An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None, code: str | None) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        super().__init__(status, kind, message)
        self.fields = {"param": param, "code": code}

    def body(self) -> bytes:
        return error_body(self.error_type, self.message, self.fields)


def serves_batches(runtime: EndpointRuntime) -> bool:
    """Whether the endpoint serves a route a batch may run (Batch API paths are then its)."""
    return any(runtime.spec.method_at(path[1:]) is not None for path in BATCH_ENDPOINTS)


def is_batch_path(path: str) -> bool:
    """Whether a route's path (after the label) is the Batch API's."""
    return path in ("v1/files", "v1/batches") or path.startswith(("v1/files/", "v1/batches/"))


def is_batch_request(route: Route, runtime: EndpointRuntime) -> bool:
    """A Batch API path of an endpoint that serves OpenAI routes (and not itself)."""
    return (
        route.method[:3] == "v1/"  # first: every call asks
        and is_batch_path(route.method)
        and runtime.spec.method_at(route.method) is None
        and serves_batches(runtime)
    )


class BatchApi:
    def __init__(self, runner: BatchRunner, files: OpenAIFiles) -> None:
        self.runner = runner
        self.files = files

    async def handle(
        self, scope: dict[str, Any], send: Send, route: Route, body: bytes, content_type: str
    ) -> None:
        parts = route.method.split("/")[1:]  # ["files", id, "content"], ["batches", id, ...]
        method = scope["method"]
        label = route.label
        if parts[0] == "files":
            answer = await self._files(method, label, parts[1:], body, content_type, send)
        else:
            answer = await self._batches(method, label, parts[1:], body)
        if answer is not None:
            await send_json(send, 200, json.dumps(answer).encode())

    async def _files(
        self,
        method: str,
        label: str,
        rest: list[str],
        body: bytes,
        content_type: str,
        send: Send,
    ) -> dict[str, Any] | None:
        if not rest:
            if method == "POST":
                return await self._upload(label, body, content_type)
            if method == "GET":
                listed = await asyncio.to_thread(
                    self.files.store.list_openai_files, label, LIST_LIMIT
                )
                return _listing([file_object(record) for record in listed])
            raise _not_allowed(method, "v1/files")
        record = await asyncio.to_thread(self.files.of, label, rest[0])
        if record is None:
            raise OpenAIError(404, f"No such File object: {rest[0]}", "id", "not_found")
        if rest[1:] == ["content"] and method == "GET":
            data = await asyncio.to_thread(self.files.content, record)
            await send_body(send, 200, data, {"content-type": "application/octet-stream"})
            return None
        if len(rest) == 1 and method == "GET":
            return file_object(record)
        if len(rest) == 1 and method == "DELETE":
            await asyncio.to_thread(self.files.delete, record)
            return {"id": record.id, "object": "file", "deleted": True}
        raise _not_allowed(method, f"v1/files/{'/'.join(rest)}")

    async def _upload(self, label: str, body: bytes, content_type: str) -> dict[str, Any]:
        if not content_type.lower().startswith("multipart/form-data"):
            raise OpenAIError(400, "upload a file as multipart/form-data", None, "invalid_request")
        fields = {field.name: field for field in form_fields(content_type, body)}
        purpose = fields.get("purpose")
        if purpose is None or purpose.data.decode("utf-8", "replace") != "batch":
            raise OpenAIError(400, "purpose must be 'batch'", "purpose", "invalid_value")
        upload = fields.get("file")
        if upload is None:
            raise OpenAIError(400, "the form has no 'file' part", "file", "missing_required")
        name = upload.filename or "input.jsonl"
        record = await asyncio.to_thread(self.files.add, label, "batch", name, upload.data)
        return file_object(record)

    async def _batches(
        self, method: str, label: str, rest: list[str], body: bytes
    ) -> dict[str, Any]:
        if not rest:
            if method == "POST":
                return await self._create(label, body)
            if method == "GET":
                return _listing(self.runner.listing(label, LIST_LIMIT))
            raise _not_allowed(method, "v1/batches")
        if rest[1:] == ["cancel"] and method == "POST":
            document = self.runner.cancel(label, rest[0])
        elif len(rest) == 1 and method == "GET":
            document = self.runner.get(label, rest[0])
        else:
            raise _not_allowed(method, f"v1/batches/{'/'.join(rest)}")
        if document is None:
            raise OpenAIError(404, f"No such Batch object: {rest[0]}", "id", "not_found")
        return document

    async def _create(self, label: str, body: bytes) -> dict[str, Any]:
        try:
            asked = json.loads(body or b"{}")
        except (ValueError, RecursionError):
            raise OpenAIError(400, "the body is not JSON", None, "invalid_json") from None
        if not isinstance(asked, dict):
            raise OpenAIError(400, "the body must be a JSON object", None, "invalid_json")
        input_file = asked.get("input_file_id")
        endpoint = asked.get("endpoint")
        window = asked.get("completion_window")
        metadata = asked.get("metadata")
        if not isinstance(input_file, str):
            raise OpenAIError(400, "input_file_id is required", "input_file_id", "missing")
        if endpoint not in BATCH_ENDPOINTS:
            said = f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}"
            raise OpenAIError(400, said, "endpoint", "invalid_value")
        if window not in COMPLETION_WINDOWS:
            said = f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}"
            raise OpenAIError(400, said, "completion_window", "invalid_value")
        if metadata is not None and not (
            isinstance(metadata, dict)
            and len(metadata) <= 16
            and all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                for k, v in metadata.items()
            )
        ):
            said = "metadata is at most 16 keys of 64 characters, with values of 512"
            raise OpenAIError(400, said, "metadata", "invalid_value")
        try:
            return await self.runner.create(label, input_file, endpoint, window, metadata)
        except LookupError as missing:
            raise OpenAIError(404, str(missing), "input_file_id", "not_found") from None
        except ValueError as refused:
            raise OpenAIError(400, str(refused), "input_file_id", "invalid_file") from None


def _listing(data: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": False,
    }


def _not_allowed(method: str, path: str) -> OpenAIError:
    return OpenAIError(405, f"{method} {path} is not a Batch API request", None, "not_allowed")
