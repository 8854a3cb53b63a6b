"""A Batch API input file read into requests, and the room a batch is given: pure."""

from __future__ import annotations

import json

import pytest

from ember_platform.batches.input_files import TooManyLines, read_input_file
from ember_platform.batches.room import OnlinePeak, batch_room

CHAT = "/v1/chat/completions"


def line(custom_id: str, **overrides: object) -> bytes:
    request = {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": {"n": 1}}
    return json.dumps({**request, **overrides}).encode()


def test_each_wrong_line_fails_alone_and_the_rest_are_requests() -> None:
    data = b"\n".join(
        [
            line("a"),
            b"",  # blank lines are skipped
            b"{not json",
            b'{"custom_id": "b", "method": "POST"}',  # no url, no body
            line("c", method="GET"),
            line("d", url="/v1/embeddings"),
            line("e", body={"stream": True}),
            line("f", extra=1),  # a field OpenAI's lines do not have
            line("g"),
        ]
    )
    parsed = read_input_file(data, CHAT, max_lines=100)
    assert [(r.index, r.line, r.custom_id) for r in parsed.requests] == [(0, 1, "a"), (1, 9, "g")]
    assert json.loads(parsed.requests[0].body) == {"n": 1}
    codes = [(e.line, e.custom_id, e.code) for e in parsed.errors]
    assert codes == [
        (3, None, "invalid_json_line"),
        (4, None, "invalid_request"),
        (5, "c", "invalid_method"),
        (6, "d", "invalid_url"),
        (7, "e", "invalid_request"),
        (8, None, "invalid_request"),
    ]
    assert parsed.duplicate is None and parsed.total == 8


def test_a_custom_id_used_twice_fails_the_batch() -> None:
    parsed = read_input_file(b"\n".join([line("x"), line("y"), line("x")]), CHAT, 100)
    assert parsed.duplicate is not None
    assert (parsed.duplicate.line, parsed.duplicate.code) == (3, "duplicate_custom_id")
    assert "line 1" in parsed.duplicate.message


def test_a_file_is_read_no_further_than_its_limit() -> None:
    data = b"\n".join([line("a"), b"", b"x", line("b")])
    assert read_input_file(data, CHAT, max_lines=3).total == 3  # the blank line is none
    with pytest.raises(TooManyLines, match="more than 2"):
        read_input_file(data, CHAT, max_lines=2)
    nested = b'{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", "body": '
    nested += b'{"a": ' * 5000 + b"1" + b"}" * 5001
    (error,) = read_input_file(nested, CHAT, max_lines=2).errors
    assert (error.code, error.message) == ("invalid_request", "the line nests too deep")


def test_batches_take_only_the_room_online_calls_leave() -> None:
    def room(slots: int, free: int, online: int, batch: int, peak: int = 0) -> int:
        return batch_room(slots, free, online, batch, peak)

    assert room(8, free=8, online=0, batch=0) == 7  # one slot kept for an online call
    assert room(8, free=4, online=2, batch=0) == 1
    assert room(8, free=4, online=1, batch=2) == 0
    assert room(8, free=8, online=0, batch=0, peak=3) == 4  # the online peak's, and one
    assert room(8, free=2, online=0, batch=0, peak=3) == 0
    assert room(4, free=4, online=0, batch=0, peak=9) == 1  # never every slot
    # One slot: the batch takes it when no online call waits.
    assert room(1, free=1, online=0, batch=0, peak=2) == 1
    assert room(1, free=1, online=1, batch=0) == 0
    # Scaled to zero: one request queued, so that the autoscaler starts a replica.
    assert room(0, free=0, online=0, batch=0, peak=3) == 1
    assert room(0, free=0, online=0, batch=1) == 0
    assert room(0, free=0, online=2, batch=0) == 0


def test_the_online_peak_is_the_most_held_at_once_within_its_window() -> None:
    peak = OnlinePeak(window=60.0)
    assert peak.peak(0.0) == 0
    for at, count in ((0.0, 2), (10.0, 5), (20.0, 1), (30.0, 3)):
        peak.note(at, count)
    assert peak.peak(30.0) == 5
    assert peak.peak(69.0) == 5  # seen at 10 s: still within the last minute
    assert peak.peak(71.0) == 3  # then the most since
    assert peak.peak(91.0) == 0
