"""The gateway: turns an HTTPS request into an input, and the input's outcome into a response.

A raw ASGI handler rather than a framework route: it is the hot path of every call.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import secrets
import time
from functools import partial
from typing import Any

from ember.calling.call_timeouts import CALL_TIMEOUT_HEADER, parse_call_timeout
from ember.calling.idempotency import MAX_IDEMPOTENCY_KEY
from ember.calling.priority import NORMAL, PRIORITY_HEADER, priority_rank
from ember.calling.tracing import TRACE_ID_HEADER, TRACEPARENT_HEADER, continue_trace
from ember.calling.webhooks import WEBHOOK_HEADER
from ember.cancellation import PARENT_CALL_HEADER
from ember.wire.labels import Route, route_request
from ember.wire.spec import FUNCTION_METHOD, MethodSpec
from ember.wire.sse import encode_event
from ember_platform.calls.stats import RequestStats
from ember_platform.calls.webhooks import check_webhook_url
from ember_platform.config import ServerConfig
from ember_platform.core.affinity import affinity_key, key_from_argument
from ember_platform.core.canaries import route as canary_route
from ember_platform.core.cluster import Cluster
from ember_platform.core.cluster_model import EndpointRuntime
from ember_platform.core.inputs import CHUNK, END, JSON_MEDIA_TYPE, Input, Outcome
from ember_platform.http.asgi_types import Receive, Send
from ember_platform.http.call_arguments import parse_arguments
from ember_platform.http.caller_watch import CallerWatch
from ember_platform.http.cors import (
    allowed_origin,
    answer_preflight,
    is_preflight,
    with_cors_headers,
)
from ember_platform.http.errors import HttpError, checked_header, error_body
from ember_platform.http.openapi import OPENAPI_PATH, endpoint_document
from ember_platform.http.web_apps import (
    DISCONNECTED,
    WebAppRelay,
    WebSocketRelay,
    end_the_stream,
    reject,
)
from ember_platform.security.rate_limits import RateLimiter, retry_after_header
from ember_platform.security.tokens import Scope, TokenRegistry, bearer_hash

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The caller disconnected before the request was complete."""


class StreamCutShort(Exception):
    """A streamed file failed midway: its response ends without its last chunk."""


def _prefers_async(prefer: bytes) -> bool:
    """Whether a Prefer header (RFC 7240: `a, b=1; p`) holds the preference
    `respond-async` itself, not a longer token that contains it."""
    prefer = prefer.lower()
    return b"respond-async" in prefer and any(
        part.split(b";", 1)[0].split(b"=", 1)[0].strip() == b"respond-async"
        for part in prefer.split(b",")
    )


def _error_event(inp: Input, body: bytes) -> bytes:
    """The event a stream that failed midway ends with: its error, with the status the
    call would have had had it failed before its first event (504, 400, 502, ...)."""
    status = inp.outcome.result().status if inp.outcome.done() else 500
    try:
        payload = json.loads(body)
        payload["error"]["status"] = status
        text = json.dumps(payload)
    except (ValueError, KeyError, TypeError):
        text = body.decode(errors="replace")
    return encode_event(text, "error")


def _stream_start(inp: Input, *, as_file: bool) -> dict[str, Any]:
    if as_file and inp.file is not None:
        media_type, filename = inp.file
        fields = Outcome(200, b"", media_type, filename).headers()
    else:
        fields = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    fields["X-Ember-Call-Id"] = inp.id
    if inp.trace is not None:
        fields[TRACE_ID_HEADER] = inp.trace.trace_id
    headers = [(key.lower().encode(), value.encode("latin-1")) for key, value in fields.items()]
    return {"type": "http.response.start", "status": 200, "headers": headers}


JSON_CONTENT_TYPE = (b"content-type", b"application/json")


async def send_json(
    send: Send, status: int, body: bytes, extra: dict[str, str] | None = None
) -> None:
    await send_body(send, status, body, extra, JSON_CONTENT_TYPE)


async def send_body(
    send: Send,
    status: int,
    body: bytes,
    fields: dict[str, str] | None,
    first: tuple[bytes, bytes] | None = None,
) -> None:
    """A whole response: `first` (an encoded header, the hot path's), then `fields`."""
    headers = [(b"content-length", str(len(body)).encode())]
    if first is not None:
        headers.append(first)
    for key, value in (fields or {}).items():
        headers.append((key.lower().encode(), value.encode("latin-1")))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


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


MAX_CALL_ID = 64
TRACEPARENT_KEY = TRACEPARENT_HEADER.encode()
PARENT_CALL_HEADER_KEY = PARENT_CALL_HEADER.lower().encode()


