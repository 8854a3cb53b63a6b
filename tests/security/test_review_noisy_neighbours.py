"""A review of the noisy-neighbour defences (issue 49) by a hostile tenant holding a deploy
token of its own workspace against a real `ember server`: its replica's code speaks on
its channel as it likes (the channel object is in its own process), prints what it
likes, and its clients open connections as they like. Each test is the tenant's action
and an outcome another tenant or the operator would see.

Found:

- a replica that sends one byte of a result in pieces (`result_part`) and never the rest
  kept its channel from ever pausing (`http/channels.py` read on while any input was
  "mid-result"), so its workspace's answers grew past `--workspace-held-mb` without end;
- a result's pieces were summed again at each piece, and a piece could be one byte: one
  channel message of tens of thousands of one-byte pieces held the control plane's loop
  for seconds (every tenant's calls waited);
- the log limit counted a line's bytes only: a replica printing empty lines shipped a
  line to the control plane for every byte of its budget (10,240 lines from a 10 KiB
  burst), each an entry parsed, written and followed there (a line now counts 64 bytes
  at least);
- TLS handshakes run eight at once (`http/handshake_gate.py`), and a connection held its
  turn for the whole handshake, up to 60 s: eight connections that never send their
  ClientHello stopped every other client's new connection for a minute.

Held: a result's pieces for an input the replica does not run are dropped (checked
before).
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from harness import Platform, running_platform, wait_for

BUDGET_MIB = 4
APP = r"""
import asyncio
import gc
import os

import ember
from ember.cancellation import current_call_id
from ember.wire import messages as wire


def channel():
    return next(o for o in gc.get_objects() if type(o).__name__ == "ReplicaChannel")


@ember.endpoint(snapshot=False, concurrency=32, max_replicas=1, min_replicas=1, timeout=120)
async def hostile(mode: str, n: int = 0) -> str:
    me = current_call_id()
    if mode == "anchor":  # one byte of a result in pieces, and never the rest
        await channel().send(wire.ResultPart(id=me), "x")
        await asyncio.sleep(n)
        return "late"
    if mode == "crumbs":  # one message of n one-byte pieces
        piece = wire.frame(wire.ResultPart(id=me), "x")
        await channel().connection.send(wire.RECORD_SEPARATOR.join([piece] * n))
        return "done"
    return "x" * n


@ember.endpoint(snapshot=False, min_replicas=1, log_rate=1)
def blank_lines(n: int) -> int:
    os.write(1, b"\n" * n)  # past sys.stdout: no call's tag on its lines
    return n


@ember.endpoint(snapshot=False, min_replicas=1)
def noop() -> int:
    return 0
