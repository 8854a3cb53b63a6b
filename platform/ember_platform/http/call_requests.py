"""What a call's request says besides its arguments: its headers (Prefer, priority, time
limit, parent call, webhook) checked, and the call an `Idempotency-Key` stands for."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from ember.calling.affinity import AFFINITY_HEADER, check_affinity_key
from ember.calling.call_timeouts import CALL_TIMEOUT_HEADER, parse_call_timeout
from ember.calling.idempotency import MAX_IDEMPOTENCY_KEY
from ember.calling.priority import NORMAL, PRIORITY_HEADER, priority_rank
from ember.calling.tracing import TRACEPARENT_HEADER
from ember.calling.webhooks import WEBHOOK_HEADER
from ember.cancellation import PARENT_CALL_HEADER
from ember_platform.calls.webhooks import check_webhook_url
from ember_platform.edge.errors import HttpError, checked_header
from ember_platform.http.call_plane import CallPlane
from ember_platform.security.tokens import bearer_hash

MAX_CALL_ID = 64
TRACEPARENT_KEY = TRACEPARENT_HEADER.encode()
PARENT_CALL_HEADER_KEY = PARENT_CALL_HEADER.lower().encode()
WEBHOOK_HEADER_KEY = WEBHOOK_HEADER.lower().encode()


def request_headers(scope: dict[str, Any]) -> dict[bytes, bytes]:
    """The request's headers by (lower-case) name. Two Authorization headers are a 400:
    which one counts would differ between the gateway, the API and the proxies between."""
    pairs = scope["headers"]
    if sum(1 for name, _ in pairs if name == b"authorization") > 1:
        raise HttpError(400, "invalid_request", "send one Authorization header, not several")
    return dict(pairs)


def prefers_async(prefer: bytes) -> bool:
    """Whether a Prefer header (RFC 7240: `a, b=1; p`) holds the preference
    `respond-async` itself, not a longer token that contains it."""
    prefer = prefer.lower()
    return b"respond-async" in prefer and any(
        part.split(b";", 1)[0].split(b"=", 1)[0].strip() == b"respond-async"
        for part in prefer.split(b",")
    )


def parent_call_id(headers: dict[bytes, bytes]) -> str | None:
    """The input whose code made this call (the SDK says so), if it looks like a call id."""
    value = headers.get(PARENT_CALL_HEADER_KEY)
    if value is None or len(value) > MAX_CALL_ID or not value.startswith(b"c-"):
        return None
    return value.decode("latin-1")


def affinity_key(headers: dict[bytes, bytes]) -> str | None:
    """A request's affinity key (X-Ember-Affinity), checked; None when not given."""
    return checked_header(headers, AFFINITY_HEADER, check_affinity_key)


def call_priority(headers: dict[bytes, bytes]) -> int:
    """The call's place in the queue (X-Ember-Priority), normal when not given."""
    rank = checked_header(headers, PRIORITY_HEADER, priority_rank)
    return NORMAL if rank is None else rank


def call_timeout(headers: dict[bytes, bytes]) -> float | None:
    """The call's own time limit (X-Ember-Timeout), if it has one."""
    return checked_header(headers, CALL_TIMEOUT_HEADER, parse_call_timeout)


def webhook_url(headers: dict[bytes, bytes], is_async: bool, allow_http: bool) -> str | None:
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
    return check_webhook_url(value.decode("latin-1"), allow_http)


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


def started_already(cluster: CallPlane, call_id: str, arguments: bytes) -> bool:
    """Whether an earlier request with the same idempotency key started this call
    (live, or recorded for a day after it ended). Other arguments under the same key
    are refused (422)."""
    live = cluster.inputs.get(call_id)
    body = live.body if live is not None else None
    if body is None:
        record = cluster.calls.get(call_id)
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