def request_headers(scope: dict[str, Any]) -> dict[bytes, bytes]:
    """The request's headers by (lower-case) name. Two Authorization headers are a 400:
    which one counts would differ between the gateway, the API and the proxies between."""
    pairs = scope["headers"]
    if sum(1 for name, _ in pairs if name == b"authorization") > 1:
        raise HttpError(400, "invalid_request", "send one Authorization header, not several")
    return dict(pairs)


def parent_call_id(headers: dict[bytes, bytes]) -> str | None:
    """The input whose code made this call (the SDK says so), if it looks like a call id."""
    value = headers.get(PARENT_CALL_HEADER_KEY)
    if value is None or len(value) > MAX_CALL_ID or not value.startswith(b"c-"):
        return None
    return value.decode("latin-1")


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


WEBHOOK_HEADER_KEY = WEBHOOK_HEADER.lower().encode()


def _priority(headers: dict[bytes, bytes]) -> int:
    """The call's place in the queue (X-Ember-Priority), normal when not given."""
    rank = checked_header(headers, PRIORITY_HEADER, priority_rank)
    return NORMAL if rank is None else rank


def _call_timeout(headers: dict[bytes, bytes]) -> float | None:
    """The call's own time limit (X-Ember-Timeout), if it has one."""
    return checked_header(headers, CALL_TIMEOUT_HEADER, parse_call_timeout)


CLIENT_GONE = 499  # the status of a request whose caller left before its answer
CALLS_PATH = "/v1/calls"  # a spawned call's status URL is under it, in the API


async def _send_accepted(send: Send, call_id: str, headers: dict[str, str] | None = None) -> None:
    """202 for an async call: its id and where to ask for its result. The URL is relative
    to the URL called: the calls API answers it on the platform's host and on the
    endpoint's own (`Gateway.owns_v1_path`), so a browser page reads and cancels its call
    at the origin it called."""
    location = f"{CALLS_PATH}/{call_id}"
    body = json.dumps({"call_id": call_id, "status_url": location}).encode()
    await send_json(send, 202, body, {"Location": location, **(headers or {})})


def idempotent_call_id(authorization: str | None, label: str, method: str, key: bytes) -> str:
    """The call id an `Idempotency-Key` stands for: one per caller's token, endpoint and
    method, so that a client retrying a spawn gets the call it started, and another
    caller using the same key gets a call of its own."""
    text = key.decode("ascii", errors="replace")
    if not text or len(text) > MAX_IDEMPOTENCY_KEY or not text.isprintable() or "\ufffd" in text:
        raise HttpError(
            400,
            "invalid_request",
            f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters",
        )
    caller = (bearer_hash(authorization) or "").encode()  # the token, however it is spelled
    material = b"\0".join([caller, label.encode(), method.encode(), key])
    digest = hashlib.sha256(material).digest()
    return "c-" + base64.urlsafe_b64encode(digest)[:16].decode()


