"""The Python client: look an endpoint up, then call, stream or spawn it."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping
from functools import partial
from typing import Any

import httpx

from ember.calling.affinity import affinity_headers
from ember.calling.async_mapping import amap_calls, apost_until_queued
from ember.calling.call_bodies import answer_value, call_body
from ember.calling.call_timeouts import request_seconds, timeout_headers
from ember.calling.connections import (
    platform_client,
    request_timeout,
    shared_async_client,
    shared_client,
)
from ember.calling.idempotency import check_idempotency_key
from ember.calling.mapping import (
    ends_stream,
    map_calls,
    post_until_queued,
    stream_item,
    streamed_items,
)
from ember.calling.priority import priority_headers
from ember.calling.webhooks import WEBHOOK_HEADER, check_webhook_url
from ember.config import ClientConfig, load_config
from ember.errors import (
    AuthError,
    CallCancelledError,
    CallTimeoutError,
    ConnectionCutError,
    InvalidError,
    NotFoundError,
    RemoteError,
    ServerUnreachableError,
    UserCodeError,
)
from ember.wire.labels import label_as_deployed, label_names, make_label, split_label
from ember.wire.spec import FUNCTION_METHOD
from ember.wire.sse import Event, EventParser, parse_events

# A spawned call's wait asks again while the server cannot be reached (a restart), every
# few seconds, for up to two minutes of failures in a row.
OUTAGE_RETRY_S = 2.0
OUTAGE_PATIENCE_S = 120.0

PLATFORM_ERROR_TYPES = {
    "invalid_json",
    "invalid_arguments",
    "invalid_request",
    "unauthorized",
    "forbidden",
    "not_found",
    "payload_too_large",
    "queue_full",
    "no_capacity",
    "timeout",
    "replica_lost",
    "replica_start_failed",
    "cancelled",
    "internal_error",
    "result_too_large",
    "insufficient_storage",
    "http_error",  # no JSON error: a server's or a proxy's own page, never the code's
}


def error_from_response(status: int, body: bytes) -> RemoteError:
    try:
        detail = json.loads(body)["error"]
        error_type, message = str(detail["type"]), str(detail["message"])
    except (ValueError, KeyError, TypeError):
        error_type, message = "http_error", body.decode(errors="replace")[:500]
    if status in (401, 403):
        return AuthError(status, error_type, message)
    if status == 404:
        return NotFoundError(status, error_type, message)
    if status == 504:
        return CallTimeoutError(status, error_type, message)
    if status == 499 and error_type == "cancelled":
        return CallCancelledError(status, error_type, message)
    if status == 500 and error_type not in PLATFORM_ERROR_TYPES:
        return UserCodeError(status, error_type, message)
    return RemoteError(status, error_type, message)


def _json_answer(response: httpx.Response, expected: int = 200) -> Any:
    if response.status_code != expected:
        raise error_from_response(response.status_code, response.content)
    if _is_event_stream(response):  # a generator, called whole: the list it yielded
        return streamed_items(response.text, error_from_response)
    return answer_value(response)


def _is_json(response: httpx.Response) -> bool:
    media = response.headers.get("content-type", "application/json").split(";", 1)[0]
    return media.strip() == "application/json"


def _cut_short(label: str) -> RemoteError:
    names = label_names(label)
    app = names[1] if names is not None else label  # as `ember logs` names it, in its workspace
    return RemoteError(
        502,
        "stream_cut_short",
        f"the stream of {label} ended before it was whole: its code failed or its replica "
        f"was lost midway (`ember logs {app}` says which), or the connection broke",
    )


def _is_event_stream(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


def _spawn_headers(idempotency_key: str | None, webhook: str | None = None) -> dict[str, str]:
    headers = {"Prefer": "respond-async"}
    if idempotency_key is not None:  # checked first: a header could not carry some text
        headers["Idempotency-Key"] = check_idempotency_key(idempotency_key)
    if webhook is not None:
        headers[WEBHOOK_HEADER] = check_webhook_url(webhook)
    return headers


def routing_headers(
    priority: str | None, affinity: str | None, timeout: float | None = None
) -> dict[str, str]:
    """The headers that place a call: its priority, its affinity key and its own time
    limit (each checked)."""
    return {**priority_headers(priority), **affinity_headers(affinity), **timeout_headers(timeout)}


def _stream_item(event: Event) -> Any:
    return stream_item(event, error_from_response)


class _Poll:
    """Long polls for a spawned call's result, until it is there or `timeout` passes.
    The call outlives a restart of the server, so the wait does too: a server that cannot
    be reached is asked again, until the deadline or `OUTAGE_PATIENCE_S` of failures."""

    def __init__(self, call_id: str, timeout: float | None) -> None:
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 <= timeout < math.inf
        ):
            raise InvalidError(f"timeout is seconds, 0 or more (or None), not {timeout!r}")
        self.call_id = call_id
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.failing_since: float | None = None

    def retry_delay(self, error: ServerUnreachableError) -> float:
        """How long to wait before asking again, or `error` when it is time to give up."""
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
        delay = min(OUTAGE_RETRY_S, max(0.1, (now - self.failing_since) / 4))
        out_of_time = self.deadline is not None and now + delay >= self.deadline
        if out_of_time or now - self.failing_since >= OUTAGE_PATIENCE_S:
            raise error
        return delay

    def params(self) -> dict[str, str]:
        remaining = 30.0 if self.deadline is None else self.deadline - time.monotonic()
        return {"wait": f"{max(0.0, min(30.0, remaining)):.3f}"}

    def done(self, response: httpx.Response) -> bool:
        """True with the result in hand; raises the call's error, or CallTimeoutError."""
        if response.status_code == 200:
            return True
        if response.status_code != 202:
            raise error_from_response(response.status_code, response.content)
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise CallTimeoutError(
                408, "timeout", f"call {self.call_id} not finished after {self.timeout} s"
            )
        return False


