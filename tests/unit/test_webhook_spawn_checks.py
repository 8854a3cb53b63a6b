"""What the SDK checks before a spawn's headers are sent, and the server's checks of a
webhook URL: each broken rule is an error that names it, never a transport's traceback
(UnicodeEncodeError, httpx's 'Illegal header value')."""

from __future__ import annotations

import pytest

from ember.calling.idempotency import MAX_IDEMPOTENCY_KEY, check_idempotency_key
from ember.calling.webhooks import check_webhook_url
from ember.errors import InvalidError
from ember_platform.calls.webhooks import check_webhook_url as server_check_webhook_url
from ember_platform.edge.errors import http_error
from ember_platform.errors import InvalidRequest


@pytest.mark.parametrize("key", ["job-17", "a b", "x" * MAX_IDEMPOTENCY_KEY, "~!@#$%^&*()"])
def test_keys_that_travel_as_a_header_as_given(key: str) -> None:
    assert check_idempotency_key(key) == key


@pytest.mark.parametrize(
    ("key", "rule"),
    [
        ("", "1 to 255 characters"),
        ("x" * (MAX_IDEMPOTENCY_KEY + 1), "1 to 255 characters"),
        ("é", "printable ASCII"),
        ("a\nb", "printable ASCII"),
        (" ", "neither starts nor ends with a space"),
        (" job", "neither starts nor ends with a space"),
        ("job ", "neither starts nor ends with a space"),
    ],
)
def test_keys_that_cannot_be_sent_name_the_rule(key: str, rule: str) -> None:
    with pytest.raises(InvalidError, match=rule):
        check_idempotency_key(key)


def test_a_key_that_is_not_text_says_so() -> None:
    with pytest.raises(InvalidError, match="a string, not int"):
        check_idempotency_key(17)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("not a url", "spaces or control characters"),
        ("https://a/b c", "spaces or control characters"),
        ("https://a/\tb", "spaces or control characters"),
        ("https://é.example/", "not ASCII"),
        ("https://a/" + "x" * 2000, "at most 2000 characters"),
        ("https://[::1/", "is not a URL"),
        ("ftp://example.com/x", "not an https URL with a host"),
        ("https://a/#f", "#fragment"),
    ],
)
def test_webhook_urls_the_sdk_refuses_name_the_rule(url: str, rule: str) -> None:
    with pytest.raises(InvalidError, match=rule):
        check_webhook_url(url)
    with pytest.raises(InvalidRequest, match=rule) as caught:  # the server says the same
        server_check_webhook_url(url, allow_http=True)
    assert str(caught.value).startswith("X-Ember-Webhook: ")


@pytest.mark.parametrize(
    "url",
    [
        "https://169.254.169.254/latest/meta-data/",
        "https://169.254.1.2:8443/hook",
        "https://[fe80::1]/hook",
        "https://[::ffff:169.254.169.254]/hook",
        "https://[64:ff9b::a9fe:a9fe]/hook",  # the same through NAT64
        "https://2852039166/hook",
        "https://0xa9.0xfe.0xa9.0xfe/hook",
        "https://[fd00:ec2::254]/hook",
    ],
)
def test_the_server_refuses_link_local_and_metadata_addresses(url: str) -> None:
    assert check_webhook_url(url) == url  # the SDK leaves addresses to the server
    with pytest.raises(InvalidRequest, match="metadata") as caught:
        server_check_webhook_url(url, allow_http=False)
    assert http_error(caught.value).status == 400


@pytest.mark.parametrize(
    "url",
    [
        "https://127.0.0.1:8443/hook",
        "https://[::1]/hook",
        "https://10.1.2.3/",
        "https://192.168.0.9/",
    ],
)
def test_loopback_and_private_networks_stay_allowed(url: str) -> None:
    assert server_check_webhook_url(url, allow_http=False) == url


def test_spawn_checks_its_key_and_webhook_before_sending() -> None:
    from ember.calling.client import _spawn_headers

    for key in ("é", " ", "job "):
        with pytest.raises(InvalidError, match="idempotency key"):
            _spawn_headers(key)
    with pytest.raises(InvalidError, match="X-Ember-Webhook"):
        _spawn_headers(None, "not a url")
    assert _spawn_headers("job-17")["Idempotency-Key"] == "job-17"
