"""The gateway: turns an HTTPS request into an input, and the input's outcome into a response.

A raw ASGI handler rather than a framework route: it is the hot path of every call.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ember.calling.tracing import TRACE_ID_BYTES, TRACE_ID_HEADER, continue_trace
from ember.wire.labels import Route, label_in, nearest_label, route_request, split_app_key
from ember.wire.spec import FUNCTION_METHOD, MethodSpec
from ember_platform.config import ServerConfig
from ember_platform.core.canaries import route as canary_route
from ember_platform.edge.asgi_types import Receive, Send
from ember_platform.edge.cors import (
    allowed_origin,
    answer_preflight,
    is_preflight,
    with_cors_headers,
)
from ember_platform.edge.errors import HttpError, error_body, http_error
from ember_platform.errors import PlatformError, RateLimited
from ember_platform.http.batch_api import BatchApi, is_batch_request
from ember_platform.http.call_arguments import parse_arguments
from ember_platform.http.call_plane import CallPlane
from ember_platform.http.call_requests import (
    TRACEPARENT_KEY,
    affinity_key,
    call_priority,
    call_timeout,
    idempotent_call_id,
    parent_call_id,
    prefers_async,
    request_headers,
    started_already,
    webhook_url,
)
from ember_platform.http.call_responses import (
    CALLS_PATH,
    CLIENT_GONE,
    outcome_unless_gone,
    relay_stream,
    send_accepted,
    send_json,
    send_outcome,
)
from ember_platform.http.openapi import OPENAPI_PATH, send_openapi
from ember_platform.http.web_apps import WebAppRelay, WebSocketRelay, reject
from ember_platform.limits.held_bytes import MIB, HeldBytes
from ember_platform.observability.metrics import call_kind
from ember_platform.observability.request_stats import RequestStats
from ember_platform.runtime.affinity import key_from_argument
from ember_platform.runtime.cluster_model import EndpointRuntime
from ember_platform.runtime.inputs import JSON_MEDIA_TYPE, Input
from ember_platform.scaling.prefix_routing import block_hashes, prompt_text
from ember_platform.security.call_grants import CallGrants
from ember_platform.security.random_ids import random_bytes, random_token
from ember_platform.security.tokens import Grant, TokenRegistry

log = logging.getLogger(__name__)
# How long a call waits for its workspace to hold fewer bodies before it gets 503.
BODY_ROOM_WAIT_SECONDS = 10.0


def _authorization(headers: dict[bytes, bytes]) -> str | None:
    value = headers.get(b"authorization")
    return None if value is None else value.decode("latin-1")


class ClientGone(Exception):
    """The caller disconnected before the request was complete."""


@dataclass(frozen=True)
class Chosen:
    """The version of an endpoint that takes a call, and the call as that version reads it."""

    runtime: EndpointRuntime
    spec: MethodSpec
    arguments: bytes  # its keyword arguments, as JSON
    streaming: bool
    affinity: str | None  # its affinity key: the header's, else the arguments' (if any)


async def read_body(receive: Receive, limit: int, declared: int | None) -> bytes:
    if declared is not None and declared > limit:
        raise HttpError(413, "payload_too_large", f"the body is over the limit of {limit} bytes")
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise HttpError(
                413, "payload_too_large", f"the body is over the limit of {limit} bytes"
            )
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def read_call_body(
    bodies: HeldBytes,
    receive: Receive,
    headers: dict[bytes, bytes],
    runtime: EndpointRuntime,
    limit: int,
) -> bytes:
    """A call's body, under `limit`, counted in its workspace's bodies held: it waits
    for room there (503 after BODY_ROOM_WAIT_SECONDS)."""
    declared = headers.get(b"content-length")
    size = int(declared) if declared and declared.isdigit() else None
    workspace = split_app_key(runtime.app)[0]
    # Checked before waiting: a call that finds room (nearly all) makes no coroutine.
    if bodies.full(workspace) and not await bodies.room(workspace, BODY_ROOM_WAIT_SECONDS):
        raise HttpError(
            503,
            "busy",
            f"workspace {workspace} holds {bodies.of(workspace) // MIB} MiB of calls' "
            "bodies in the control plane, its budget; retry in a moment",
            {"Retry-After": "1"},
        )
    need = limit if size is None else min(size, limit)
    bodies.hold(workspace, need)  # while it is read; its input holds it from `submit`
    try:
        return await read_body(receive, limit, size)
    finally:
        bodies.release(workspace, need)


def resolve_method(runtime: EndpointRuntime, route: Route) -> MethodSpec:
    """The method an URL names, by its name or its path. A 404 names the paths to call
    on the host the request came in on: under `/{label}/`, or at `/` on the endpoint's
    own host (`--domain`), where a first segment is a method."""
    methods = runtime.spec.methods
    if runtime.spec.kind == "function":
        if route.explicit_method:
            raise HttpError(
                404,
                "not_found",
                f"{route.label} is a function endpoint; call it at {route.root_path}/, "
                f"not {route.root_path}/{route.method}",
            )
        return methods[FUNCTION_METHOD]
    if not route.explicit_method:
        if len(methods) == 1:
            (only,) = methods.values()
            return only
        listed = ", ".join(f"{route.root_path}/{name}" for name in sorted(methods))
        raise HttpError(404, "not_found", f"{route.label} is a class endpoint; call {listed}")
    spec = runtime.spec.method_at(route.method)
    if spec is None:
        listed = ", ".join(sorted(methods))
        raise HttpError(
            404, "not_found", f"{route.label} has no method {route.method!r} (it has: {listed})"
        )
    return spec


def streams_and_key(spec: MethodSpec, arguments: bytes) -> tuple[bool, str | None]:
    """Whether this call is answered as a stream (a generator's always; a method with a
    stream flag's when the call sets it to true, OpenAI's `"stream": true`), and the
    affinity key its `affinity_field` argument gives. The body is parsed only for
    methods that have either."""
    if spec.stream_flag is None and spec.affinity_field is None:
        return spec.streaming, None
    parsed = json.loads(arguments)
    key = (
        None if spec.affinity_field is None else key_from_argument(parsed.get(spec.affinity_field))
    )
    return spec.streams(parsed), key


def prompt_prefix(chosen: Chosen) -> tuple[bytes, ...] | None:
    """The block hashes of the call's prompt, for an endpoint that routes by prefix and a
    call without an affinity key (a key wins); None for any other."""
    if chosen.runtime.settings.route_by != "prefix" or chosen.affinity is not None:
        return None
    try:
        text = prompt_text(json.loads(chosen.arguments))
    except ValueError:
        return None
    return block_hashes(text) or None if text is not None else None


def label_hint(
    tokens: TokenRegistry,
    endpoints: Mapping[str, EndpointRuntime],
    headers: dict[bytes, bytes],
    label: str,
) -> str:
    """For a workspace's token that called main's label form: its own endpoint's label,
    if it has one of that name (a URL's label is whole: main's have two parts)."""
    authorization = headers.get(b"authorization")
    grant = tokens.grant_of(authorization.decode("latin-1")) if authorization else None
    if grant is None:
        return ""
    if grant.workspace is not None:
        whole = label_in(grant.workspace, label)
        if whole != label and whole in endpoints:
            return f"; this token's workspace has {whole}: use that label"
    # The nearest label among those this token may call (it may list them anyway).
    callable_labels = (other for other, runtime in endpoints.items() if grant.may_call(runtime.app))
    near = nearest_label(label, callable_labels)
    return f"; did you mean {near}?" if near is not None else ""


class Gateway:
    def __init__(
        self,
        cluster: CallPlane,
        tokens: TokenRegistry,
        config: ServerConfig,
        batches: BatchApi | None = None,  # None: endpoints answer no Batch API
    ) -> None:
        self.cluster = cluster
        self.batches = batches
        self.tokens = tokens
        self.config = config
        self.web_apps = WebAppRelay(cluster)
        self.websockets = WebSocketRelay(cluster)
        self.grants = CallGrants(tokens)

    async def _body(
        self,
        receive: Receive,
        headers: dict[bytes, bytes],
        runtime: EndpointRuntime,
        limit: int | None = None,  # None: the endpoint's own, or the server's
    ) -> bytes:
        own = runtime.settings.max_body_mb  # an endpoint for uploads may take more
        if limit is None:
            limit = self.config.max_body_bytes if own is None else int(own * 1024 * 1024)
        return await read_call_body(self.cluster.state.bodies, receive, headers, runtime, limit)

    def route(self, scope: dict[str, Any]) -> Route | None:
        host = ""
        for key, value in scope["headers"]:
            if key == b"host":
                host = value.decode("latin-1")
                break
        return route_request(host, scope["path"], self.config.domain)

    def owns_v1_path(self, scope: dict[str, Any]) -> bool:
        """Whether a `/v1/...` HTTP request is the gateway's, not the API's: on an
        endpoint's own host (`--domain`) such a path is the endpoint's method or route,
        except `/v1/calls/{id}`, the status URL of the calls it spawned, which is the calls
        API's unless the endpoint serves that path itself (a web app, or a method whose
        `path=` it is)."""
        route = self.route(scope)
        if route is None:
            return False  # path-style: no label is "v1"
        call_id = scope["path"].removeprefix(CALLS_PATH + "/")
        if call_id == scope["path"] or not call_id or "/" in call_id:
            return True
        runtime = self.cluster.endpoints.get(route.label)
        if runtime is None:
            return False
        return runtime.spec.kind == "asgi" or runtime.spec.method_at(route.method) is not None

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            try:
                await self._websocket(scope, receive, send)
            except (HttpError, PlatformError) as error:  # before the handshake: an HTTP answer
                refusal = http_error(error)
                await reject(send, refusal.status, refusal.body())
            return
        try:
            await self._handle(scope, receive, send)
        except (HttpError, PlatformError) as error:
            exc = http_error(error)
            self._count_refusal(scope, exc.status)
            await send_json(send, exc.status, exc.body(), exc.headers)
        except ClientGone:
            return
        except Exception:
            # A bug of the platform's: the caller still gets JSON like every other error.
            log.exception("gateway: %s %s failed", scope.get("method"), scope.get("path"))
            said = "the platform failed on this request (its log says why)"
            body = error_body("internal_error", said)
            with contextlib.suppress(RuntimeError, OSError):  # unless the answer had begun
                await send_json(send, 500, body)

    def _count_refusal(self, scope: dict[str, Any], status: int) -> None:
        """A request the gateway refused before any input ran (401, 404 method, 413, ...)
        is counted with the endpoint's requests, when the endpoint exists: paths that
        name none would otherwise make a metric series per path a caller makes up."""
        if status == 429:
            return  # counted where the queue or the rate limit refused it
        route = self.route(scope)
        runtime = None if route is None else self.cluster.endpoints.get(route.label)
        if runtime is not None:
            # Whether a stream was asked for is the method's to say, and it was not reached.
            # The raw headers: the refusal may be of the headers request_headers checks.
            prefer = next((v for k, v in scope.get("headers", ()) if k == b"prefer"), b"")
            kind = call_kind(False, prefers_async(prefer))
            self.cluster.metrics.request_turned_away(runtime.app, runtime.spec.name, status, kind)

    async def _websocket(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return  # the caller left during the handshake
        route = self.route(scope)
        runtime = None if route is None else self.cluster.endpoints.get(route.label)
        if route is None or runtime is None:
            raise HttpError(404, "not_found", f"no endpoint at {scope['path']}")
        if runtime.spec.kind != "asgi":
            raise HttpError(
                404,
                "not_found",
                f"{route.label} is not a web app; WebSockets reach @ember.asgi_app() endpoints",
            )
        headers = request_headers(scope)
        self._authorize(headers, runtime)
        runtime = self._version_for(runtime, headers, affinity_key(headers))
        await self.websockets.handle(scope, receive, send, route, runtime)

    def _authorize(self, headers: dict[bytes, bytes], runtime: EndpointRuntime) -> None:
        """The caller may call `runtime`, and one call is taken from its token's rate
        limit (web apps and WebSockets, whose version the caller's key alone chooses)."""
        self._charge(headers, self._grant(headers, runtime), runtime)

    def _may_call(self, headers: dict[bytes, bytes], runtime: EndpointRuntime) -> bool:
        return runtime.settings.public or self.grants.may_call(_authorization(headers), runtime.app)

    def _grant(self, headers: dict[bytes, bytes], runtime: EndpointRuntime) -> Grant | None:
        """The caller's grant to call `runtime` (None: a public endpoint); a pure check."""
        if runtime.settings.public:
            return None
        return self.grants.grant(_authorization(headers), runtime.app)

    def _charge(
        self, headers: dict[bytes, bytes], grant: Grant | None, runtime: EndpointRuntime
    ) -> None:
        """One call taken from the token's rate limit, counted in /metrics if refused."""
        if grant is None:
            return
        try:
            self.grants.charge(_authorization(headers) or "", grant)
        except RateLimited:
            kind = call_kind(False, prefers_async(headers.get(b"prefer", b"")))
            self.cluster.metrics.request_turned_away(runtime.app, runtime.spec.name, 429, kind)
            raise

    async def _handle(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        route = self.route(scope)
        if route is None:
            raise HttpError(
                404,
                "not_found",
                f"nothing at {scope['path']}; endpoint URLs look like /APP--ENDPOINT/",
            )
        runtime = self.cluster.endpoints.get(route.label)
        headers = request_headers(scope)
        if runtime is None:
            raise HttpError(
                404,
                "not_found",
                f"no endpoint named {route.label} (`ember ls` lists them)"
                + label_hint(self.tokens, self.cluster.endpoints, headers, route.label),
            )
        if runtime.spec.kind == "asgi":  # a web app: every method and path is its own
            # A browser sends a CORS preflight without credentials: it reaches the app's
            # own CORS middleware, as the app's other requests do with their token.
            if not is_preflight(scope["method"], headers):
                self._authorize(headers, runtime)
            body = await self._body(receive, headers, runtime)
            runtime = self._version_for(runtime, headers, affinity_key(headers))
            await self.web_apps.handle(scope, receive, send, route, runtime, body)
            return
        origin = allowed_origin(runtime.settings.cors_origins, headers)
        if origin is None and is_preflight(scope["method"], headers):
            asking = headers.get(b"origin", b"").decode("latin-1") or "a page"
            raise HttpError(
                403,
                "origin_not_allowed",
                f"{asking} may not call {route.label} from a browser: its "
                "@ember.endpoint(cors_origins=[...]) does not list that origin",
            )
        if origin is None:
            await self._call(scope, receive, send, route, runtime, headers)
        elif is_preflight(scope["method"], headers):
            await answer_preflight(send, origin, headers)
        else:
            send = with_cors_headers(send, origin)
            try:
                await self._call(scope, receive, send, route, runtime, headers)
            except (HttpError, PlatformError) as error:  # the page may read why, too
                exc = http_error(error)
                await send_json(send, exc.status, exc.body(), exc.headers)

    async def _call(
        self,
        scope: dict[str, Any],
        receive: Receive,
        send: Send,
        route: Route,
        runtime: EndpointRuntime,
        headers: dict[bytes, bytes],
    ) -> None:
        """A call of a function or class endpoint's method: the version that takes it, the
        token charged once for it, its input, and its answer."""
        if self.batches is not None and is_batch_request(route, runtime):
            await self._batch_request(scope, receive, send, route, runtime, headers)
            return
        http_method = scope["method"]
        if http_method not in ("POST", "GET"):
            raise HttpError(405, "method_not_allowed", "call endpoints with POST (or GET)")
        grant = self._grant(headers, runtime)
        if route.method == OPENAPI_PATH and runtime.spec.method_at(OPENAPI_PATH) is None:
            self._charge(headers, grant, runtime)
            await send_openapi(scope, send, route, runtime)
            return
        body = await self._body(receive, headers, runtime)
        chosen = self._choose_version(runtime, route, headers, body, scope)
        self._charge(headers, grant, chosen.runtime)
        reason = self.cluster.roster.unservable_reason(chosen.runtime)
        if reason is not None:
            raise HttpError(503, "no_capacity", f"{route.label}: {reason}")
        inp = await self._make_input(send, route, headers, chosen)
        if inp is not None:
            await self._answer(receive, send, inp, chosen)

    async def _batch_request(
        self,
        scope: dict[str, Any],
        receive: Receive,
        send: Send,
        route: Route,
        runtime: EndpointRuntime,
        headers: dict[bytes, bytes],
    ) -> None:
        """A Batch API request, of a token that may call the endpoint even when it is
        public (its files are not), charged once."""
        assert self.batches is not None
        grant = self.grants.grant(_authorization(headers), runtime.app)
        self._charge(headers, grant, runtime)
        upload = scope["method"] == "POST" and route.method == "v1/files"
        limit = self.config.batch_file_bytes if upload else None
        body = await self._body(receive, headers, runtime, limit)
        content_type = headers.get(b"content-type", b"").decode("latin-1")
        await self.batches.handle(scope, send, route, body, content_type)

    def _choose_version(
        self,
        serving: EndpointRuntime,
        route: Route,
        headers: dict[bytes, bytes],
        body: bytes,
        scope: dict[str, Any],
    ) -> Chosen:
        """The version that takes the call (by the affinity key of its header, or of its
        arguments), the method there, and its arguments as JSON."""
        header_key = affinity_key(headers)
        runtime = self._version_for(serving, headers, header_key, route)
        spec, arguments = self._arguments(runtime, route, scope["method"], headers, body, scope)
        streaming, argument_key = streams_and_key(spec, arguments)
        if (
            header_key is None
            and argument_key is not None
            and serving.label in self.cluster.canaries
        ):
            # The key is in the body: the version is chosen by it, as for a header's.
            keyed = self._version_for(serving, headers, argument_key, route)
            if keyed is not runtime:
                runtime = keyed
                spec, arguments = self._arguments(
                    runtime, route, scope["method"], headers, body, scope
                )
                streaming, argument_key = streams_and_key(spec, arguments)
        # The header's key wins.
        return Chosen(runtime, spec, arguments, streaming, header_key or argument_key)

    async def _make_input(
        self, send: Send, route: Route, headers: dict[bytes, bytes], chosen: Chosen
    ) -> Input | None:
        """The call's input, submitted; None for a spawned call answered already (its 202,
        or a retried spawn's with its Idempotency-Key)."""
        is_async = prefers_async(headers.get(b"prefer", b""))
        webhook = webhook_url(headers, is_async, self.config.webhook_allow_http)
        priority = call_priority(headers)
        timeout = call_timeout(headers)
        trace = continue_trace(
            headers.get(TRACEPARENT_KEY, b"").decode("latin-1"), random_bytes(TRACE_ID_BYTES)
        )
        method = chosen.spec.name
        call_id = "c-" + random_token(12)
        if not is_async and b"idempotency-key" in headers:
            # Ignoring it would run a retried call twice, which is what the key is to stop.
            raise HttpError(
                400,
                "invalid_request",
                "Idempotency-Key is for spawned calls: add 'Prefer: respond-async' (a retried "
                "spawn then gets the same call); a synchronous call is not deduplicated",
            )
        if is_async and b"idempotency-key" in headers:
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            key = headers[b"idempotency-key"]
            call_id = idempotent_call_id(authorization, route.label, method, key)
            if started_already(self.cluster, call_id, chosen.arguments):
                await send_accepted(send, call_id, {"Idempotent-Replayed": "true"})
                return None
        inp = Input(
            id=call_id,
            label=route.label,
            method=method,
            body=chosen.arguments,
            streaming=chosen.streaming,
            is_async=is_async,
            parent_id=parent_call_id(headers),
            webhook=webhook,
            priority=priority,
            affinity=chosen.affinity,
            prefix=prompt_prefix(chosen),
            canary=chosen.runtime.is_canary,
            trace=trace,
            timeout=timeout,
        )
        self.cluster.input_lifecycle.submit(inp)
        if is_async:
            await send_accepted(send, inp.id, {TRACE_ID_HEADER: trace.trace_id})
            return None
        return inp

    async def _answer(self, receive: Receive, send: Send, inp: Input, chosen: Chosen) -> None:
        """A synchronous call's answer: its result, or its stream relayed."""
        runtime = chosen.runtime
        stats = RequestStats(inp.id, runtime.app, runtime.spec.name, inp.method, inp.streaming)
        stats.parent_id = inp.parent_id
        stats.affinity = inp.affinity
        stats.version = runtime.version
        stats.trace = inp.trace
        stats.note_arguments(inp.body)
        status = CLIENT_GONE
        try:
            if inp.streaming:
                status = await relay_stream(
                    self.cluster, inp, receive, send, stats, done=chosen.spec.stream_done
                )
            else:
                outcome = await outcome_unless_gone(self.cluster, inp, receive)
                if outcome is not None:
                    await send_outcome(send, inp, outcome)
                    status = outcome.status
                    if status == 200 and outcome.media_type == JSON_MEDIA_TYPE:
                        stats.note_result(outcome.body)
        finally:
            self.cluster.journal.request_finished(stats, inp, status)

    def _version_for(
        self,
        serving: EndpointRuntime,
        headers: dict[bytes, bytes],
        key: str | None,
        route: Route | None = None,
    ) -> EndpointRuntime:
        """The version that takes this call: the endpoint's canary for its share of calls,
        if the canary lets this caller in and has the method `route` names (a web app's
        requests name none); else the serving version."""
        chosen = canary_route(self.cluster.canaries, serving, key)
        if chosen is serving:
            return serving
        try:
            if route is not None:
                resolve_method(chosen, route)
        except HttpError:  # the canary lacks the method: the serving one
            return serving
        return chosen if self._may_call(headers, chosen) else serving  # it may be stricter

    @staticmethod
    def _arguments(
        runtime: EndpointRuntime,
        route: Route,
        http_method: str,
        headers: dict[bytes, bytes],
        body: bytes,
        scope: dict[str, Any],
    ) -> tuple[MethodSpec, bytes]:
        """The method the call is for, in this version, and its arguments as JSON."""
        spec = resolve_method(runtime, route)
        arguments = parse_arguments(
            spec,
            http_method,
            headers.get(b"content-type", b"").decode("latin-1"),
            body,
            scope.get("query_string", b""),
        )
        return spec, arguments
