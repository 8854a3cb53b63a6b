"""The pure parts of `ember bench`: statistics, SLOs, arrivals, prompts and timings."""

from __future__ import annotations

import asyncio
import json
import statistics
from itertools import islice
from pathlib import Path

import httpx
import pytest

from ember.config import ClientConfig
from ember.errors import InvalidError
from ember.loadgen.arrivals import poisson_gaps
from ember.loadgen.prompts import argument_stream, load_prompt_file, parse_prompt_lines
from ember.loadgen.records import RequestRecord, tokens_in_event
from ember.loadgen.report import build_report, format_report, goodput
from ember.loadgen.runner import FatalLoadError, LoadPlan, run_load
from ember.loadgen.slo import Slos, parse_duration, parse_slos
from ember.loadgen.stats import percentile, summarize
from ember.loadgen.target import parse_target
from ember.wire.sse import encode_event

# --- percentiles -------------------------------------------------------------------------


def test_percentile_interpolates_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 95) == 7.0


def test_percentile_rejects_nothing_and_out_of_range() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize() -> None:
    assert summarize([]) is None
    summary = summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    assert summary is not None
    assert (summary.count, summary.mean, summary.p50) == (5, 3.0, 3.0)
    assert summary.p95 == pytest.approx(4.8)
    assert summary.p99 == pytest.approx(4.96)


# --- SLOs and goodput --------------------------------------------------------------------


def test_parse_durations() -> None:
    assert parse_duration("500ms") == 0.5
    assert parse_duration("2s") == 2.0
    assert parse_duration(" 0.25 s ") == 0.25
    assert parse_duration(".5ms") == 0.0005


@pytest.mark.parametrize("text", ["500", "2 min", "-1s", "ms", "1e3ms", "fast"])
def test_bad_durations_say_how_to_write_one(text: str) -> None:
    with pytest.raises(InvalidError, match=r"not a duration; write e\.g\. 500ms or 2s"):
        parse_duration(text)


def test_parse_slos() -> None:
    slos = parse_slos("ttft=500ms, itl=50ms,E2E=2s,tpot=0.03s")
    assert slos == Slos(ttft=0.5, itl=0.05, tpot=0.03, e2e=2.0)
    assert slos.to_dict() == {"ttft": 0.5, "itl": 0.05, "tpot": 0.03, "e2e": 2.0}
    assert not Slos()
    assert parse_slos("e2e=1s") == Slos(e2e=1.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("latency=1s", "unknown SLO metric 'latency'; use ttft, itl, tpot, e2e"),
        ("ttft", "'ttft' is not an SLO; write METRIC=DURATION"),
        ("ttft=", "is not an SLO"),
        ("ttft=1s,,e2e=2s", "'' is not an SLO"),
        ("ttft=1s,ttft=2s", "the SLO for ttft is given twice"),
        ("ttft=0ms", "the SLO for ttft must be positive"),
        ("ttft=1", "'1' is not a duration"),
    ],
)
def test_bad_slos_are_explained(text: str, message: str) -> None:
    with pytest.raises(InvalidError, match=message):
        parse_slos(text)


def stream_record(
    index: int, sent: float, events: list[float], tokens: int | None = None
) -> RequestRecord:
    record = RequestRecord(index=index, sent_at=sent, status=200, streamed=True)
    record.event_times = events
    record.output_tokens = len(events) if tokens is None else tokens
    record.finished_at = events[-1] if events else sent
    return record


def test_slos_judge_each_metric() -> None:
    record = stream_record(0, 0.0, [0.3, 0.35, 0.5])  # TTFT 300 ms, longest gap 150 ms
    assert Slos(ttft=0.3, itl=0.16, e2e=0.5).met_by(record)
    assert not Slos(ttft=0.29).met_by(record)
    assert not Slos(itl=0.1).met_by(record)
    assert not Slos(tpot=0.09).met_by(record)  # (0.5 - 0.3) / 2 = 100 ms
    assert not Slos(e2e=0.4).met_by(record)
    failed = RequestRecord(index=1, sent_at=0.0, status=500, error="boom", finished_at=0.1)
    assert not Slos(e2e=10.0).met_by(failed)
    single = stream_record(2, 0.0, [0.1])  # no gaps: an ITL or TPOT bound cannot fail it
    assert Slos(itl=0.001, tpot=0.001).met_by(single)


