"""Delivering webhooks to receivers that misbehave: one answering with a huge body, one
sending its answer a byte at a time, and addresses no webhook may reach. The receiver is
a real socket server on loopback, speaking HTTP by hand so that it can misbehave."""

from __future__ import annotations

import asyncio
import json
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from call_record_factory import ended_call

from ember_platform.calls.webhooks import (
    ATTEMPT_TIMEOUT_ENV,
    ATTEMPT_TIMEOUT_SECONDS,
    WebhookSender,
    attempt_seconds,
    receiver_addresses,
)
from ember_platform.observability.logs import LogSink
from ember_platform.observability.metrics import PlatformMetrics
from ember_platform.storage.records import WEBHOOK_DELIVERED, WEBHOOK_FAILED

SECRET = "whsec_" + "a2V5" * 8
HUGE = 400 * 1024 * 1024  # what the receiver says its body holds
CHUNK = 64 * 1024
DRIP_PAUSE = 0.1  # seconds between two bytes of a dripped answer


@dataclass
class Misbehaving:
    """How the receiver answers, and what it managed to send before the platform left."""

    manner: str  # "huge", "drip_head" or "drip_body"
    port: int = 0
    bytes_sent: int = 0
    requests: int = 0
    answered: threading.Event = field(default_factory=threading.Event)  # the peer left


