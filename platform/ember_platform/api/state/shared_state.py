"""`ember.Dict` and `ember.Queue`: state an app's replicas and clients share, kept by
the control plane in its state store (so it outlives replicas and restarts).

Each belongs to an app (`/v1/apps/{app}/dicts/{name}`), reachable with a token that may
call that app: an admin token, an invoke token for the app or for all apps, a replica's
own. Values are JSON, stored as the text that came. A queue's `get` waits (long polls)
up to a minute for a value to arrive; a put wakes the waiters of that queue in this
process.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.declarations.settings import check_name
from ember.errors import InvalidError
from ember_platform.api.workspaces import Tenancy, named_workspace
from ember_platform.edge.errors import HttpError
from ember_platform.errors import Forbidden, UnknownWorkspace
from ember_platform.security.tokens import Scope
from ember_platform.storage.state_store import StateStore

KEY_NOT_FOUND = "key_not_found"  # a 404 that is an answer (the key has no value), not an error
MAX_VALUE_BYTES = 1024 * 1024  # one value's JSON text
MAX_KEY_BYTES = 512
MAX_BODY_BYTES = 8 * MAX_VALUE_BYTES  # a request: a value, or a batch of queue values
MAX_BATCH = 1000  # values one queue put or get carries
MAX_WAIT_S = 60.0  # a queue get's longest wait; the SDK asks again for longer ones
MAX_KEYS_LISTED = 10_000


def _checked_value(value: Any, what: str) -> bytes:
    try:
        text = json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
    except ValueError:  # NaN or Infinity, which json.loads lets in
        raise HttpError(400, "invalid_request", f"{what} is not valid JSON (NaN?)") from None
    except RecursionError:
        raise HttpError(400, "invalid_request", f"{what} is nested too deep") from None
    if len(text) > MAX_VALUE_BYTES:
        raise HttpError(
            413, "payload_too_large", f"{what} is {len(text)} bytes of JSON; the most is "
            f"{MAX_VALUE_BYTES} (keep large data in weights= or files, and its name here)"
        )  # fmt: skip
    return text


def _checked_key(key: str) -> str:
    try:
        size = len(key.encode())
    except UnicodeEncodeError:
        raise HttpError(400, "invalid_request", "a key is UTF-8 text") from None
    if not 0 < size <= MAX_KEY_BYTES:
        raise HttpError(400, "invalid_request", f"a key is 1 to {MAX_KEY_BYTES} bytes")
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise HttpError(400, "invalid_request", "a key holds no control characters")
    return key


def _request_key(request: Request) -> str:
    """The item's key, from the path itself: the route's pattern would give "k" for
    ".../items/k\n" (its `$` matches before a last newline)."""
    path: str = request.scope["path"]
    return _checked_key(path.split("/items/", 1)[1])


def reachable(tenancy: Tenancy, request: Request, kind: str) -> tuple[str, str]:
    """(app key, name) of a request for an app's dict, queue or volume, once its token may
    reach the app (one that may not, another workspace's among them, is told the app does
    not exist)."""
    grant = tenancy.grant(request, Scope.INVOKE)
    app, name = request.path_params["app"], request.path_params.get("name", "")
    try:
        if "name" in request.path_params:
            check_name(kind, name)
    except InvalidError as exc:
        raise HttpError(400, "invalid_request", str(exc)) from None
    try:
        key = tenancy.workspaces.app_of(grant, named_workspace(request), app)
    except (Forbidden, UnknownWorkspace):
        key = None
    if key is None or not grant.may_call(key):
        raise HttpError(404, "not_found", f"no app named {app}")
    return key, name


class SharedStateApi:
    def __init__(
        self, tenancy: Tenancy, store: StateStore, stopping: asyncio.Event | None = None
    ) -> None:
        self.tenancy = tenancy
        self.store = store
        self.stopping = stopping or asyncio.Event()  # set: waiting gets end, empty
        self._arrivals: defaultdict[tuple[str, str], asyncio.Event] = defaultdict(asyncio.Event)

    def routes(self) -> list[Route]:
        dicts = "/v1/apps/{app}/dicts/{name}"
        queues = "/v1/apps/{app}/queues/{name}"
        return [
            Route(dicts, self.dict_info, methods=["GET"]),
            Route(dicts, self.dict_clear, methods=["DELETE"]),
            Route(dicts + "/items/{key:path}", self.dict_get, methods=["GET"]),
            Route(dicts + "/items/{key:path}", self.dict_put, methods=["PUT"]),
            Route(dicts + "/items/{key:path}", self.dict_delete, methods=["DELETE"]),
            Route(queues, self.queue_info, methods=["GET"]),
            Route(queues, self.queue_clear, methods=["DELETE"]),
            Route(queues + "/put", self.queue_put, methods=["POST"]),
            Route(queues + "/get", self.queue_get, methods=["POST"]),
        ]

    def _target(self, request: Request, kind: str) -> tuple[str, str]:
        return reachable(self.tenancy, request, kind)

    @staticmethod
    async def _body(request: Request) -> Any:
        data = bytearray()
        async for chunk in request.stream():
            data.extend(chunk)
            if len(data) > MAX_BODY_BYTES:
                raise HttpError(
                    413, "payload_too_large", f"a request is limited to {MAX_BODY_BYTES} bytes"
                )
        try:
            return json.loads(data) if data else {}
        except ValueError:
            raise HttpError(400, "invalid_json", "the body is not valid JSON") from None
        except RecursionError:
            raise HttpError(400, "invalid_json", "the body's JSON is nested too deep") from None

    # ----- dicts ----------------------------------------------------------------------
    async def dict_info(self, request: Request) -> Response:
        """The dict's size and its keys, in order (up to `?limit=`, 1000 by default, after
        `?after=KEY` when given)."""
        app, name = self._target(request, "dict")
        try:
            limit = int(request.query_params.get("limit", "1000"))
        except ValueError:
            raise HttpError(400, "invalid_request", "limit is a whole number") from None
        limit = max(0, min(limit, MAX_KEYS_LISTED))
        after = request.query_params.get("after")  # the keys after this one: the next page
        now = time.time()
        return JSONResponse(
            {
                "app": app,
                "name": name,
                "count": self.store.dict_count(app, name, now),
                "keys": self.store.dict_keys(app, name, now, limit, after),
            }
        )

    async def dict_clear(self, request: Request) -> Response:
        app, name = self._target(request, "dict")
        return JSONResponse({"removed": self.store.dict_clear(app, name)})

    async def dict_get(self, request: Request) -> Response:
        return self._item_answer(request, self.store.dict_get)

    async def dict_put(self, request: Request) -> Response:
        """Set a key: `{"value": ..., "ttl": seconds}` (ttl optional: it expires then)."""
        app, name = self._target(request, "dict")
        key = _request_key(request)
        payload = await self._body(request)
        if not isinstance(payload, dict) or "value" not in payload:
            raise HttpError(400, "invalid_request", 'send {"value": ..., "ttl": seconds}')
        ttl = payload.get("ttl")
        if ttl is not None and (
            isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl <= 10**9
        ):
            raise HttpError(
                400,
                "invalid_request",
                f"ttl is seconds, more than 0 and at most 1e9 (about 31 years), not {ttl!r}",
            )
        value = _checked_value(payload["value"], f"the value of {key!r}")
        expires_at = None if ttl is None else time.time() + ttl
        self.store.dict_put(app, name, key, value, expires_at)
        return JSONResponse({"key": key, "expires_at": expires_at})

    async def dict_delete(self, request: Request) -> Response:
        return self._item_answer(request, self.store.dict_delete)

    def _item_answer(
        self, request: Request, read: Callable[[str, str, str, float], bytes | None]
    ) -> Response:
        """`{"value": ...}` of the request's key, as `read` (get or delete) gives it."""
        app, name = self._target(request, "dict")
        key = _request_key(request)
        value = read(app, name, key, time.time())
        if value is None:
            raise HttpError(404, KEY_NOT_FOUND, f"dict {name} has no key {key!r}")
        return Response(b'{"value":' + value + b"}", media_type="application/json")

    # ----- queues ---------------------------------------------------------------------
    async def queue_info(self, request: Request) -> Response:
        app, name = self._target(request, "queue")
        return JSONResponse(
            {"app": app, "name": name, "length": self.store.queue_length(app, name)}
        )

    async def queue_clear(self, request: Request) -> Response:
        app, name = self._target(request, "queue")
        return JSONResponse({"removed": self.store.queue_clear(app, name)})

    async def queue_put(self, request: Request) -> Response:
        """Append `{"values": [...]}` in order, all or none."""
        app, name = self._target(request, "queue")
        payload = await self._body(request)
        values = payload.get("values") if isinstance(payload, dict) else None
        if not isinstance(values, list) or not 1 <= len(values) <= MAX_BATCH:
            raise HttpError(
                400, "invalid_request", f'send {{"values": [...]}} with 1 to {MAX_BATCH} values'
            )
        texts = [_checked_value(v, f"value {i}") for i, v in enumerate(values)]
        self.store.queue_put(app, name, texts)
        self._arrivals[(app, name)].set()
        return JSONResponse({"length": self.store.queue_length(app, name)})

    async def queue_get(self, request: Request) -> Response:
        """Take up to `max` values (1 by default), waiting up to `timeout` seconds (0 by
        default, at most 60) for the first: `{"values": [...]}`, empty if none came."""
        app, name = self._target(request, "queue")
        payload = await self._body(request)
        if not isinstance(payload, dict):
            raise HttpError(400, "invalid_request", 'send {"max": 1, "timeout": 10}')
        most, timeout = payload.get("max", 1), payload.get("timeout", 0)
        if isinstance(most, bool) or not isinstance(most, int) or not 1 <= most <= MAX_BATCH:
            raise HttpError(400, "invalid_request", f"max is 1 to {MAX_BATCH}")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0:
            raise HttpError(400, "invalid_request", "timeout is seconds, 0 or more")
        deadline = time.monotonic() + min(float(timeout), MAX_WAIT_S)
        arrived = self._arrivals[(app, name)]
        while True:
            arrived.clear()  # before looking: a put from now on wakes this wait
            values = self.store.queue_take(app, name, most)
            left = deadline - time.monotonic()
            if values or left <= 0 or self.stopping.is_set():
                break
            woken = asyncio.ensure_future(arrived.wait())
            stop = asyncio.ensure_future(self.stopping.wait())
            try:
                await asyncio.wait((woken, stop), timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                woken.cancel()
                stop.cancel()
            if await request.is_disconnected():
                break  # its caller left: take nothing for nobody
        body = b'{"values":[' + b",".join(values) + b"]}"
        return Response(body, media_type="application/json")
