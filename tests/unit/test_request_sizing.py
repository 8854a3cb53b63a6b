"""How many adjacent chunks one origin request carries, from the answers seen so far."""

from __future__ import annotations

import pytest

from ember_worker.weights.reading.request_sizing import RequestSizer

MIB = 2**20
CHUNK = 16 * MIB


def answered(sizer: RequestSizer, *, wait: float, rate: float, times: int = 3) -> None:
    """`times` answers of one chunk each, their first byte after `wait` s, then `rate` B/s."""
    for _ in range(times):
        sizer.record(CHUNK, wait, wait + CHUNK / rate)


def test_one_chunk_per_request_until_there_are_answers() -> None:
    sizer = RequestSizer(CHUNK, 8)
    assert sizer.chunks_per_request() == 1
    assert sizer.estimate() is None
    sizer.record(CHUNK, 5.0, 5.01)  # one slow answer is not enough to go on
    assert sizer.chunks_per_request() == 1


def test_an_origin_that_answers_at_once_gets_one_chunk_per_request() -> None:
    # A nearby S3 (30 ms first byte, 90 MB/s per connection): the wait carries 2.7 MB.
    sizer = RequestSizer(CHUNK, 8)
    answered(sizer, wait=0.03, rate=90e6)
    assert sizer.chunks_per_request() == 1


def test_a_waiting_origin_gets_as_many_chunks_as_its_wait_could_carry() -> None:
    # 0.2 s before the first byte at 200 MB/s: 40 MB, two whole 16 MiB chunks.
    sizer = RequestSizer(CHUNK, 8)
    answered(sizer, wait=0.2, rate=200e6)
    assert sizer.chunks_per_request() == 2
    estimate = sizer.estimate()
    assert estimate is not None
    assert estimate[0] == pytest.approx(0.2)
    assert estimate[1] == pytest.approx(200e6, rel=1e-6)


def test_requests_never_grow_past_the_bound() -> None:
    sizer = RequestSizer(CHUNK, 4)
    answered(sizer, wait=10.0, rate=1e9)
    assert sizer.chunks_per_request() == 4
    never = RequestSizer(CHUNK, 1)
    answered(never, wait=10.0, rate=1e9)
    assert never.chunks_per_request() == 1


def test_one_answer_stuck_behind_a_pause_does_not_reshape_requests() -> None:
    sizer = RequestSizer(CHUNK, 8)
    answered(sizer, wait=0.005, rate=500e6, times=6)
    sizer.record(CHUNK, 3.0, 3.05)
    assert sizer.chunks_per_request() == 1


def test_the_latest_answers_count_most() -> None:
    """An origin that becomes slow (a queue builds up) is followed within the window."""
    sizer = RequestSizer(CHUNK, 8, window=5)
    answered(sizer, wait=0.005, rate=500e6, times=5)
    answered(sizer, wait=1.0, rate=500e6, times=3)
    assert sizer.chunks_per_request() == 8
    answered(sizer, wait=0.005, rate=500e6, times=3)
    assert sizer.chunks_per_request() == 1


def test_nonsense_answers_are_ignored() -> None:
    sizer = RequestSizer(CHUNK, 8)
    sizer.record(0, 1.0, 2.0)
    sizer.record(CHUNK, -1.0, 2.0)
    sizer.record(CHUNK, 1.0, 0.0)
    assert sizer.estimate() is None


def test_a_body_that_came_with_its_headers_reads_as_fast() -> None:
    sizer = RequestSizer(CHUNK, 8)
    for _ in range(2):
        sizer.record(CHUNK, 0.5, 0.5)
    assert sizer.chunks_per_request() == 8


@pytest.mark.parametrize(
    "arguments", [(0, 4), (CHUNK, 0), (CHUNK, 4, 0), (CHUNK, 4, 3, 0)], ids=str
)
def test_bad_settings_are_refused(arguments: tuple[int, ...]) -> None:
    names = ("chunk_bytes", "max_chunks", "window", "min_samples")
    with pytest.raises(ValueError, match="must be >= 1"):
        RequestSizer(**dict(zip(names, arguments, strict=False)))
