"""`ember.Dict` and `ember.Queue`: state shared by an app's replicas and its clients,
kept by the control plane (it outlives replicas, redeploys and restarts).

    results = ember.Dict("results")       # in a replica: the replica's app
    results["doc-17"] = {"summary": "…"}  # values are JSON
    jobs = ember.Queue("jobs", app="etl")  # outside a replica, name the app
    jobs.put({"url": "…"})
    job = jobs.get(timeout=30)             # waits for one; queue.Empty if none came

Keys are strings up to 512 bytes of UTF-8, without control characters; a value is JSON
up to 1 MiB (keep large data in `weights=` or files, and its name here); one request
carries up to 8 MiB. `put(key, value, ttl=60)` lets a key expire.
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx

from ember.calling.client import error_from_response
from ember.calling.connections import request_timeout, shared_async_client, shared_client
from ember.config import ClientConfig, load_config
from ember.declarations.settings import check_name
from ember.errors import InvalidError
from ember.wire.labels import app_here, check_app, current_app

REQUEST_TIMEOUT_S = 30.0
LONGEST_POLL_S = 60.0  # what the platform waits at most per request; longer waits ask again
MAX_KEY_BYTES = 512
MAX_REQUEST_BYTES = 8 * 1024 * 1024  # what the platform takes in one request
MAX_BATCH = 1000  # values one queue put or get carries
KEYS_PAGE = 1000  # keys asked for at a time when iterating
_MISSING = object()


def _json_body(body: dict[str, Any]) -> dict[str, Any]:
    """Request arguments that send `body` as JSON, or InvalidError naming what JSON
    cannot carry (a set, an object, NaN), before anything is sent."""
    try:
        content = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise InvalidError(f"ember.Dict and ember.Queue values are JSON: {exc}") from None
    except RecursionError:
        raise InvalidError("ember.Dict and ember.Queue values are JSON: nested too deep") from None
    if len(content) > MAX_REQUEST_BYTES:
        raise InvalidError(
            f"{len(content)} bytes of JSON in one request; the platform takes up to "
            f"{MAX_REQUEST_BYTES // 2**20} MiB (put fewer values at once)"
        )
    return {"content": content, "headers": {"Content-Type": "application/json"}}


def checked_key(key: object) -> str:
    """A key the platform can hold, or InvalidError saying why not, before anything is sent."""
    if not isinstance(key, str):
        raise InvalidError(f"ember.Dict keys are strings, not {type(key).__name__}")
    try:
        size = len(key.encode())
    except UnicodeEncodeError:
        raise InvalidError(f"ember.Dict key {key!r} is not valid Unicode") from None
    if not 0 < size <= MAX_KEY_BYTES:
        raise InvalidError(f"ember.Dict keys are 1 to {MAX_KEY_BYTES} bytes, not {size}")
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise InvalidError(f"ember.Dict key {key!r} holds a control character")
    return key


def _key_segment(key: str) -> str:
    # Dots too: an HTTP client drops a path segment of "." or ".." (and the one before),
    # which would turn an item's URL into the dict's own (DELETE clears the dict).
    return quote(key, safe="").replace(".", "%2E")


def _answer(response: httpx.Response) -> Any:
    if response.status_code != 200:
        raise error_from_response(response.status_code, response.content)
    return response.json()


class _Shared:
    kind = ""

    def __init__(self, name: str, *, app: str | None = None, config: ClientConfig | None = None):
        self.name = check_name(self.kind, name)
        # Without app=, the replica's app, found when first used: a module-level
        # `ember.Dict("results")` is also imported where there is none (`ember deploy`).
        self._app = None if app is None else check_app(app)
        self._config = config

    @property
    def app(self) -> str:
        if self._app is None:
            self._app = app_here(f"ember.{type(self).__name__}({self.name!r})")
        return self._app

    @property
    def _path(self) -> str:
        return f"/v1/apps/{self.app}/{self.kind}s/{self.name}"

    @property
    def config(self) -> ClientConfig:
        if self._config is None:
            self._config = load_config()  # read when first used, not at import
        return self._config

    def _send(self, method: str, path: str, wait: float = 0.0, **kwargs: Any) -> httpx.Response:
        timeout = request_timeout(wait + REQUEST_TIMEOUT_S)
        return shared_client(self.config).request(method, path, timeout=timeout, **kwargs)

    async def _asend(
        self, method: str, path: str, wait: float = 0.0, **kwargs: Any
    ) -> httpx.Response:
        client = await shared_async_client(self.config)
        timeout = request_timeout(wait + REQUEST_TIMEOUT_S)
        return await client.request(method, path, timeout=timeout, **kwargs)

    def __repr__(self) -> str:
        app = self._app or current_app() or "?"
        return f"<ember.{type(self).__name__} {app}/{self.name}>"


def _value_or(response: httpx.Response, key: str, default: Any) -> Any:
    """A dict item's value from its answer; `default` (or KeyError) when it has none."""
    if response.status_code == 404 and b'"key_not_found"' in response.content:
        if default is _MISSING:
            raise KeyError(key)
        return default
    return _answer(response)["value"]  # another 404 (no such app for this token) raises