class CallHandle:
    """An asynchronous call in flight; its result stays on the platform for a day."""

    def __init__(self, call_id: str, config: ClientConfig) -> None:
        self.call_id = call_id
        self._config = config

    @classmethod
    def from_id(cls, call_id: str, *, config: ClientConfig | None = None) -> CallHandle:
        """The handle of a call spawned elsewhere (another process, an earlier request),
        from its id (`handle.call_id`, `X-Ember-Call-Id`): `get` and `cancel` work as on
        the handle `spawn` returned. An id that names no call raises NotFoundError then."""
        if not isinstance(call_id, str) or not re.fullmatch(r"c-[A-Za-z0-9_-]{1,62}", call_id):
            raise InvalidError(f"{call_id!r} is not a call id (they look like c-Xy3…)")
        return cls(call_id, config or load_config())

    def __repr__(self) -> str:
        return f"<ember call {self.call_id}>"

    def get(self, timeout: float | None = None) -> Any:
        """Wait for the result; raise CallTimeoutError if it is not there within `timeout`."""
        poll = _Poll(self.call_id, timeout)
        client = shared_client(self._config)
        while True:
            try:
                response = client.get(
                    f"/v1/calls/{self.call_id}",
                    params=poll.params(),
                    timeout=request_timeout(None),
                )
            except ServerUnreachableError as error:
                time.sleep(poll.retry_delay(error))
                continue
            poll.failing_since = None
            if poll.done(response):
                return answer_value(response)

    async def aget(self, timeout: float | None = None) -> Any:
        """`get` for asyncio code."""
        poll = _Poll(self.call_id, timeout)
        client = await shared_async_client(self._config)
        while True:
            try:
                response = await client.get(
                    f"/v1/calls/{self.call_id}",
                    params=poll.params(),
                    timeout=request_timeout(None),
                )
            except ServerUnreachableError as error:
                await asyncio.sleep(poll.retry_delay(error))
                continue
            poll.failing_since = None
            if poll.done(response):
                return answer_value(response)

    def cancel(self) -> None:
        """Stop the call: dropped from its queue, or stopped on its replica (which its
        code sees through `ember.cancelled()`). Its result becomes a CallCancelledError;
        a call that has already finished raises RemoteError (409)."""
        client = shared_client(self._config)
        _json_answer(client.delete(f"/v1/calls/{self.call_id}", timeout=request_timeout(30.0)))

    async def acancel(self) -> None:
        """`cancel` for asyncio code."""
        client = await shared_async_client(self._config)
        path = f"/v1/calls/{self.call_id}"
        _json_answer(await client.delete(path, timeout=request_timeout(30.0)))


