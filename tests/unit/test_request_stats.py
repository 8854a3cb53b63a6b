"""One request's timings and token ids, as the gateway records them."""

from __future__ import annotations

import json

import pytest

from ember_platform.observability.metrics import PlatformMetrics
from ember_platform.observability.request_stats import RequestStats


def stream_stats(event_times: list[float], events: list[bytes] | None = None) -> RequestStats:
    stats = RequestStats("c-1", "demo", "lm", "generate", streaming=True, arrived=100.0)
    for at, data in zip(event_times, events or [b"{}"] * len(event_times), strict=True):
        stats.note_event(data, now=at)
    return stats


def test_ttft_gaps_and_tpot() -> None:
    stats = stream_stats([100.5, 100.6, 100.8, 101.1])
    assert stats.ttft_seconds == pytest.approx(0.5)
    assert stats.gaps == pytest.approx([0.1, 0.2, 0.3])
    assert stats.tpot_seconds == pytest.approx(0.2)  # (101.1 - 100.5) / 3
    assert stats.events == 4


def test_one_event_has_no_gaps_or_tpot() -> None:
    stats = stream_stats([100.2])
    assert stats.gaps == [] and stats.tpot_seconds is None


def test_token_ids_from_arguments_and_events() -> None:
    stats = stream_stats(
        [100.1, 100.2, 100.3],
        [b'{"token_id": 7, "text": "a"}', b'{"token_ids": [8, 9]}', b'{"text": "no ids"}'],
    )
    stats.note_arguments(json.dumps({"prompt_ids": [1, 2, 3], "max_tokens": 4}).encode())
    assert stats.prompt_ids == [1, 2, 3]
    assert stats.output_ids == [7, 8, 9]


def test_an_endpoint_that_tokenizes_says_its_ids_in_events_or_its_answer() -> None:
    # OpenAI-style chunks: the first names the prompt's ids, each the ids it adds.
    stats = stream_stats(
        [100.1, 100.2],
        [
            b'{"choices": [], "token_ids": [5], "prompt_token_ids": [1, 2]}',
            b'{"choices": [], "token_ids": [6, 7], "prompt_token_ids": [9]}',
        ],
    )
    assert stats.prompt_ids == [1, 2] and stats.output_ids == [5, 6, 7]
    answer = RequestStats("c-2", "demo", "lm", "chat", streaming=False)
    answer.note_result(b'{"token_ids": [3, 4], "prompt_token_ids": [1]}')
    assert answer.prompt_ids == [1] and answer.output_ids == [3, 4]
    plain = RequestStats("c-3", "demo", "lm", "chat", streaming=False)
    plain.note_result(b'{"text": "no ids"}')
    plain.note_result(b"[1, 2]")
    assert plain.prompt_ids is None and plain.output_ids is None


@pytest.mark.parametrize(
    "body",
    [b"not json", b'{"prompt_ids": "1 2 3"}', b'{"prompt_ids": [1, true]}', b"[1, 2]", b"{}"],
)
def test_arguments_without_usable_ids_are_ignored(body: bytes) -> None:
    stats = RequestStats("c-1", "demo", "lm", "generate", streaming=False)
    stats.note_arguments(body)
    assert stats.prompt_ids is None


def test_log_entry_carries_timings_and_ids() -> None:
    stats = stream_stats([100.5, 100.7], [b'{"token_id": 5}', b'{"token_id": 6}'])
    stats.note_arguments(b'{"input_ids": [1, 2]}')
    stats.finish(200, "r-1", queue_seconds=0.01)
    entry = stats.log_entry()
    assert entry["stream"] == "request" and entry["request_id"] == "c-1"
    assert (entry["status"], entry["replica"], entry["events"]) == (200, "r-1", 2)
    assert entry["ttft_s"] == pytest.approx(0.5)
    assert (entry["prompt_ids"], entry["output_ids"]) == ([1, 2], [5, 6])
    assert "generate 200" in entry["text"] and "first event 500.0 ms" in entry["text"]


def test_metrics_count_a_request() -> None:
    metrics = PlatformMetrics()
    stats = stream_stats([100.5, 100.6, 100.8], [b'{"token_id": 1}'] * 3)
    stats.finish(200, "r-1", queue_seconds=0.02)
    metrics.request_finished(stats)
    metrics.set_load([("demo", "lm", 3, 1)])
    text = metrics.exposition().decode()
    labels = 'app="demo",endpoint="lm"'
    assert f'ember:requests_total{{{labels},kind="stream",status="200"}} 1.0' in text
    assert f"ember:inter_token_latency_seconds_count{{{labels}}} 2.0" in text
    assert f"ember:time_to_first_token_seconds_count{{{labels}}} 1.0" in text
    assert f"ember:generation_tokens_total{{{labels}}} 3.0" in text
    assert f"ember:num_requests_waiting{{{labels}}} 3.0" in text
    metrics.set_load([])  # the endpoint is gone: so are its gauges
    assert "ember:num_requests_waiting{" not in metrics.exposition().decode()
