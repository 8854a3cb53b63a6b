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
from urllib.parse import urlsplit

from ember.errors import InvalidError, WebhookVerificationError

SECRET_PREFIX = "whsec_"
WEBHOOK_HEADER = "X-Ember-Webhook"
# A delivery older (or newer) than this is refused: a replayed one, or a skewed clock.
TOLERANCE_SECONDS = 300.0
MAX_URL_CHARS = 2000


def check_webhook_url(url: str) -> str:
    """The URL itself, or InvalidError naming the rule it breaks: what any server takes
    (the server also decides whether http is allowed, and which addresses it refuses)."""

    def bad(why: str) -> InvalidError:
        return InvalidError(f"{WEBHOOK_HEADER}: {why}")

    if not isinstance(url, str):
        raise bad(f"a URL is a string, not {type(url).__name__}")
    if len(url) > MAX_URL_CHARS:
        raise bad(f"a URL of at most {MAX_URL_CHARS} characters (got {len(url)})")
    if not url.isascii():
        raise bad(f"{url!r} is not ASCII: percent-encode the path, IDNA-encode the host")
    if " " in url or not url.isprintable():
        raise bad(f"{url!r} has spaces or control characters: percent-encode them (%20)")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  # raises for a port out of range or not a number
    except ValueError as exc:  # "https://[::1/": an unclosed IPv6 address, and the like
        raise bad(f"{url!r} is not a URL ({exc})") from None
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise bad(f"{url!r} is not an https URL with a host")
    if parts.fragment:
        raise bad(f"{url!r} has a #fragment, which is never sent: leave it out")
    return url


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