class Gateway:
    def __init__(self, cluster: Cluster, tokens: TokenRegistry, config: ServerConfig) -> None:
        self.cluster = cluster
        self.tokens = tokens
        self.config = config
        self.web_apps = WebAppRelay(cluster)
        self.websockets = WebSocketRelay(cluster)
        self.rate_limits = RateLimiter()
        tokens.on_revoke(self.rate_limits.forget)

    async def _read_body(
        self, receive: Receive, headers: dict[bytes, bytes], runtime: EndpointRuntime
    ) -> bytes:
        declared = headers.get(b"content-length")
        own = runtime.settings.max_body_mb  # an endpoint for uploads may take more
        return await read_body(
            receive,
            self.config.max_body_bytes if own is None else int(own * 1024 * 1024),
            int(declared) if declared and declared.isdigit() else None,
        )

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
            except HttpError as exc:  # before the handshake: an HTTP answer refuses it
                await reject(send, exc.status, exc.body())
            return
        try:
            await self._handle(scope, receive, send)
        except HttpError as exc:
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
            self.cluster.metrics.request_turned_away(runtime.app, runtime.spec.name, status)

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
        if runtime.settings.public:
            return
        authorization = headers.get(b"authorization")
        if authorization is None:
            raise HttpError(
                401,
                "unauthorized",
                "missing token: send 'Authorization: Bearer <token>' (create one with "
                "`ember token create`)",
                {"WWW-Authenticate": "Bearer"},
            )
        grant = self.tokens.grant_of(authorization.decode("latin-1"))
        if grant is None:
            why = self.tokens.refusal(authorization.decode("latin-1"), "the token is not valid")
            raise HttpError(401, "unauthorized", why, {"WWW-Authenticate": "Bearer"})
        if not grant.scope.allows(Scope.INVOKE):
            raise HttpError(403, "forbidden", f"a {grant.scope.value} token cannot call endpoints")
        if not grant.may_call(runtime.app):
            raise HttpError(
                403, "forbidden", f"this token calls the endpoints of app {grant.app} only"
            )
        if grant.rate_limit is not None:
            key = bearer_hash(authorization.decode("latin-1")) or ""
            wait = self.rate_limits.wait_needed(key, grant.rate_limit, time.monotonic())
            if wait:
                self.cluster.metrics.request_turned_away(runtime.app, runtime.spec.name, 429)
                raise HttpError(
                    429,
                    "rate_limited",
                    f"this token may make {grant.rate_limit} calls; retry in {wait:.2f} s "
                    "(`ember token create --rate-limit` sets a token's limit)",
                    {"Retry-After": retry_after_header(wait)},
                )

    async def _handle(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        route = self.route(scope)
        if route is None:
            raise HttpError(
                404,
                "not_found",
                f"nothing at {scope['path']}; endpoint URLs look like /APP--ENDPOINT/",
            )
        runtime = self.cluster.endpoints.get(route.label)
        if runtime is None:
            raise HttpError(
                404, "not_found", f"no endpoint named {route.label} (`ember ls` lists them)"
            )
        headers = request_headers(scope)
        if runtime.spec.kind == "asgi":  # a web app: every method and path is its own
            # A browser sends a CORS preflight without credentials: it reaches the app's
            # own CORS middleware, as the app's other requests do with their token.
            if not is_preflight(scope["method"], headers):
                self._authorize(headers, runtime)
            body = await self._read_body(receive, headers, runtime)
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
            except HttpError as exc:  # the page may read why, too
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
        """A call of a function or class endpoint's method."""
        http_method = scope["method"]
        if http_method not in ("POST", "GET"):
            raise HttpError(405, "method_not_allowed", "call endpoints with POST (or GET)")
        self._authorize(headers, runtime)
        if route.method == OPENAPI_PATH and runtime.spec.method_at(OPENAPI_PATH) is None:
            await self._send_openapi(scope, send, route, runtime)
            return
        body = await self._read_body(receive, headers, runtime)
        header_key = affinity_key(headers)
        serving = runtime
        runtime = self._version_for(serving, headers, header_key, route)
        spec, arguments = self._arguments(runtime, route, http_method, headers, body, scope)
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
                spec, arguments = self._arguments(runtime, route, http_method, headers, body, scope)
                streaming, argument_key = streams_and_key(spec, arguments)
        method = spec.name
        reason = self.cluster.unservable_reason(runtime)
        if reason is not None:
            raise HttpError(503, "no_capacity", f"{route.label}: {reason}")
        is_async = _prefers_async(headers.get(b"prefer", b""))
        webhook = self._webhook(headers, is_async)
        priority = _priority(headers)
        timeout = _call_timeout(headers)
        affinity = header_key or argument_key  # the header wins
        trace = continue_trace(headers.get(TRACEPARENT_KEY, b"").decode("latin-1"))
        call_id = "c-" + secrets.token_urlsafe(12)
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
            if self._started_already(call_id, arguments):
                await _send_accepted(send, call_id, {"Idempotent-Replayed": "true"})
                return
        inp = Input(
            id=call_id,
            label=route.label,
            method=method,
            body=arguments,
            streaming=streaming,
            is_async=is_async,
            parent_id=parent_call_id(headers),
            webhook=webhook,
            priority=priority,
            affinity=affinity,
            canary=runtime.is_canary,
            trace=trace,
            timeout=timeout,
        )
        self.cluster.submit(inp)
        if is_async:
            await _send_accepted(send, inp.id, {TRACE_ID_HEADER: trace.trace_id})
            return
        stats = RequestStats(inp.id, runtime.app, runtime.spec.name, method, streaming)
        stats.parent_id = inp.parent_id
        stats.affinity = affinity
        stats.version = runtime.version
        stats.trace = trace
        stats.note_arguments(arguments)
        status = CLIENT_GONE
        try:
            if streaming:
                status = await self._stream(inp, receive, send, stats)
            else:
                outcome = await self._outcome_unless_gone(inp, receive)
                if outcome is not None:
                    await self._answer(send, inp, outcome)
                    status = outcome.status
                    if status == 200 and outcome.media_type == JSON_MEDIA_TYPE:
                        stats.note_result(outcome.body)
        finally:
            self.cluster.request_finished(stats, inp, status)

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
        chosen = canary_route(self.cluster, serving, key)
        if chosen is serving:
            return serving
        try:
            if route is not None:
                resolve_method(chosen, route)
            self._authorize(headers, chosen)
        except HttpError:  # the canary lacks the method, or is stricter: the serving one
            return serving
        return chosen

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

    def _webhook(self, headers: dict[bytes, bytes], is_async: bool) -> str | None:
        """The URL to tell of a spawned call's end, checked; None when none is asked."""
        value = headers.get(WEBHOOK_HEADER_KEY)
        if value is None:
            return None
        if not is_async:
            raise HttpError(
                400,
                "invalid_request",
                f"{WEBHOOK_HEADER} is for spawned calls: add 'Prefer: respond-async' (a "
                "synchronous call's caller gets the result in the answer)",
            )
        return check_webhook_url(value.decode("latin-1"), self.config.webhook_allow_http)

    @staticmethod
    async def _send_openapi(
        scope: dict[str, Any], send: Send, route: Route, runtime: EndpointRuntime
    ) -> None:
        """The endpoint's OpenAPI document, its server the URL this request came by."""
        if scope["method"] != "GET":
            raise HttpError(405, "method_not_allowed", f"GET {OPENAPI_PATH}")
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        server = f"{scope.get('scheme', 'https')}://{host}{route.root_path}"
        document = endpoint_document(runtime.app, runtime.spec, runtime.version, server)
        await send_json(send, 200, json.dumps(document).encode())

    @staticmethod
    async def _answer(send: Send, inp: Input, outcome: Outcome) -> None:
        ids = {"X-Ember-Call-Id": inp.id}
        if inp.trace is not None:
            ids[TRACE_ID_HEADER] = inp.trace.trace_id
        if outcome.media_type == JSON_MEDIA_TYPE and outcome.filename is None:  # the hot path
            await send_json(send, outcome.status, outcome.body, ids)
        else:  # a file
            await send_body(send, outcome.status, outcome.body, {**outcome.headers(), **ids})

    def _started_already(self, call_id: str, arguments: bytes) -> bool:
        """Whether an earlier request with the same idempotency key started this call
        (live, or recorded for a day after it ended). Other arguments under the same key
        are refused (422)."""
        live = self.cluster.inputs.get(call_id)
        body = live.body if live is not None else None
        if body is None:
            record = self.cluster.calls.get(call_id)
            body = record.body if record is not None else None
        if body is None:
            return False
        # The same arguments, however the client spaced its JSON.
        if body != arguments and json.loads(body) != json.loads(arguments):
            raise HttpError(
                422,
                "idempotency_conflict",
                f"this Idempotency-Key started call {call_id} with other arguments; "
                "use a new key for a new call",
            )
        return True

    async def _outcome_unless_gone(self, inp: Input, receive: Receive) -> Outcome | None:
        """Wait for the outcome; if the caller hangs up first, cancel the input (no work
        is left running for nobody) and return None."""
        with CallerWatch(receive, lambda: self.cluster.cancel(inp, DISCONNECTED)) as watch:
            outcome = await inp.outcome  # the cancel above ends it too
        return None if watch.gone else outcome

    async def _stream(self, inp: Input, receive: Receive, send: Send, stats: RequestStats) -> int:
        """Relay the events as they come; returns the status the caller got. JSON events
        go as server-sent events; a stream of bytes (a file) goes as the body itself."""
        # Watch for the caller leaving so the generator in the replica is closed.
        watch = CallerWatch(receive, partial(end_the_stream, self.cluster, inp))
        started = failed = False
        try:
            while True:
                kind, data = await self.cluster.next_event(inp)
                if not started:
                    if kind == "error":
                        # Nothing streamed yet: an honest status code is still possible.
                        outcome = await inp.outcome
                        await send_json(send, outcome.status, outcome.body)
                        return outcome.status
                    started = True
                    await send(_stream_start(inp, as_file=kind == CHUNK))
                if kind == END:
                    break
                if inp.file is not None:
                    if kind != CHUNK:
                        # A file's body has no place for an error: the caller sees the
                        # response cut short, and the log says why.
                        raise StreamCutShort
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                    stats.note_event(b"")
                    continue
                if kind == "error":
                    await send(
                        {
                            "type": "http.response.body",
                            "body": _error_event(inp, data or b""),
                            "more_body": True,
                        }
                    )
                    failed = True
                    break
                await send(
                    {
                        "type": "http.response.body",
                        "body": encode_event((data or b"").decode()),
                        "more_body": True,
                    }
                )
                stats.note_event(data or b"")
            await send({"type": "http.response.body", "body": b""})
        except StreamCutShort:
            return inp.outcome.result().status if inp.outcome.done() else 500
        finally:
            watch.close()
        if watch.gone:
            return CLIENT_GONE  # the caller left mid-stream
        if failed:  # the stream ended with an error event: count the error's status
            return inp.outcome.result().status if inp.outcome.done() else 500
        return 200
