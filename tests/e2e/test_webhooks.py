"""Webhooks of spawned calls: a call spawned with a webhook URL is POSTed to it when it
ends, signed with the platform's secret; a receiver that fails gets the same delivery
again; one answering with a huge body or dripping its answer costs the platform neither
memory nor more than an attempt's time limit; one still pending when the control plane
stops is sent after it starts again."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Platform, running_platform, wait_for
from webhook_receiver import HUGE, Receiver, start_receiver

import ember
from ember_platform.calls.webhooks import ATTEMPT_TIMEOUT_ENV

# One attempt's limit here (the default is 15 s): what a dripping receiver holds it for.
ATTEMPT_SECONDS = 3.0

APP = "hooked"


@pytest.fixture(scope="module")
def receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Receiver]:
    receiver = start_receiver(tmp_path_factory.mktemp("receiver"))
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, receiver: Receiver) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("platform")
    extra = ("--webhook-ca-cert", str(receiver.ca_cert), "--webhook-retry-delays", "0.2,0.2")
    env = {ATTEMPT_TIMEOUT_ENV: f"{ATTEMPT_SECONDS:g}"}
    with running_platform(root, extra=extra, env=env) as running:
        yield running


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> dict[str, str]:
    return platform.deploy(apps_dir / "basic.py", APP)


def _secret(platform: Platform) -> str:
    return platform.ember("calls", "webhook-secret").stdout.strip()


def _deliveries_of(receiver: Receiver, call_id: str) -> list:
    return [d for d in receiver.deliveries if d.headers.get("webhook-id") == call_id]


def test_a_spawned_call_tells_its_webhook_of_its_result_signed(
    platform: Platform, deployed: dict[str, str], receiver: Receiver
) -> None:
    echo = ember.Endpoint.lookup(APP, "echo", config=platform.config())
    handle = echo.spawn(_webhook=f"{receiver.url}/done?job=7", text="hi", times=2)
    (delivery,) = wait_for(lambda: _deliveries_of(receiver, handle.call_id), 30)
    assert delivery.path == "/done?job=7"
    payload = ember.verify_webhook(delivery.body, delivery.headers, _secret(platform))
    assert payload["type"] == "call.ended" and payload["call_id"] == handle.call_id
    assert (payload["app"], payload["endpoint"], payload["status"]) == (APP, "echo", "succeeded")
    assert payload["result"]["text"] == "hihi" and payload["http_status"] == 200
    assert payload["status_url"] == f"{platform.url}/v1/calls/{handle.call_id}"
    assert handle.get(timeout=10) == payload["result"]  # the result is still there to fetch
    with pytest.raises(ember.WebhookVerificationError, match="does not match"):
        ember.verify_webhook(delivery.body + b" ", delivery.headers, _secret(platform))
    listed = json.loads(platform.ember("calls", "ls", APP, "--json").stdout)
    assert next(c for c in listed if c["call_id"] == handle.call_id)["webhook"] == "delivered"


def test_a_failed_call_and_a_failing_receiver_get_the_same_delivery_again(
    platform: Platform, deployed: dict[str, str], receiver: Receiver
) -> None:
    receiver.answers[:] = [500, 503]  # twice refused, then taken
    boom = ember.Endpoint.lookup(APP, "boom", config=platform.config())
    handle = boom.spawn(_webhook=receiver.url, message="no luck")
    deliveries = wait_for(lambda: len(_deliveries_of(receiver, handle.call_id)) == 3, 30)
    assert deliveries
    first, *again = _deliveries_of(receiver, handle.call_id)
    assert all(d.body == first.body for d in again)
    payload = json.loads(first.body)
    assert payload["status"] == "failed" and payload["http_status"] == 500
    assert "no luck" in payload["error"]["message"]
    logs = platform.ember("logs", APP, "-n", "200").stdout
    assert (
        f"webhook of call {handle.call_id} failed (attempt 1 of 3): the receiver answered 500"
        in logs
    )
    assert f"webhook of call {handle.call_id} delivered (200)" in logs


def _rss_bytes(platform: Platform) -> int:
    assert platform.process is not None
    status = Path(f"/proc/{platform.process.pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_a_receiver_answering_with_a_huge_body_is_not_read_to_its_end(
    platform: Platform, deployed: dict[str, str], receiver: Receiver
) -> None:
    receiver.bytes_sent = 0
    hung_up = len(receiver.hung_up)
    before = _rss_bytes(platform)
    receiver.manners[:] = ["huge"]
    echo = ember.Endpoint.lookup(APP, "echo", config=platform.config())
    handle = echo.spawn(_webhook=receiver.url, text="big")
    wait_for(lambda: len(receiver.hung_up) > hung_up, 30)  # the platform left it midway
    logs = platform.ember("logs", APP, "-n", "200").stdout
    assert f"webhook of call {handle.call_id} delivered (200)" in logs  # its status counts
    # It sent what the sockets' buffers hold, not its 400 MiB; the platform kept none.
    assert receiver.bytes_sent < HUGE // 8
    assert _rss_bytes(platform) - before < 100 * 1024 * 1024


def test_a_receiver_dripping_its_answer_holds_an_attempt_no_longer_than_its_limit(
    platform: Platform, deployed: dict[str, str], receiver: Receiver
) -> None:
    hung_up = len(receiver.hung_up)
    receiver.manners[:] = ["drip_head", "drip_body"]  # then the retry's 200 after a drip
    echo = ember.Endpoint.lookup(APP, "echo", config=platform.config())
    handle = echo.spawn(_webhook=receiver.url, text="slow")
    wait_for(lambda: len(receiver.hung_up) >= hung_up + 2, ATTEMPT_SECONDS + 30)
    first, second = _deliveries_of(receiver, handle.call_id)
    # The first attempt ended at its limit, the second at the status, a byte in.
    assert receiver.hung_up[hung_up] - first.at < ATTEMPT_SECONDS + 3
    assert receiver.hung_up[hung_up + 1] - second.at < 3
    logs = platform.ember("logs", APP, "-n", "200").stdout
    assert (
        f"webhook of call {handle.call_id} failed (attempt 1 of 3): no answer within "
        f"{ATTEMPT_SECONDS:g} s" in logs
    )
    assert f"webhook of call {handle.call_id} delivered (200)" in logs
    assert time.monotonic() - first.at < ATTEMPT_SECONDS + 10


def test_webhooks_are_refused_where_they_cannot_work(
    platform: Platform, deployed: dict[str, str], receiver: Receiver
) -> None:
    with platform.client() as client:
        sync = client.post(
            f"/{APP}--echo/", json={"text": "x"}, headers={"X-Ember-Webhook": receiver.url}
        )
        assert sync.status_code == 400 and "Prefer: respond-async" in sync.text
        refused = {
            "http://127.0.0.1:9/hook": "not an https URL",
            "ftp://example.com/x": "not an https URL",
            "https://": "not an https URL with a host",
            "https://a/#f": "#fragment",
            "https://169.254.169.254/latest/meta-data/": "link-local address",
            "https://[fe80::1]/hook": "link-local address",
        }
        for url, why in refused.items():
            bad = client.post(
                f"/{APP}--echo/",
                json={"text": "x"},
                headers={"Prefer": "respond-async", "X-Ember-Webhook": url},
            )
            assert bad.status_code == 400, url
            message = bad.json()["error"]["message"]
            assert message.startswith("X-Ember-Webhook: ") and why in message, message
    cli = platform.ember(
        "call", f"{APP}--echo", '{"text": "x"}', "--webhook", receiver.url, check=False
    )
    assert cli.returncode == 1 and "--webhook goes with --spawn" in cli.stderr


def test_a_webhook_pending_at_a_restart_is_sent_after_it(tmp_path: Path, apps_dir: Path) -> None:
    receiver = start_receiver(tmp_path / "receiver")
    port = int(receiver.url.rsplit(":", 1)[1])
    receiver.stop()  # not listening when the call ends: the first attempt fails
    extra = ("--webhook-ca-cert", str(receiver.ca_cert), "--webhook-retry-delays", "600")
    with running_platform(tmp_path / "platform", extra=extra) as platform:
        platform.deploy(apps_dir / "basic.py", APP)
        echo = ember.Endpoint.lookup(APP, "echo", config=platform.config())
        handle = echo.spawn(_webhook=receiver.url, text="later")
        assert handle.get(timeout=30)["text"] == "later"
        wait_for(lambda: "failed (attempt 1 of 2)" in platform.ember("logs", APP).stdout, 30)
        secret = _secret(platform)
    back = start_receiver(tmp_path / "receiver", port=port)
    try:
        with running_platform(tmp_path / "platform", extra=extra) as platform:
            (delivery,) = wait_for(lambda: _deliveries_of(back, handle.call_id), 30)
            payload = ember.verify_webhook(delivery.body, delivery.headers, secret)
            assert payload["result"]["text"] == "later"
            wait_for(lambda: "delivered" in platform.ember("calls", "ls", APP).stdout, 10)
    finally:
        back.stop()