class Endpoint:
    """A deployed endpoint (or one method of a class endpoint)."""

    def __init__(self, label: str, config: ClientConfig, method: str = FUNCTION_METHOD) -> None:
        self.label = label
        self.method_name = method
        self._config = config

    @classmethod
    def lookup(
        cls, app: str, name: str, *, method: str | None = None, config: ClientConfig | None = None
    ) -> Endpoint:
        """Find endpoint `name` of app `app` (of the token's workspace); raise
        NotFoundError if it is not deployed."""
        config = config or load_config()
        label = make_label(app, name)
        if split_label(label) is None:
            # Names as Python spells them: `round_trip` is deployed as `round-trip`.
            label = label_as_deployed(label) or label
        response = shared_client(config).get(
            f"/v1/endpoints/{label}", timeout=request_timeout(30.0)
        )
        if response.status_code != 200:  # a 404 names the nearest label, if one is close
            raise error_from_response(response.status_code, response.content)
        # Its whole label, workspace and all: what its URL holds.
        endpoint = cls(str(response.json().get("label") or label), config)
        return endpoint.method(method) if method else endpoint

    def method(self, name: str) -> Endpoint:
        """One method of a class endpoint: `Endpoint.lookup("app", "chat").method("generate")`."""
        return Endpoint(self.label, self._config, name)

    def __getattr__(self, name: str) -> Endpoint:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.method(name)

    @property
    def url(self) -> str:
        path = f"/{self.label}/"
        if self.method_name != FUNCTION_METHOD:
            path += self.method_name
        return self._config.server_url.rstrip("/") + path

    def __repr__(self) -> str:
        return f"<ember endpoint {self.url}>"

    def call(
        self,
        *,
        _timeout: float | None = None,
        _priority: str | None = None,
        _affinity: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Call and wait for the result (JSON-decoded). `_priority` ("high", "normal" or
        "low") places it in the endpoint's queue ahead of, or behind, other calls.
        `_affinity` (a session, a user, a model's name) sends calls with the same key to
        the same replica while it has room, so that what it cached for them is reused.
        `_timeout` (seconds) bounds the call, waiting and running: past it the platform
        stops it and this raises CallTimeoutError. A generator method's result is the
        list of what it yielded (bytes for one that yields bytes: the whole file)."""
        client = shared_client(self._config)
        body = call_body(kwargs, routing_headers(_priority, _affinity, _timeout))
        limit = request_timeout(request_seconds(_timeout))
        return _json_answer(client.post(self.url, **body, timeout=limit))

    async def acall(
        self,
        *,
        _timeout: float | None = None,
        _priority: str | None = None,
        _affinity: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """`call` for asyncio code: `await endpoint.acall(text="hi")`."""
        body = call_body(kwargs, routing_headers(_priority, _affinity, _timeout))
        client = await shared_async_client(self._config)
        timeout = request_timeout(request_seconds(_timeout))
        return _json_answer(await client.post(self.url, **body, timeout=timeout))

    def stream(
        self,
        *,
        _timeout: float | None = None,
        _priority: str | None = None,
        _affinity: str | None = None,
        **kwargs: Any,
    ) -> Iterator[Any]:
        """Call a generator method and yield each item as it arrives (a stream of bytes,
        a file, as chunks of bytes as they arrive; a method that answers one value, as
        that one item). An error midway raises as the call would have before its first
        item (CallTimeoutError past `_timeout`, RemoteError 400 for an ember.InputError);
        a file stream cut short raises RemoteError `stream_cut_short`."""
        client = shared_client(self._config)
        body = call_body(kwargs, routing_headers(_priority, _affinity, _timeout))
        with client.stream("POST", self.url, **body, timeout=request_timeout(None)) as response:
            if response.status_code != 200:
                raise error_from_response(response.status_code, response.read())
            if _is_json(response):  # a method that answered one value: a stream of it
                response.read()
                yield answer_value(response)
                return
            if not _is_event_stream(response):
                try:
                    yield from response.iter_bytes()
                except httpx.RemoteProtocolError:
                    raise _cut_short(self.label) from None
                return
            try:
                for event in parse_events(response.iter_lines()):
                    if not ends_stream(event):
                        yield _stream_item(event)
            except ConnectionCutError:  # the server went midway (a failover, a restart)
                raise _cut_short(self.label) from None

    async def astream(
        self,
        *,
        _timeout: float | None = None,
        _priority: str | None = None,
        _affinity: str | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[Any]:
        """`stream` for asyncio code: `async for item in endpoint.astream(...)`."""
        body = call_body(kwargs, routing_headers(_priority, _affinity, _timeout))
        client = await shared_async_client(self._config)
        timeout = request_timeout(None)
        async with client.stream("POST", self.url, **body, timeout=timeout) as response:
            if response.status_code != 200:
                raise error_from_response(response.status_code, await response.aread())
            if _is_json(response):
                await response.aread()
                yield answer_value(response)
                return
            if not _is_event_stream(response):
                try:
                    async for chunk in response.aiter_bytes():
                        yield chunk
                except httpx.RemoteProtocolError:
                    raise _cut_short(self.label) from None
                return
            parser = EventParser()
            try:
                async for line in response.aiter_lines():
                    event = parser.feed(line)
                    if event is not None and not ends_stream(event):
                        yield _stream_item(event)
            except ConnectionCutError:  # the server went midway (a failover, a restart)
                raise _cut_short(self.label) from None
            last = parser.finish()
            if last is not None and not ends_stream(last):
                yield _stream_item(last)

    def map(
        self,
        inputs: Iterable[Mapping[str, Any]],
        *,
        concurrency: int = 32,
        order_outputs: bool = True,
        return_exceptions: bool = False,
        with_index: bool = False,
        timeout: float | None = None,
    ) -> Iterator[Any]:
        """Call once per input (a dict of keyword arguments) and yield the results, in
        input order unless `order_outputs=False` (then as they finish).

        Up to `concurrency` calls are in flight at once over shared connections; replicas
        scale on the queue they make. A full queue (429) is waited out, not failed. The
        first failed input raises its error (with a note naming the input), unless
        `return_exceptions=True` yields the RemoteError in its place. `with_index=True`
        yields (input index, result) pairs. `timeout` bounds each call (the platform
        stops one that runs past it, as `call(_timeout=)` does). A generator
        method's result is the list of what it yielded. Inputs are read from the iterable
        as slots free up, so a generator of any length works; leaving the loop early
        stops sending and waits for the calls in flight.
        """
        limit = request_seconds(timeout)
        with platform_client(self._config, limit, connections=max(1, concurrency)) as client:
            call = partial(
                post_until_queued,
                client,
                self.url,
                error_from_response=error_from_response,
                headers=timeout_headers(timeout),
            )
            for index, result in map_calls(
                call,
                inputs,
                concurrency=concurrency,
                order_outputs=order_outputs,
                return_exceptions=return_exceptions,
            ):
                yield (index, result) if with_index else result

    async def amap(
        self,
        inputs: Iterable[Mapping[str, Any]] | AsyncIterable[Mapping[str, Any]],
        *,
        concurrency: int = 32,
        order_outputs: bool = True,
        return_exceptions: bool = False,
        with_index: bool = False,
        timeout: float | None = None,
    ) -> AsyncIterator[Any]:
        """`map` for asyncio code: `async for result in endpoint.amap(inputs): ...`.

        The same options as `map`; the calls are tasks on the running event loop over its
        kept connections, and `inputs` may be an async iterable too. Leaving the loop
        early cancels the calls in flight (the platform stops their inputs)."""
        client = await shared_async_client(self._config)
        limit = request_timeout(request_seconds(timeout))
        headers = timeout_headers(timeout)

        async def call(arguments: Mapping[str, Any]) -> Any:
            return await apost_until_queued(
                client, self.url, arguments, error_from_response, headers, limit
            )

        results = amap_calls(
            call,
            inputs,
            concurrency=concurrency,
            order_outputs=order_outputs,
            return_exceptions=return_exceptions,
        )
        try:
            async for index, result in results:
                yield (index, result) if with_index else result
        finally:
            await results.aclose()

    def spawn(
        self,
        *,
        _idempotency_key: str | None = None,
        _webhook: str | None = None,
        _priority: str | None = None,
        _affinity: str | None = None,
        _timeout: float | None = None,
        **kwargs: Any,
    ) -> CallHandle:
        """Start the call and return at once; `handle.get()` collects the result later.

        With `_idempotency_key`, spawning again with the same key (and arguments) returns
        the call the first spawn started, for a day after it ends: a client that lost
        the answer to a spawn can retry it without starting the work twice. With
        `_webhook` (an https URL), the platform POSTs the call's end to it, signed
        (`ember.verify_webhook` checks it), retrying until the receiver answers 2xx.
        With `_timeout`, a call not done that many seconds after it was accepted is
        stopped and fails with 504 (while this control plane runs: a restart forgets
        the limit)."""
        headers = {
            **_spawn_headers(_idempotency_key, _webhook),
            **routing_headers(_priority, _affinity, _timeout),
        }
        body = call_body(kwargs, headers)
        response = shared_client(self._config).post(self.url, **body, timeout=request_timeout(30.0))
        return CallHandle(_json_answer(response, 202)["call_id"], self._config)

    async def aspawn(
        self,
        *,
        _idempotency_key: str | None = None,
        _webhook: str | None = None,
        _priority: str | None = None,
        _affinity: str | None = None,
        _timeout: float | None = None,
        **kwargs: Any,
    ) -> CallHandle:
        """`spawn` for asyncio code; `await handle.aget()` collects the result."""
        headers = {
            **_spawn_headers(_idempotency_key, _webhook),
            **routing_headers(_priority, _affinity, _timeout),
        }
        client = await shared_async_client(self._config)
        body = call_body(kwargs, headers)
        response = await client.post(self.url, **body, timeout=request_timeout(30.0))
        return CallHandle(_json_answer(response, 202)["call_id"], self._config)

    def update_autoscaler(
        self,
        *,
        min_replicas: int | None = None,
        max_replicas: int | None = None,
        buffer_replicas: int | None = None,
        scaledown_window: float | None = None,
    ) -> dict[str, float]:
        """Change the endpoint's autoscaling without a deploy, as `ember scale` does:
        replicas kept ready ahead of a launch or during office hours, a lower cap while
        a quota runs out. The change holds for the serving version, across restarts of
        the control plane, until `reset_autoscaler()` or the app's next deploy. Needs an
        admin token. Returns the settings now in force."""
        change = {
            name: value
            for name, value in (
                ("min_replicas", min_replicas),
                ("max_replicas", max_replicas),
                ("buffer_replicas", buffer_replicas),
                ("scaledown_window", scaledown_window),
            )
            if value is not None
        }
        if not change:
            raise InvalidError(
                "update_autoscaler needs at least one of min_replicas, max_replicas, "
                "buffer_replicas and scaledown_window"
            )
        response = shared_client(self._config).patch(
            f"/v1/endpoints/{self.label}/scaling", json=change, timeout=request_timeout(30.0)
        )
        return dict(_json_answer(response)["settings"])

    def reset_autoscaler(self) -> dict[str, float]:
        """Drop what `update_autoscaler` (or `ember scale`) changed: the deployed settings
        hold again. Returns them."""
        response = shared_client(self._config).delete(
            f"/v1/endpoints/{self.label}/scaling", timeout=request_timeout(30.0)
        )
        return dict(_json_answer(response)["settings"])
