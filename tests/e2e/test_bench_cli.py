"""`ember bench` against a deterministic stream: the timings it reports match the known ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from harness import Platform

APP = "benchmarked"
FIRST_DELAY = 0.2  # the ticker sleeps this long before its first event...
GAP = 0.05  # ...and this long between events
EVENTS = 5


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> Platform:
    urls = platform.deploy(apps_dir / "ticker.py", APP)
    assert f"{APP}--ticks" in urls
    return platform


def bench_json(platform: Platform, target: str, *args: str) -> dict[str, Any]:
    result = platform.ember("bench", target, "--workload", "batch", "--json", *args, timeout=60)
    return json.loads(result.stdout)


def test_bench_reports_the_stream_timings(deployed: Platform) -> None:
    arguments = json.dumps({"first_delay": FIRST_DELAY, "gap": GAP})
    report = bench_json(
        deployed,
        f"{APP}/ticks",
        "--concurrency=2",
        "--num-requests=6",
        f"--max-tokens={EVENTS}",
        f"--args={arguments}",
        "--slo=ttft=30s,itl=10s,e2e=60s",
        "--json-requests",
    )
    assert report["requests"] == {"finished": 6, "ok": 6, "failed": 0, "interrupted": 0}
    assert report["streamed"] is True
    assert report["output_tokens"] == 6 * EVENTS
    assert all(r["output_tokens"] == EVENTS for r in report["records"])
    assert all(len(r["itls"]) == EVENTS - 1 for r in report["records"])
    latency = report["latency_s"]
    for key in ("mean", "p50", "p95", "p99"):
        assert latency["ttft"][key] >= FIRST_DELAY
        assert latency["e2e"][key] >= FIRST_DELAY + (EVENTS - 1) * GAP
    assert latency["itl"]["count"] == 6 * (EVENTS - 1)
    assert 0.04 <= latency["itl"]["p50"] <= 0.2
    assert 0.04 <= latency["tpot"]["p50"] <= 0.2
    assert report["goodput"]["good_requests"] == 6
    assert report["goodput"]["share"] == 1.0
    assert report["requests_per_s"] > 0


def test_a_method_path_with_a_stream_flag_is_asked_to_stream(
    deployed: Platform, tmp_path: Path
) -> None:
    prompts = tmp_path / "chats.jsonl"
    line = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    prompts.write_text(json.dumps(line) + "\n")
    report = bench_json(
        deployed, f"{APP}/chat/v1/chat/completions", "--num-requests=3", f"--prompts={prompts}"
    )
    assert report["requests"]["ok"] == 3
    assert report["streamed"] is True
    assert report["output_tokens"] == 3 * 4  # token ids counted from the stream's events


def test_an_impossible_slo_gives_no_goodput(deployed: Platform) -> None:
    arguments = json.dumps({"max_tokens": 2, "first_delay": FIRST_DELAY, "gap": GAP})
    report = bench_json(
        deployed,
        f"{APP}--ticks",
        "--concurrency=2",
        "--num-requests=2",
        f"--args={arguments}",
        "--slo=ttft=1ms",
    )
    assert report["requests"]["ok"] == 2
    assert report["goodput"]["good_requests"] == 0
    assert report["goodput"]["share"] == 0.0
    assert report["goodput"]["requests_per_s"] == 0.0


def test_token_ids_in_events_are_counted(deployed: Platform) -> None:
    report = bench_json(
        deployed,
        f"{APP}/token-batches",
        "--concurrency=1",
        "--num-requests=2",
        '--args={"prompt": null, "max_tokens": null, "count": 3, "per_event": 4}',
    )
    assert report["output_tokens"] == 2 * 3 * 4
    assert report["latency_s"]["itl"]["count"] == 2 * 2


def test_the_table_names_every_latency(deployed: Platform) -> None:
    result = deployed.ember(
        "bench",
        f"{APP}/ticks",
        "--workload=chat",
        "--rate=50",
        "--num-requests=3",
        '--args={"max_tokens": 2, "first_delay": 0, "gap": 0}',
    )
    for name in ("TTFT", "ITL", "TPOT", "E2E", "requests/s", "output tokens/s", "P99"):
        assert name in result.stdout
    assert "3 ok, 0 failed" in result.stdout


def test_an_unknown_endpoint_exits_2_with_one_line(deployed: Platform) -> None:
    result = deployed.ember("bench", f"{APP}/nope", "--num-requests=1", check=False)
    assert result.returncode == 2
    assert result.stdout == ""
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1
    assert f"{APP}--nope" in message and "not_found" in message


def test_a_wrong_token_exits_2(deployed: Platform) -> None:
    deployed.env["EMBER_TOKEN"] = "not-a-token"
    try:
        result = deployed.ember("bench", f"{APP}/ticks", "--num-requests=1", check=False)
    finally:
        del deployed.env["EMBER_TOKEN"]
    assert result.returncode == 2
    assert "unauthorized" in result.stderr
