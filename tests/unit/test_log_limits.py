"""A replica's output within its log limit: a bucket of bytes with a burst, the marker
of what was dropped, the node's buffer bound; read from a real pipe."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from ember_worker.agent import log_shipping
from ember_worker.agent.log_shipping import LogShipper
from ember_worker.agent.running_replica import RunningReplica
from ember_worker.log_limits import KIB, Dropped, LogBudget, LogLimit, marker_text


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_the_rate() -> None:
    budget = LogBudget(LogLimit(rate_kib=1, burst_kib=4), now=0.0)
    assert budget.take(4 * KIB, 0.0)
    assert not budget.take(1, 0.0)
    assert not budget.take(KIB, 0.5)
    assert budget.take(KIB, 1.0)  # a second's rate came back
    assert budget.take(4 * KIB, 100.0) and not budget.take(1, 100.0)  # never past the burst


def test_a_marker_a_second_at_most_and_one_at_the_end() -> None:
    budget = LogBudget(LogLimit(), now=0.0)
    assert budget.marker_due(5.0) is None  # nothing dropped
    budget.drop(3, 300)
    assert budget.marker_due(0.5) is None
    assert budget.marker_due(1.0) == Dropped(lines=3, size=300)
    budget.drop(1, 10, unsent=True)
    assert budget.marker_due(1.2) is None
    assert budget.marker_due(1.2, ending=True) == Dropped(lines=1, size=10, unsent=1)


def test_an_endpoint_lowers_the_node_limit_and_never_raises_it() -> None:
    node = LogLimit(rate_kib=1024, burst_kib=10240)
    assert LogLimit(rate_kib=100).within(node) == LogLimit(100, 1000)
    assert LogLimit(rate_kib=5000).within(node) == node
    assert str(node) == "1024 KiB/s (bursts of 10240 KiB)"
    text = marker_text(Dropped(lines=2, size=3 * KIB * KIB), node)
    assert text.startswith("ember: 2 lines (3.0 MiB) of this replica's output dropped: ")
    assert "log limit of 1024 KiB/s" in text
    assert "buffer was full" in marker_text(Dropped(1, 1, unsent=1), node)


def shipped(
    lines: list[bytes], limit: LogLimit, stream: str = "stdout", **replica: Any
) -> tuple[list[dict[str, Any]], RunningReplica]:
    """What a shipper buffers of `lines` written to a pipe at one instant."""
    shipper = LogShipper(limit, clock=Clock())
    record = RunningReplica("r1", "ws/app", "ep", **replica)
    read, write = os.pipe()

    async def run() -> None:
        shipping = asyncio.ensure_future(shipper.ship_output(record, read, stream))
        await asyncio.to_thread(_write_all, write, b"".join(lines))
        await shipping

    asyncio.run(run())
    os.close(read)
    return shipper.buffer, record


def _write_all(fd: int, data: bytes) -> None:
    with os.fdopen(fd, "wb") as pipe:
        pipe.write(data)


def test_output_past_the_burst_is_dropped_and_said_as_the_pipe_closes() -> None:
    lines = [b"%05d " % n + b"x" * 1000 + b"\n" for n in range(3000)]  # about 3 MiB
    buffer, _ = shipped(lines, LogLimit(rate_kib=64, burst_kib=256))
    texts = [entry["text"] for entry in buffer]
    kept = [text for text in texts if not text.startswith("ember:")]
    assert kept == [line.decode().rstrip("\n") for line in lines[: len(kept)]]  # in order
    assert 250 * KIB <= len(kept) * 1007 <= 256 * KIB
    marker = buffer[-1]
    assert marker["stream"] == "ember" and marker["dropped"] == 3000 - len(kept)
    assert marker["replica"] == "r1" and marker["app"] == "ws/app"


def test_an_endpoints_limit_applies_within_the_nodes() -> None:
    lines = [b"y" * 99 + b"\n"] * 1000  # 100 KB
    buffer, _ = shipped(lines, LogLimit(), log_limit=LogLimit(rate_kib=1))
    assert sum(1 for entry in buffer if entry["text"] == "y" * 99) == 10 * KIB // 100  # the burst


def test_the_last_words_of_stderr_are_kept_even_when_dropped() -> None:
    lines = [b"noise\n"] * 10_000 + [b"Traceback: it broke\n"]
    _, record = shipped(lines, LogLimit(rate_kib=1, burst_kib=1), stream="stderr")
    assert record.stderr_tail[-1][1] == "Traceback: it broke"


def test_a_line_without_an_end_comes_in_pieces_of_a_bounded_size() -> None:
    buffer, _ = shipped([b"z" * (200 * KIB)], LogLimit())
    assert max(len(entry["text"]) for entry in buffer) <= 128 * KIB
    assert sum(len(entry["text"]) for entry in buffer) == 200 * KIB


def test_the_node_buffer_is_bounded_whatever_replicas_print(monkeypatch: Any) -> None:
    monkeypatch.setattr(log_shipping, "MAX_BUFFERED_BYTES", 50 * KIB)
    lines = [b"w" * 999 + b"\n"] * 500  # 500 KB, well within the limit
    buffer, _ = shipped(lines, LogLimit(rate_kib=10_000, burst_kib=10_000))
    kept = [entry for entry in buffer if entry["stream"] == "stdout"]
    assert len(kept) == 50 * KIB // (1000 + log_shipping.ENTRY_BYTES)
    assert "buffer was full" in buffer[-1]["text"] and buffer[-1]["dropped"] == 500 - len(kept)


def test_output_the_node_drops_is_read_no_faster_than_its_dropping_rate(monkeypatch: Any) -> None:
    """Past its limit a replica's reads are paced (the pauses asked of the loop are
    counted here, not waited): a replica that prints faster waits in its writes instead
    of taking the node's CPU to be dropped. Within its limit, nothing waits."""
    pauses: list[float] = []
    sleep = asyncio.sleep

    async def paced(seconds: float) -> None:
        pauses.append(seconds)
        await sleep(0)

    monkeypatch.setattr(log_shipping.asyncio, "sleep", paced)
    lines = [b"%05d " % n + b"x" * 1000 + b"\n" for n in range(3000)]  # about 3 MiB
    buffer, _ = shipped(lines, LogLimit(rate_kib=64, burst_kib=256))
    dropped = buffer[-1]["dropped"] * 1007
    assert abs(sum(pauses) - dropped / log_shipping.DROPPING_READ_RATE) < 0.02  # a block
    pauses.clear()
    shipped(lines[:200], LogLimit(rate_kib=64, burst_kib=256))
    assert pauses == []