def test_goodput_counts_requests_that_met_every_slo() -> None:
    records = [
        stream_record(0, 0.0, [0.1, 0.2]),
        stream_record(1, 0.0, [0.9, 1.0]),
        RequestRecord(index=2, sent_at=0.0, status=503, error="no_capacity", finished_at=0.1),
        stream_record(3, 1.0, [1.2, 1.3]),
    ]
    good = goodput(records, parse_slos("ttft=500ms"), duration=2.0)
    assert good.good == 2
    assert good.requests_per_s == 1.0
    assert good.share == 0.5
    assert goodput([], Slos(ttft=1.0), duration=0.0).share == 0.0


# --- arrivals ----------------------------------------------------------------------------


def test_poisson_gaps_are_seeded_with_mean_one_over_rate() -> None:
    gaps = list(islice(poisson_gaps(4.0, seed=7), 20_000))
    assert gaps[:10] == list(islice(poisson_gaps(4.0, seed=7), 10))
    assert gaps[:10] != list(islice(poisson_gaps(4.0, seed=8), 10))
    assert all(gap >= 0 for gap in gaps)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    # Exponential: the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.05)


def test_poisson_rate_must_be_positive() -> None:
    with pytest.raises(ValueError):
        next(poisson_gaps(0.0))


# --- prompts -----------------------------------------------------------------------------


def test_prompt_file_lines_are_objects(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hi", "max_tokens": 8}\n\n{"prompt": "yo"}\n')
    assert load_prompt_file(path) == [{"prompt": "hi", "max_tokens": 8}, {"prompt": "yo"}]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"prompt": "a"}', "{oops"], r"p.jsonl, line 2: not valid JSON"),
        (["", "", '["a list"]'], r"p.jsonl, line 3: expected a JSON object of keyword"),
        (["", "  "], r"p.jsonl holds no requests"),
    ],
)
def test_bad_prompt_lines_are_named(lines: list[str], message: str) -> None:
    with pytest.raises(InvalidError, match=message):
        parse_prompt_lines(lines, "p.jsonl")


def test_a_missing_prompt_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidError, match="cannot read the prompts file"):
        load_prompt_file(tmp_path / "absent.jsonl")


def test_arguments_cycle_the_file_and_extra_overrides() -> None:
    stream = argument_stream(
        prompts=[{"prompt": "a", "max_tokens": 1}, {"prompt": "b"}],
        input_len=5,
        max_tokens=9,
        extra={"max_tokens": 3},
        seed=0,
    )
    assert list(islice(stream, 3)) == [
        {"prompt": "a", "max_tokens": 3},
        {"prompt": "b", "max_tokens": 3},
        {"prompt": "a", "max_tokens": 3},
    ]


def test_extra_arguments_set_to_null_are_dropped() -> None:
    stream = argument_stream(
        prompts=None, input_len=3, max_tokens=9, extra={"prompt": None, "to": 8}, seed=0
    )
    assert next(stream) == {"max_tokens": 9, "to": 8}


def test_synthetic_arguments_are_generic_and_seeded() -> None:
    def first(seed: int) -> dict:
        return next(
            argument_stream(prompts=None, input_len=12, max_tokens=64, extra={"t": 0}, seed=seed)
        )

    arguments = first(1)
    assert set(arguments) == {"prompt", "max_tokens", "t"}
    assert len(arguments["prompt"].split()) == 12
    assert arguments["max_tokens"] == 64
    assert first(1) == arguments
    assert first(2) != arguments


# --- timings from events -----------------------------------------------------------------


def test_timings_from_event_timestamps() -> None:
    record = stream_record(0, 10.0, [10.2, 10.25, 10.35, 10.4])
    assert record.ok
    assert record.ttft == pytest.approx(0.2)
    assert record.itls == pytest.approx([0.05, 0.1, 0.05])
    assert record.tpot == pytest.approx(0.2 / 3)
    assert record.e2e == pytest.approx(0.4)


def test_tpot_divides_by_tokens_not_events() -> None:
    record = stream_record(0, 0.0, [0.1, 0.3], tokens=9)  # events carrying several ids
    assert record.tpot == pytest.approx(0.2 / 8)
    assert stream_record(1, 0.0, [0.1]).tpot is None


def test_tokens_in_an_event() -> None:
    assert tokens_in_event('{"token_ids": [1, 2, 3]}') == 3
    assert tokens_in_event('{"token_id": 5, "text": "a"}') == 1
    assert tokens_in_event('{"text": "hello"}') == 1
    assert tokens_in_event("not json") == 1


