"""`ember.Dict` and `ember.Queue`: state shared by an app's replicas and its clients,
kept by the control plane (it outlives replicas, redeploys and restarts).

    results = ember.Dict("results")       # in a replica: the replica's app
    results["doc-17"] = {"summary": "…"}  # values are JSON
    jobs = ember.Queue("jobs", app="etl")  # outside a replica, name the app
    jobs.put({"url": "…"})
    job = jobs.get(timeout=30)             # waits for one; queue.Empty if none came

Keys are strings up to 512 bytes; a value is JSON up to 1 MiB (keep large data in
`weights=` or files, and its name here). `put(key, value, ttl=60)` lets a key expire.
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx

from ember.client import error_from_response, request_timeout, shared_client
from ember.config import ClientConfig, load_config
from ember.errors import InvalidError
from ember.labels import current_app
from ember.settings import check_name

REQUEST_TIMEOUT_S = 30.0
LONGEST_POLL_S = 60.0  # what the platform waits at most per request; longer waits ask again
_MISSING = object()


def _json_body(body: dict[str, Any]) -> dict[str, Any]:
    """Request arguments that send `body` as JSON, or InvalidError naming what JSON
    cannot carry (a set, an object, NaN), before anything is sent."""
    try:
        content = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise InvalidError(f"ember.Dict and ember.Queue values are JSON: {exc}") from None
    return {"content": content, "headers": {"Content-Type": "application/json"}}


def _answer(response: httpx.Response) -> Any:
    if response.status_code != 200:
        raise error_from_response(response.status_code, response.content)
    return response.json()


class _Shared:
    kind = ""

    def __init__(self, name: str, *, app: str | None = None, config: ClientConfig | None = None):
        self.name = check_name(self.kind, name)
        app = app or current_app()
        if app is None:
            raise InvalidError(
                f"ember.{type(self).__name__}({name!r}) outside a replica needs app= "
                "(the app it belongs to)"
            )
        self.app = check_name("app", app)
        self._config = config
        self._path = f"/v1/apps/{self.app}/{self.kind}s/{self.name}"

    @property
    def _client(self) -> httpx.Client:
        if self._config is None:
            self._config = load_config()  # read when first used, not at import
        return shared_client(self._config)

    def __repr__(self) -> str:
        return f"<ember.{type(self).__name__} {self.app}/{self.name}>"


class Dict(_Shared):
    """A key-value store of the app's, in the control plane."""

    kind = "dict"

    def _item(self, key: str) -> str:
        if not isinstance(key, str):
            raise InvalidError(f"ember.Dict keys are strings, not {type(key).__name__}")
        return f"{self._path}/items/{quote(key, safe='')}"

    def get(self, key: str, default: Any = None) -> Any:
        """The key's value, or `default` when it has none (or it expired)."""
        response = self._client.get(self._item(key), timeout=request_timeout(REQUEST_TIMEOUT_S))
        if response.status_code == 404:
            return default
        return _answer(response)["value"]

    def __getitem__(self, key: str) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def put(self, key: str, value: Any, *, ttl: float | None = None) -> None:
        """Set the key (to any JSON value); with `ttl`, it expires after that many seconds."""
        body: dict[str, Any] = {"value": value}
        if ttl is not None:
            body["ttl"] = ttl
        response = self._client.put(
            self._item(key), **_json_body(body), timeout=request_timeout(REQUEST_TIMEOUT_S)
        )
        _answer(response)

    def __setitem__(self, key: str, value: Any) -> None:
        self.put(key, value)

    def pop(self, key: str, default: Any = _MISSING) -> Any:
        """Remove the key and return its value (`default`, or KeyError, if it has none)."""
        response = self._client.delete(self._item(key), timeout=request_timeout(REQUEST_TIMEOUT_S))
        if response.status_code == 404:
            if default is _MISSING:
                raise KeyError(key)
            return default
        return _answer(response)["value"]

    def __delitem__(self, key: str) -> None:
        self.pop(key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key, _MISSING) is not _MISSING

    def _info(self, limit: int) -> dict[str, Any]:
        response = self._client.get(
            self._path, params={"limit": limit}, timeout=request_timeout(REQUEST_TIMEOUT_S)
        )
        return _answer(response)

    def __len__(self) -> int:
        return int(self._info(0)["count"])

    def keys(self, limit: int = 1000) -> list[str]:
        """The keys in order (the first `limit`, up to 10 000)."""
        return list(self._info(limit)["keys"])

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def clear(self) -> int:
        """Remove every key; how many there were."""
        response = self._client.delete(self._path, timeout=request_timeout(REQUEST_TIMEOUT_S))
        return int(_answer(response)["removed"])


class Queue(_Shared):
    """A first-in, first-out queue of the app's, in the control plane: a value is taken
    by one `get`, whoever calls it (a work queue across replicas)."""

    kind = "queue"

    def put(self, value: Any) -> None:
        self.put_many([value])

    def put_many(self, values: list[Any]) -> None:
        """Append the values in order (up to 1000 at once), all or none."""
        response = self._client.post(
            f"{self._path}/put",
            **_json_body({"values": list(values)}),
            timeout=request_timeout(REQUEST_TIMEOUT_S),
        )
        _answer(response)

    def get_many(self, most: int, *, block: bool = True, timeout: float | None = None) -> list:
        """Up to `most` values, as soon as there is one; waits up to `timeout` seconds
        (for ever when None, not at all when `block` is false): [] if none came."""
        wait_until = None if timeout is None else time.monotonic() + timeout
        while True:
            left = LONGEST_POLL_S if wait_until is None else max(0.0, wait_until - time.monotonic())
            poll = min(left, LONGEST_POLL_S) if block else 0.0
            response = self._client.post(
                f"{self._path}/get",
                json={"max": most, "timeout": poll},
                timeout=request_timeout(poll + REQUEST_TIMEOUT_S),
            )
            values = list(_answer(response)["values"])
            if values or not block or (wait_until is not None and time.monotonic() >= wait_until):
                return values

    def get(self, *, block: bool = True, timeout: float | None = None) -> Any:
        """The oldest value, waiting for one as `get_many` does; queue.Empty if none came."""
        values = self.get_many(1, block=block, timeout=timeout)
        if not values:
            raise queue.Empty(f"{self!r} had no value")
        return values[0]

    def __len__(self) -> int:
        response = self._client.get(self._path, timeout=request_timeout(REQUEST_TIMEOUT_S))
        return int(_answer(response)["length"])

    def clear(self) -> int:
        response = self._client.delete(self._path, timeout=request_timeout(REQUEST_TIMEOUT_S))
        return int(_answer(response)["removed"])
