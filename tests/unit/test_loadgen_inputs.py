"""`ember bench` inputs a request cannot carry are refused up front; a request that fails
anyway is counted with its error; the plot's data leaves out what a request lacks."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from ember.errors import InvalidError
from ember.loadgen.plot import latency_series
from ember.loadgen.prompts import load_prompt_file, parse_arguments, parse_prompt_lines
from ember.loadgen.records import RequestRecord
from ember.loadgen.runner import LoadPlan, LoadResult, run_load

NOT_JSON_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e400"]


@pytest.mark.parametrize("value", NOT_JSON_NUMBERS)
def test_arguments_that_json_cannot_carry_are_refused(value: str) -> None:
    with pytest.raises(InvalidError, match=f"--args must be JSON: {value}"):
        parse_arguments(f'{{"x": {value}}}', "--args")


def test_arguments_are_an_object_of_plain_json() -> None:
    assert parse_arguments('{"x": 1.5, "n": null}', "--args") == {"x": 1.5, "n": None}
    with pytest.raises(InvalidError, match="JSON object"):
        parse_arguments("[1]", "--args")


@pytest.mark.parametrize("value", NOT_JSON_NUMBERS)
def test_prompt_lines_that_json_cannot_carry_are_named(value: str) -> None:
    lines = ['{"prompt": "fine"}', f'{{"prompt": "x", "temperature": {value}}}']
    with pytest.raises(InvalidError, match=f"p.jsonl, line 2: not valid JSON .*{value}"):
        parse_prompt_lines(lines, "p.jsonl")


def test_a_prompts_file_that_is_not_utf8_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "café"}\n'.encode("latin-1"))
    with pytest.raises(InvalidError, match=r"is not UTF-8 text \(byte 0xe9 at offset 15\)"):
        load_prompt_file(path)


def test_a_prompts_file_is_read_as_utf8(tmp_path: Path) -> None:
    path = tmp_path / "utf8.jsonl"
    path.write_bytes('{"prompt": "café ✓"}\n'.encode())
    assert load_prompt_file(path) == [{"prompt": "café ✓"}]


def run_against_nothing(arguments: dict[str, Any], requests: int) -> tuple[LoadResult, list[str]]:
    """Run a load whose requests fail before they are sent; also return what asyncio logged
    about task exceptions."""
    logged: list[str] = []

    async def go() -> LoadResult:
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: logged.append(str(context.get("message")))
        )
        async with httpx.AsyncClient() as client:
            plan = LoadPlan(None, 2, num_requests=requests, duration=None)
            # Port 9 (discard): nothing is reached, since the body fails to encode first.
            url = "http://127.0.0.1:9/a--b/"
            return await run_load(client, url, iter(lambda: arguments, None), plan, asyncio.Event())

    return asyncio.run(go()), logged


def test_a_request_that_fails_to_be_sent_is_counted_with_its_error() -> None:
    result, logged = run_against_nothing({"x": float("nan")}, requests=3)
    assert len(result.records) == 3
    for record in result.records:
        assert not record.ok and record.finished_at is not None
        assert record.error is not None and "Out of range float" in record.error
    assert len(result.first_errors) == 3
    assert logged == []  # no "Task exception was never retrieved"


def record(index: int, sent: float, events: list[float], finished: float) -> RequestRecord:
    return RequestRecord(
        index, sent, event_times=events, output_tokens=len(events), finished_at=finished, status=200
    )


def test_plot_data_leaves_out_a_stream_without_events_from_ttft_only() -> None:
    records = [
        record(1, 10.5, [], 11.0),  # a stream that sent no event: no TTFT
        record(0, 10.0, [10.1, 10.2], 10.3),
        RequestRecord(2, 10.7, status=500, error="boom", finished_at=10.8),  # failed
    ]
    ttft, e2e = latency_series(records, origin=10.0)
    assert ttft.name == "ttft"
    assert ttft.sent == pytest.approx([0.0])
    assert ttft.millis == pytest.approx([100.0])
    assert e2e.name == "e2e"
    assert e2e.sent == pytest.approx([0.0, 0.5])
    assert e2e.millis == pytest.approx([300.0, 500.0])


def test_a_web_apps_201_is_a_success() -> None:
    assert RequestRecord(0, 0.0, finished_at=1.0, status=201).ok
    assert not RequestRecord(0, 0.0, finished_at=1.0, status=302).ok
