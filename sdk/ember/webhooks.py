"""Webhooks for spawned calls: when a call made with `spawn(_webhook=URL)` (the
`X-Ember-Webhook` header) ends, the platform POSTs what became of it to URL, signed.

The signature follows the Standard Webhooks scheme, so that its libraries verify it too:
`webhook-id` (the call id, the same on every retry), `webhook-timestamp` (Unix seconds)
and `webhook-signature: v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`, keyed by
the platform's webhook secret (`ember calls webhook-secret`; it starts with `whsec_`,
the rest base64). A receiver checks it with `ember.verify_webhook`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from collections.abc import Mapping
from typing import Any

from ember.errors import WebhookVerificationError

SECRET_PREFIX = "whsec_"
WEBHOOK_HEADER = "X-Ember-Webhook"
# A delivery older (or newer) than this is refused: a replayed one, or a skewed clock.
TOLERANCE_SECONDS = 300.0


def secret_key(secret: str) -> bytes:
    """The HMAC key a webhook secret (`whsec_...`) stands for."""
    try:
        return base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
    except (binascii.Error, ValueError):
        raise WebhookVerificationError(
            "the webhook secret is not one `ember calls webhook-secret` printed"
        ) from None


def signature(key: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header's value for one delivery."""
    signed = f"{message_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def verify_webhook(
    body: bytes,
    headers: Mapping[str, str],
    secret: str,
    *,
    tolerance: float = TOLERANCE_SECONDS,
    now: float | None = None,
) -> dict[str, Any]:
    """The delivery's payload, once its signature and timestamp check out; raises
    WebhookVerificationError otherwise. `headers` as the receiving framework gives them
    (names in any case); `body` the raw bytes, before any JSON parsing."""
    lowered = {name.lower(): value for name, value in headers.items()}
    message_id = lowered.get("webhook-id")
    stamp = lowered.get("webhook-timestamp")
    signatures = lowered.get("webhook-signature")
    if not message_id or not stamp or not signatures:
        raise WebhookVerificationError(
            "missing webhook-id, webhook-timestamp or webhook-signature header"
        )
    try:
        timestamp = int(stamp)
    except ValueError:
        raise WebhookVerificationError(f"webhook-timestamp {stamp!r} is not a number") from None
    clock = time.time() if now is None else now
    if abs(clock - timestamp) > tolerance:
        raise WebhookVerificationError(
            f"the delivery is {clock - timestamp:+.0f} s off this clock (tolerance "
            f"{tolerance:g} s): replayed, or a clock is wrong"
        )
    expected = signature(secret_key(secret), message_id, timestamp, body)
    # Several signatures may be sent (a secret being rotated): any one will do.
    if not any(hmac.compare_digest(expected, given) for given in signatures.split()):
        raise WebhookVerificationError("the signature does not match this secret")
    try:
        payload = json.loads(body)
    except ValueError:
        raise WebhookVerificationError("the body is not JSON") from None
    if not isinstance(payload, dict):
        raise WebhookVerificationError("the body is not a JSON object")
    return payload