def test_report_pools_gaps_and_skips_failures() -> None:
    records = [
        stream_record(0, 0.0, [0.1, 0.2, 0.3]),
        stream_record(1, 0.0, [0.2, 0.4]),
        RequestRecord(index=2, sent_at=0.0, status=500, error="ValueError (500): x", finished_at=1),
    ]
    report = build_report(
        records, duration=2.0, slos=Slos(ttft=0.15), first_errors=["ValueError (500): x"]
    )
    assert report["requests"] == {"finished": 3, "ok": 2, "failed": 1, "interrupted": 0}
    assert report["output_tokens"] == 5
    assert report["output_tokens_per_s"] == 2.5
    assert report["requests_per_s"] == 1.0
    assert report["latency_s"]["itl"]["count"] == 3
    assert report["latency_s"]["ttft"]["mean"] == pytest.approx(0.15)
    assert report["goodput"]["good_requests"] == 1
    json.dumps(report)  # machine-readable as it is
    table = format_report(report)
    assert "2 ok, 1 failed" in table
    assert "ValueError (500): x" in table
    assert "goodput" in table and "ttft<=150.0ms" in table


# --- targets -----------------------------------------------------------------------------

CONFIG = ClientConfig(server_url="https://127.0.0.1:8443", token="t", domain="ember.localhost")


@pytest.mark.parametrize(
    ("text", "url", "label", "method"),
    [
        ("app/chat", "https://127.0.0.1:8443/app--chat/", "app--chat", None),
        ("app/chat/generate", "https://127.0.0.1:8443/app--chat/generate", "app--chat", "generate"),
        (
            "app--chat/generate",
            "https://127.0.0.1:8443/app--chat/generate",
            "app--chat",
            "generate",
        ),
        (
            "https://app--chat.ember.localhost:8443/gen",
            "https://app--chat.ember.localhost:8443/gen",
            "app--chat",
            "gen",
        ),
        ("https://h:1/app--chat/", "https://h:1/app--chat/", "app--chat", None),
        # A method's own path.
        (
            "app/chat/v1/chat/completions",
            "https://127.0.0.1:8443/app--chat/v1/chat/completions",
            "app--chat",
            "v1/chat/completions",
        ),
        (
            "app--chat/v1//completions/",
            "https://127.0.0.1:8443/app--chat/v1/completions",
            "app--chat",
            "v1/completions",
        ),
    ],
)
def test_targets(text: str, url: str, label: str, method: str | None) -> None:
    target = parse_target(text, CONFIG)
    assert (target.url, target.label, target.method) == (url, label, method)


@pytest.mark.parametrize("text", ["app", "App/Chat", "https://h:1/", "/chat"])
def test_bad_targets_are_explained(text: str) -> None:
    with pytest.raises(InvalidError):
        parse_target(text, CONFIG)


# --- the runner, against an in-process fake endpoint -----------------------------------


def fake_endpoint(events: int, status: int = 200) -> httpx.AsyncClient:
    async def handler(request: httpx.Request) -> httpx.Response:
        if status != 200:
            body = {"error": {"type": "not_found", "message": "no endpoint named a--b"}}
            return httpx.Response(status, json=body)
        body = b"".join(encode_event(json.dumps({"n": n})) for n in range(events))
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def run(client: httpx.AsyncClient, plan: LoadPlan) -> object:
    async def go() -> object:
        async with client:
            args = iter(lambda: {"prompt": "x"}, None)
            return await run_load(client, "https://h/a--b/", args, plan, asyncio.Event())

    return asyncio.run(go())


def test_the_runner_sends_every_request_and_counts_events() -> None:
    result = run(fake_endpoint(4), LoadPlan(None, 3, num_requests=7, duration=None))
    assert [r.index for r in result.records] == list(range(7))
    assert all(r.ok and r.streamed and r.output_tokens == 4 for r in result.records)
    assert all(len(r.itls) == 3 for r in result.records)


def test_the_runner_paces_poisson_arrivals() -> None:
    result = run(fake_endpoint(1), LoadPlan(200.0, None, num_requests=20, duration=None, seed=3))
    sent = [r.sent_at for r in result.records]
    assert sent == sorted(sent)
    assert len(result.records) == 20


def test_the_runner_stops_at_once_when_the_endpoint_is_unknown() -> None:
    with pytest.raises(FatalLoadError, match="no endpoint named a--b"):
        run(fake_endpoint(1, status=404), LoadPlan(None, 2, num_requests=50, duration=None))


def test_plans_need_an_amount_and_a_pace() -> None:
    with pytest.raises(ValueError):
        LoadPlan(None, None, num_requests=1, duration=None)
    with pytest.raises(ValueError):
        LoadPlan(1.0, None, num_requests=None, duration=None)
