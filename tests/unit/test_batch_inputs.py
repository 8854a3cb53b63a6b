"""A Batch API input file read into requests, and the room a batch is given: pure."""

from __future__ import annotations

import json

from ember_platform.batches.input_files import read_input_file
from ember_platform.batches.room import batch_room

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
    parsed = read_input_file(data, CHAT)
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
    parsed = read_input_file(b"\n".join([line("x"), line("y"), line("x")]), CHAT)
    assert parsed.duplicate is not None
    assert (parsed.duplicate.line, parsed.duplicate.code) == (3, "duplicate_custom_id")
    assert "line 1" in parsed.duplicate.message


def test_batches_take_only_the_room_online_calls_leave() -> None:
    assert batch_room(ready_replicas=2, free_slots=4, online_waiting=0, batch_waiting=0) == 4
    assert batch_room(ready_replicas=2, free_slots=4, online_waiting=3, batch_waiting=0) == 1
    assert batch_room(ready_replicas=2, free_slots=4, online_waiting=1, batch_waiting=2) == 1
    assert batch_room(ready_replicas=2, free_slots=0, online_waiting=0, batch_waiting=0) == 0
    assert batch_room(ready_replicas=1, free_slots=1, online_waiting=5, batch_waiting=0) == 0
    # Scaled to zero: one request queued, so that the autoscaler starts a replica.
    assert batch_room(ready_replicas=0, free_slots=0, online_waiting=0, batch_waiting=0) == 1
    assert batch_room(ready_replicas=0, free_slots=0, online_waiting=0, batch_waiting=1) == 0
    assert batch_room(ready_replicas=0, free_slots=0, online_waiting=2, batch_waiting=0) == 0