def _read_request(conn: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += conn.recv(65536)


def _answer(receiver: Misbehaving, conn: socket.socket) -> None:
    def send(data: bytes) -> None:
        conn.sendall(data)
        receiver.bytes_sent += len(data)

    if receiver.manner == "huge":
        send(f"HTTP/1.1 200 OK\r\nContent-Length: {HUGE}\r\n\r\n".encode())
        while receiver.bytes_sent < HUGE:
            send(b"x" * CHUNK)
        return
    if receiver.manner == "drip_body":
        send(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        dripped = b"x" * 100000
    else:  # drip_head: not even the status line comes whole
        dripped = b"HTTP/1.1 200 OK\r\n" + b"X-Slow: yes\r\n" * 10000
    for byte in dripped:
        send(bytes([byte]))
        time.sleep(DRIP_PAUSE)


@pytest.fixture
def receiver(request: pytest.FixtureRequest) -> Iterator[Misbehaving]:
    receiver = Misbehaving(request.param)

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            receiver.requests += 1
            try:
                _read_request(self.request)
                _answer(receiver, self.request)
            except OSError:
                pass  # the platform closed the connection: what the tests wait for
            finally:
                receiver.answered.set()

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    receiver.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield receiver
    server.shutdown()
    server.server_close()


def _deliver(
    tmp_path: Path, url: str, attempt_timeout: float = 15.0, retry_delays: tuple[float, ...] = ()
) -> tuple[str, list[str]]:
    """What became of the delivery to `url`, and the lines it logged."""
    outcomes: list[str] = []
    logs = LogSink(tmp_path / "logs")

    async def run() -> None:
        sender = WebhookSender(
            SECRET,
            "https://platform.example",
            logs,
            PlatformMetrics(),
            lambda _record, state: outcomes.append(state),
            retry_delays=retry_delays,
            attempt_timeout=attempt_timeout,
        )
        try:
            sender.deliver(ended_call(webhook=url))
            while not outcomes:
                await asyncio.sleep(0.01)
        finally:
            await sender.close()

    asyncio.run(asyncio.wait_for(run(), 60))
    lines = (tmp_path / "logs" / "app.jsonl").read_text().splitlines()
    return outcomes[0], [json.loads(line)["text"] for line in lines]


@pytest.mark.parametrize("receiver", ["huge"], indirect=True)
def test_a_huge_answer_counts_by_its_status_and_its_body_is_left_unread(
    tmp_path: Path, receiver: Misbehaving
) -> None:
    began = time.monotonic()
    state, lines = _deliver(tmp_path, f"http://127.0.0.1:{receiver.port}/hook")
    assert state == WEBHOOK_DELIVERED and "delivered (200)" in lines[-1]
    assert receiver.answered.wait(10)  # the platform hung up on it
    assert time.monotonic() - began < 10
    # What it could send is what fits in the sockets' buffers, not the 400 MiB.
    assert receiver.bytes_sent < 32 * 1024 * 1024


@pytest.mark.parametrize("receiver", ["drip_head"], indirect=True)
def test_an_answer_dripping_in_ends_the_attempt_at_its_limit(
    tmp_path: Path, receiver: Misbehaving
) -> None:
    began = time.monotonic()
    state, lines = _deliver(tmp_path, f"http://127.0.0.1:{receiver.port}/", attempt_timeout=1.0)
    took = time.monotonic() - began
    assert state == WEBHOOK_FAILED and lines[-1].endswith("giving up: no answer within 1 s")
    assert 1.0 <= took < 15  # its limit, not the drip's hours (a loaded machine's margin)
    assert receiver.answered.wait(5)  # its connection was closed, not left to drip


def test_the_servers_environment_may_set_an_attempts_limit() -> None:
    assert attempt_seconds({}) == ATTEMPT_TIMEOUT_SECONDS == 15.0
    assert attempt_seconds({ATTEMPT_TIMEOUT_ENV: "3"}) == 3.0
    assert attempt_seconds({ATTEMPT_TIMEOUT_ENV: "0.1"}) == 1.0
    assert attempt_seconds({ATTEMPT_TIMEOUT_ENV: "1e9"}) == 300.0
    assert attempt_seconds({ATTEMPT_TIMEOUT_ENV: "inf"}) == ATTEMPT_TIMEOUT_SECONDS
    assert attempt_seconds({ATTEMPT_TIMEOUT_ENV: "quick"}) == ATTEMPT_TIMEOUT_SECONDS


@pytest.mark.parametrize("receiver", ["drip_body"], indirect=True)
def test_a_dripping_body_after_a_2xx_status_is_a_delivery(
    tmp_path: Path, receiver: Misbehaving
) -> None:
    began = time.monotonic()
    # Reading the 10,000 s body would end the attempt at its limit, failed.
    state, _ = _deliver(tmp_path, f"http://127.0.0.1:{receiver.port}/", attempt_timeout=60.0)
    assert state == WEBHOOK_DELIVERED and time.monotonic() - began < 30
    assert receiver.answered.wait(5)


@pytest.mark.parametrize(
    "url",
    [
        "https://169.254.169.254/latest/meta-data/",
        "https://[fe80::1]/hook",
        "https://[::ffff:169.254.169.254]/hook",
        "https://2852039166/hook",  # 169.254.169.254 as one number: it resolves all the same
        "https://[fd00:ec2::254]/hook",
    ],
)
def test_deliveries_to_link_local_and_metadata_addresses_are_refused_at_once(
    tmp_path: Path, url: str
) -> None:
    began = time.monotonic()
    state, lines = _deliver(tmp_path, url, retry_delays=(30.0,))  # no retry: it cannot help
    assert state == WEBHOOK_FAILED and time.monotonic() - began < 15  # no 30 s retry
    assert "not delivered after 1 attempt(s), giving up: refused: " in lines[-1]
    assert "address" in lines[-1]


def test_loopback_names_resolve_to_addresses_that_are_allowed() -> None:
    addresses = asyncio.run(receiver_addresses("localhost", 443))
    assert addresses and all(a in ("127.0.0.1", "::1") for a in addresses)


def test_each_workspace_signs_with_a_secret_of_its_own() -> None:
    import base64

    from ember.calling.webhooks import secret_key, signature
    from ember_platform.calls.webhooks import workspace_secret

    platform = "whsec_" + base64.b64encode(bytes(range(32))).decode()
    assert workspace_secret(platform, "main") == platform  # as before workspaces
    team_a, team_b = workspace_secret(platform, "team-a"), workspace_secret(platform, "team-b")
    assert len({platform, team_a, team_b}) == 3
    assert workspace_secret(platform, "team-a") == team_a  # derived, never stored
    signed = signature(secret_key(team_a), "msg", 1, b"{}")
    assert signed != signature(secret_key(team_b), "msg", 1, b"{}")
