"""`Endpoint.map`'s scheduling of calls: order, concurrency, back-pressure of the input
iterable, errors, and leaving early. The HTTP side is tested end to end (test_workers)."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from ember.calling.mapping import BACKLOG_PER_SLOT, map_calls, retry_after_seconds
from ember.cli.calling.map_inputs import read_inputs, result_line
from ember.errors import InvalidError, RemoteError, UserCodeError


class Recorder:
    """A call that sleeps its input's `delay`, fails on `fail`, and records concurrency."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.most_at_once = 0
        self.started: list[int] = []

    def __call__(self, arguments: Mapping[str, Any]) -> Any:
        with self.lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
            self.started.append(arguments["i"])
        try:
            time.sleep(arguments.get("delay", 0.0))
            if arguments.get("fail"):
                raise UserCodeError(500, "ValueError", f"input {arguments['i']} failed")
            return arguments["i"] * 10
        finally:
            with self.lock:
                self.running -= 1


def run(inputs: list[dict[str, Any]], **options: Any) -> list[tuple[int, Any]]:
    settings = {"concurrency": 4, "order_outputs": True, "return_exceptions": False}
    return list(map_calls(Recorder(), inputs, **(settings | options)))


def test_ordered_results_come_in_input_order_even_when_later_ones_finish_first() -> None:
    inputs = [{"i": i, "delay": 0.05 if i == 0 else 0.0} for i in range(10)]
    assert run(inputs) == [(i, i * 10) for i in range(10)]


def test_unordered_results_come_as_they_finish() -> None:
    inputs = [{"i": 0, "delay": 0.3}] + [{"i": i} for i in range(1, 6)]
    results = run(inputs, order_outputs=False)
    assert sorted(results) == [(i, i * 10) for i in range(6)]
    assert results[-1] == (0, 0)  # the slow one last


def test_concurrency_is_the_most_calls_at_once() -> None:
    recorder = Recorder()
    inputs = [{"i": i, "delay": 0.02} for i in range(30)]
    options = {"order_outputs": True, "return_exceptions": False}
    results = list(map_calls(recorder, inputs, concurrency=3, **options))
    assert len(results) == 30
    assert recorder.most_at_once == 3


def test_inputs_are_read_only_as_far_as_the_backlog() -> None:
    taken: list[int] = []

    def endless() -> Iterator[dict[str, Any]]:
        i = 0
        while True:
            taken.append(i)
            yield {"i": i}
            i += 1

    results = map_calls(
        Recorder(), endless(), concurrency=2, order_outputs=True, return_exceptions=False
    )
    assert next(results) == (0, 0)
    # Two slots: at most the backlog, plus the one that told the loop it was full.
    assert len(taken) <= 2 * BACKLOG_PER_SLOT + 1
    results.close()


def test_a_failure_raises_with_a_note_naming_the_input() -> None:
    inputs = [{"i": i, "fail": i == 3} for i in range(6)]
    with pytest.raises(UserCodeError) as caught:
        run(inputs)
    assert "input 3 failed" in str(caught.value)
    assert "(input 3 of the map)" in caught.value.__notes__


def test_return_exceptions_yields_the_error_in_its_place() -> None:
    inputs = [{"i": i, "fail": i == 3} for i in range(6)]
    results = run(inputs, return_exceptions=True)
    assert [index for index, _ in results] == list(range(6))
    assert isinstance(results[3][1], UserCodeError)
    assert [value for _, value in results if not isinstance(value, RemoteError)] == [
        0,
        10,
        20,
        40,
        50,
    ]


def test_an_input_that_is_not_a_dict_is_refused_before_it_is_sent() -> None:
    recorder = Recorder()
    with pytest.raises(InvalidError, match="input 1 of the map is int"):
        list(
            map_calls(
                recorder,
                [{"i": 0}, 5],  # type: ignore[list-item]
                concurrency=1,
                order_outputs=True,
                return_exceptions=True,
            )
        )
    assert 5 not in recorder.started


def test_leaving_early_sends_nothing_more() -> None:
    recorder = Recorder()
    inputs = [{"i": i, "delay": 0.01} for i in range(200)]
    options = {"order_outputs": True, "return_exceptions": False}
    results = map_calls(recorder, inputs, concurrency=2, **options)
    assert next(results) == (0, 0)
    results.close()  # returns once the calls already sent have finished
    assert recorder.running == 0
    assert len(recorder.started) < 200  # the inputs not yet sent were dropped


def test_concurrency_below_one_is_refused() -> None:
    with pytest.raises(InvalidError, match="at least 1"):
        run([{"i": 0}], concurrency=0)


@pytest.mark.parametrize(
    ("header", "seconds"),
    [(None, 1.0), ("2", 2.0), ("0", 0.1), ("3600", 30.0), ("soon", 1.0), ("nan", 1.0)],
)
def test_retry_after_is_kept_within_bounds(header: str | None, seconds: float) -> None:
    assert retry_after_seconds(header) == seconds


def test_jsonl_inputs_are_checked_line_by_line() -> None:
    text = '{"a": 1}\n\n{"a": 2}\n'
    assert read_inputs(io.StringIO(text), "in.jsonl") == [{"a": 1}, {"a": 2}]
    bad = '{"a": 1}\n[1, 2]\n{nope\n'
    with pytest.raises(InvalidError) as caught:
        read_inputs(io.StringIO(bad), "in.jsonl")
    message = str(caught.value)
    assert "line 2: a JSON list, not an object" in message
    assert "line 3: not JSON" in message
    assert "Nothing was sent" in message


def test_result_lines_carry_the_index_and_the_result_or_error() -> None:
    assert result_line(4, {"y": 1}) == {"index": 4, "result": {"y": 1}}
    error = UserCodeError(500, "ValueError", "bad x")
    assert result_line(2, error) == {
        "index": 2,
        "error": {"status": 500, "type": "ValueError", "message": "bad x"},
    }


def test_a_file_result_is_written_as_base64_in_its_own_field() -> None:
    line = result_line(1, b"\x00\xffpng")
    assert line == {"index": 1, "file": {"base64": "AP9wbmc=", "size": 5}}
    assert json.loads(json.dumps(line)) == line  # it is JSON, as every line must be


def test_a_streams_error_event_keeps_the_status_the_call_would_have_had() -> None:
    from ember.calling.client import error_from_response
    from ember.calling.mapping import streamed_items
    from ember.errors import CallTimeoutError
    from ember.wire.sse import encode_event

    def stream(error: dict) -> str:
        return (encode_event('{"n": 0}') + encode_event(json.dumps(error), "error")).decode()

    late = {"error": {"type": "deadline_exceeded", "message": "too slow", "status": 504}}
    with pytest.raises(CallTimeoutError, match="too slow"):
        streamed_items(stream(late), error_from_response)
    refused = {"error": {"type": "invalid_input", "message": "no", "status": 400}}
    with pytest.raises(RemoteError) as caught:
        streamed_items(stream(refused), error_from_response)
    assert caught.value.status == 400 and not isinstance(caught.value, UserCodeError)
    # An older server's event, or a status that is not one, is a failure of the code.
    for status in (None, "504", 200, 99999):
        unsaid = {"error": {"type": "ValueError", "message": "bad", "status": status}}
        with pytest.raises(UserCodeError):
            streamed_items(stream(unsaid), error_from_response)
    assert streamed_items(encode_event('{"n": 1}').decode(), error_from_response) == [{"n": 1}]