"""
HELD = re.compile(r'ember:held_bytes\{kind="answers",workspace="noisy"\} (\S+)')


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("noisy-review")
    budget = ("--workspace-held-mb", str(BUDGET_MIB))
    with running_platform(root / "platform", extra=budget) as platform:
        yield platform


@pytest.fixture(scope="module")
def tokens(platform: Platform, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    source = tmp_path_factory.mktemp("noisy-app") / "app.py"
    source.write_text(APP)
    made = {}
    for workspace in ("noisy", "quiet"):
        platform.ember("workspace", "create", workspace)
        token = platform.ember(
            "token", "create", "--workspace", workspace, "--scope", "deploy"
        ).stdout.strip()
        deployed = platform.ember_as(token, "deploy", str(source), "--name", "nn", "--wait")
        assert deployed.returncode == 0, deployed.stderr
        made[workspace] = token
    return made


def held_answers(platform: Platform) -> float:
    with platform.client() as admin:
        found = HELD.search(admin.get("/metrics").text)
    return float(found[1]) if found else 0.0


def unread_call(platform: Platform, token: str, body: bytes) -> socket.socket:
    """A call over TLS whose caller never reads its answer (a small receive buffer)."""
    import ssl

    from ember.calling.tlsclient import client_context

    host, port = platform.url.removeprefix("https://").rsplit(":", 1)
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.connect((host.strip("[]"), int(port)))
    tls: ssl.SSLSocket = client_context(platform.ca).wrap_socket(raw, server_hostname=host)
    head = (
        f"POST /noisy--nn--hostile/ HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    tls.sendall(head.encode() + body)
    return tls


def test_a_half_sent_result_does_not_lift_the_answers_budget(
    platform: Platform, tokens: dict[str, str]
) -> None:
    token = tokens["noisy"]

    def anchored() -> None:
        with platform.client(token, timeout=60) as client:
            client.post("/noisy--nn--hostile/", json={"mode": "anchor", "n": 20})

    anchor = threading.Thread(target=anchored, daemon=True)
    anchor.start()
    time.sleep(1.0)  # its piece is in
    result = 12_000_000
    body = json.dumps({"mode": "big", "n": result}).encode()
    callers = [unread_call(platform, token, body) for _ in range(10)]
    try:
        time.sleep(6.0)
        held = held_answers(platform)
    finally:
        for caller in callers:
            caller.close()
    # Past its budget the replica's channel is read no further: at most the budget and
    # the one result that filled it (and the piece) are held, not 10 results of 12 MB.
    assert held <= BUDGET_MIB * 2**20 + result + 1024, held


def test_a_result_in_one_byte_pieces_does_not_hold_the_loop(
    platform: Platform, tokens: dict[str, str]
) -> None:
    slowest = 0.0
    stop = threading.Event()

    def victim() -> None:
        nonlocal slowest
        with platform.client(tokens["quiet"], timeout=60) as client:
            while not stop.is_set():
                began = time.monotonic()
                answer = client.post("/quiet--nn--noop/", json={})
                assert answer.status_code == 200, answer.text
                slowest = max(slowest, time.monotonic() - began)
                time.sleep(0.02)

    watcher = threading.Thread(target=victim)
    watcher.start()
    try:
        with platform.client(tokens["noisy"], timeout=120) as client:
            answer = client.post("/noisy--nn--hostile/", json={"mode": "crumbs", "n": 40_000})
        time.sleep(0.5)
    finally:
        stop.set()
        watcher.join()
    # Its input fails (a result in more pieces than the largest has), and another
    # workspace's calls are answered meanwhile.
    assert answer.status_code == 500 and "result_too_large" in answer.text, answer.text[:300]
    assert slowest < 1.5, slowest


def test_empty_lines_pay_for_their_entries(platform: Platform, tokens: dict[str, str]) -> None:
    with platform.client(tokens["noisy"]) as client:
        answer = client.post("/noisy--nn--blank_lines/", json={"n": 100_000})
        assert answer.status_code == 200, answer.text

    def lines() -> list[dict[str, object]]:
        with platform.client(tokens["noisy"]) as client:
            got = client.get("/v1/apps/nn/logs", params={"tail": 20_000})
        entries = [json.loads(line) for line in got.text.splitlines() if line.strip()]
        return [entry for entry in entries if entry.get("endpoint") == "blank-lines"]

    marked = wait_for(
        lambda: [e for e in lines() if e.get("stream") == "ember" and "dropped" in str(e)], 30
    )
    shipped = [e for e in lines() if e.get("stream") == "stdout"]
    # Its burst is 10 KiB: an entry costs the control plane far more than one byte.
    assert marked and len(shipped) < 1_000, len(shipped)


def test_idle_connections_do_not_hold_every_handshake(platform: Platform) -> None:
    host, port = platform.url.removeprefix("https://").rsplit(":", 1)
    address = (host.strip("[]"), int(port))
    idle = []
    for at in range(8):
        connection = socket.create_connection(address)
        if at % 2:
            connection.sendall(b"\x16")  # the first byte of a ClientHello, and no more
        idle.append(connection)
    try:
        time.sleep(0.3)
        began = time.monotonic()
        with platform.client(timeout=15) as client:
            assert client.get("/v1/health").status_code == 200
        took = time.monotonic() - began
    finally:
        for connection in idle:
            connection.close()
    assert took < 5.0, took
