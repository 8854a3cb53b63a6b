"""Webhook signatures (Standard Webhooks' scheme), the checks of webhook URLs, and what a
delivery's body says of a call."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

import pytest
from call_record_factory import ended_call

import ember
from ember.calling.webhooks import secret_key, signature
from ember_platform.calls.webhooks import MAX_INLINE_RESULT, check_webhook_url, payload
from ember_platform.edge.errors import http_error
from ember_platform.errors import InvalidRequest
from ember_platform.storage.records import CallStatus

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
BODY = b'{"call_id": "c-1"}'


def _headers(timestamp: int = 1_700_000_000, body: bytes = BODY, secret: str = SECRET) -> dict:
    return {
        "Webhook-Id": "c-1",
        "Webhook-Timestamp": str(timestamp),
        "Webhook-Signature": signature(secret_key(secret), "c-1", timestamp, body),
    }


def test_the_signature_is_standard_webhooks_hmac_of_id_timestamp_and_body() -> None:
    expected = hmac.new(b"k" * 32, b"c-1.1700000000." + BODY, hashlib.sha256).digest()
    assert (
        signature(b"k" * 32, "c-1", 1_700_000_000, BODY)
        == "v1," + base64.b64encode(expected).decode()
    )


def test_a_good_delivery_verifies_in_any_header_case() -> None:
    headers = {k.lower(): v for k, v in _headers().items()}
    assert ember.verify_webhook(BODY, headers, SECRET, now=1_700_000_010) == {"call_id": "c-1"}
    # One of several signatures (a secret being rotated) will do.
    rotated = {**headers, "webhook-signature": "v1,bm9wZQ== " + headers["webhook-signature"]}
    assert ember.verify_webhook(BODY, rotated, SECRET, now=1_700_000_010)["call_id"] == "c-1"


@pytest.mark.parametrize(
    ("body", "headers", "secret", "now", "message"),
    [
        (BODY + b" ", _headers(), SECRET, 1_700_000_000, "does not match"),
        (
            BODY,
            _headers(),
            "whsec_" + base64.b64encode(b"x" * 32).decode(),
            1_700_000_000,
            "does not match",
        ),
        (BODY, _headers(), SECRET, 1_700_000_301, "off this clock"),
        (BODY, _headers(), SECRET, 1_699_999_000, "off this clock"),
        (BODY, {"webhook-id": "c-1"}, SECRET, 1_700_000_000, "missing"),
        (BODY, {**_headers(), "Webhook-Timestamp": "soon"}, SECRET, 0, "not a number"),
        (BODY, _headers(), "whsec_***", 1_700_000_000, "not one `ember calls webhook-secret`"),
        (b"[1]", _headers(body=b"[1]"), SECRET, 1_700_000_000, "not a JSON object"),
    ],
)
def test_bad_deliveries_are_refused(
    body: bytes, headers: dict, secret: str, now: float, message: str
) -> None:
    with pytest.raises(ember.WebhookVerificationError, match=message):
        ember.verify_webhook(body, headers, secret, now=now)


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com/x",
        "ftp://example.com/",
        "https://",
        "https://a/#frag",
        "https://a/ b",
        "https://é.example/",
        "https://a/" + "x" * 2000,
        "https://[::1/",  # an IPv6 address left open
        "https://example.com:99999/",
        "https://example.com:port/",
    ],
)
def test_urls_that_cannot_take_a_webhook(url: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        check_webhook_url(url, allow_http=False)
    assert http_error(caught.value).status == 400


def test_http_urls_only_when_the_server_allows_them() -> None:
    assert check_webhook_url("http://127.0.0.1:8000/hook", allow_http=True)
    assert check_webhook_url("https://hooks.example.com/a?b=1", allow_http=False)


def test_the_body_carries_the_result_or_says_where_it_is() -> None:
    told = json.loads(payload(ended_call(), "https://p/v1/calls/c-1"))
    assert told["result"] == {"text": "hi"} and told["app"] == "app" and told["endpoint"] == "echo"
    big = b'"' + b"x" * MAX_INLINE_RESULT + b'"'
    assert "over 256 KiB" in json.loads(payload(ended_call(result=big), "u"))["result_omitted"]
    as_file = ended_call(result=b"\x89PNG", media_type="image/png", filename="a.png")
    assert json.loads(payload(as_file, "u"))["result_omitted"] == "a file (image/png, 4 bytes)"
    failed = ended_call(
        status=CallStatus.FAILED,
        http_status=500,
        result=b'{"error": {"type": "user_error", "message": "boom"}}',
    )
    told = json.loads(payload(failed, "u"))
    assert told["error"] == {"type": "user_error", "message": "boom"} and "result" not in told