class Dict(_Shared):
    """A key-value store of the app's, in the control plane. Each method has an async
    twin for asyncio code (`await d.aget(key)`, `aput`, `apop`)."""

    kind = "dict"

    def _item(self, key: str) -> str:
        return f"{self._path}/items/{_key_segment(checked_key(key))}"

    @staticmethod
    def _put_body(value: Any, ttl: float | None) -> dict[str, Any]:
        return _json_body({"value": value} if ttl is None else {"value": value, "ttl": ttl})

    def get(self, key: str, default: Any = None) -> Any:
        """The key's value, or `default` when it has none (or it expired)."""
        return _value_or(self._send("GET", self._item(key)), key, default)

    async def aget(self, key: str, default: Any = None) -> Any:
        return _value_or(await self._asend("GET", self._item(key)), key, default)

    def __getitem__(self, key: str) -> Any:
        return _value_or(self._send("GET", self._item(key)), key, _MISSING)

    def put(self, key: str, value: Any, *, ttl: float | None = None) -> None:
        """Set the key (to any JSON value); with `ttl`, it expires after that many seconds."""
        _answer(self._send("PUT", self._item(key), **self._put_body(value, ttl)))

    async def aput(self, key: str, value: Any, *, ttl: float | None = None) -> None:
        _answer(await self._asend("PUT", self._item(key), **self._put_body(value, ttl)))

    def __setitem__(self, key: str, value: Any) -> None:
        self.put(key, value)

    def pop(self, key: str, default: Any = _MISSING) -> Any:
        """Remove the key and return its value (`default`, or KeyError, if it has none)."""
        return _value_or(self._send("DELETE", self._item(key)), key, default)

    async def apop(self, key: str, default: Any = _MISSING) -> Any:
        return _value_or(await self._asend("DELETE", self._item(key)), key, default)

    def __delitem__(self, key: str) -> None:
        self.pop(key)

    def __contains__(self, key: object) -> bool:
        try:
            self[checked_key(key)]
        except (KeyError, InvalidError):  # a key it cannot hold is not in it
            return False
        return True

    def _info(self, limit: int, after: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if after is not None:
            params["after"] = after
        return _answer(self._send("GET", self._path, params=params))

    def __len__(self) -> int:
        return int(self._info(0)["count"])

    def keys(self, limit: int | None = None) -> list[str]:
        """The keys in order: all of them, or the first `limit`."""
        keys: list[str] = []
        for key in self:
            if limit is not None and len(keys) >= limit:
                break
            keys.append(key)
        return keys

    def __iter__(self) -> Iterator[str]:
        """Every key in order, a page at a time (a key set meanwhile may or may not come)."""
        after: str | None = None
        while True:
            page = list(self._info(KEYS_PAGE, after)["keys"])
            yield from page
            if len(page) < KEYS_PAGE:
                return
            after = page[-1]

    def clear(self) -> int:
        """Remove every key; how many there were."""
        return int(_answer(self._send("DELETE", self._path))["removed"])


class Queue(_Shared):
    """A first-in, first-out queue of the app's, in the control plane: a value is taken
    by one `get`, whoever calls it (a work queue across replicas). `aput`, `aput_many`,
    `aget` and `aget_many` are the async twins."""

    kind = "queue"

    def put(self, value: Any) -> None:
        self.put_many([value])

    async def aput(self, value: Any) -> None:
        await self.aput_many([value])

    def put_many(self, values: list[Any]) -> None:
        """Append the values in order (up to 1000, and 8 MiB of JSON, at once), all or
        none; none at all is nothing to do."""
        if body := _put_body(values):
            _answer(self._send("POST", f"{self._path}/put", **body))

    async def aput_many(self, values: list[Any]) -> None:
        if body := _put_body(values):
            _answer(await self._asend("POST", f"{self._path}/put", **body))

    @staticmethod
    def _polls(block: bool, timeout: float | None) -> Iterator[float]:
        """How long each request waits: one poll when not blocking; else up to a minute
        each until `timeout` has passed (for ever when None)."""
        if not block:
            yield 0.0
            return
        wait_until = None if timeout is None else time.monotonic() + timeout
        while True:
            left = LONGEST_POLL_S if wait_until is None else wait_until - time.monotonic()
            yield max(0.0, min(left, LONGEST_POLL_S))
            if wait_until is not None and time.monotonic() >= wait_until:
                return

    def get_many(self, most: int, *, block: bool = True, timeout: float | None = None) -> list:
        """Up to `most` values, as soon as there is one; waits up to `timeout` seconds
        (for ever when None, not at all when `block` is false): [] if none came."""
        _check_most(most)
        for poll in self._polls(block, timeout):
            body = {"max": most, "timeout": poll}
            values = _answer(self._send("POST", f"{self._path}/get", poll, json=body))["values"]
            if values:
                return list(values)
        return []

    async def aget_many(
        self, most: int, *, block: bool = True, timeout: float | None = None
    ) -> list:
        _check_most(most)
        for poll in self._polls(block, timeout):
            body = {"max": most, "timeout": poll}
            answer = await self._asend("POST", f"{self._path}/get", poll, json=body)
            if values := _answer(answer)["values"]:
                return list(values)
        return []

    def get(self, *, block: bool = True, timeout: float | None = None) -> Any:
        """The oldest value, waiting for one as `get_many` does; queue.Empty if none came."""
        return self._first(self.get_many(1, block=block, timeout=timeout))

    async def aget(self, *, block: bool = True, timeout: float | None = None) -> Any:
        return self._first(await self.aget_many(1, block=block, timeout=timeout))

    def _first(self, values: list[Any]) -> Any:
        if not values:
            raise queue.Empty(f"{self!r} had no value")
        return values[0]

    def __len__(self) -> int:
        return int(_answer(self._send("GET", self._path))["length"])

    def clear(self) -> int:
        return int(_answer(self._send("DELETE", self._path))["removed"])


def _put_body(values: list[Any]) -> dict[str, Any] | None:
    values = list(values)
    if not values:
        return None
    if len(values) > MAX_BATCH:
        raise InvalidError(f"put_many takes up to {MAX_BATCH} values at once, not {len(values)}")
    return _json_body({"values": values})


def _check_most(most: int) -> None:
    if isinstance(most, bool) or not isinstance(most, int) or not 1 <= most <= MAX_BATCH:
        raise InvalidError(f"get_many takes 1 to {MAX_BATCH} values at once, not {most!r}")
