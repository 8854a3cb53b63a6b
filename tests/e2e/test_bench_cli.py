"""`ember bench` against a deterministic stream: the timings it reports match the known ones.
A web app's routes are loaded like endpoints; bad inputs are refused before any request."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from harness import EMBER, Platform, wait_for
from machine_needs import need

APP = "benchmarked"
FIRST_DELAY = 0.2  # the ticker sleeps this long before its first event...
GAP = 0.05  # ...and this long between events
EVENTS = 5
WEB_APP = "benchweb"

# A web app shaped like an OpenAI-compatible server: its route streams server-sent events
# when asked, ending with OpenAI's [DONE]; /made answers 201; GET / only.
WEB_APP_SOURCE = textwrap.dedent(
    """
    import asyncio
    import json

    import ember


    def build():
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
        from starlette.routing import Route

        async def completions(request):
            body = await request.json()
            count = int(body.get("max_tokens", 3))
            if not body.get("stream"):
                return JSONResponse({"choices": [{"text": "x" * count}]})

            async def events():
                for n in range(count):
                    await asyncio.sleep(0.02)
                    yield "data: " + json.dumps({"choices": [{"text": str(n)}]}) + "\\n\\n"
                yield "data: [DONE]\\n\\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        async def made(request):
            return JSONResponse(await request.json(), status_code=201)

        async def home(request):
            return PlainTextResponse("hello")

        return Starlette(
            routes=[
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/made", made, methods=["POST"]),
                Route("/", home),
            ]
        )


    @ember.endpoint(concurrency=4)
    @ember.asgi_app()
    def api():
        return build()
    """
)


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> Platform:
    urls = platform.deploy(apps_dir / "ticker.py", APP)
    assert f"{APP}--ticks" in urls
    return platform


@pytest.fixture(scope="module")
def web_app(deployed: Platform, tmp_path_factory: pytest.TempPathFactory) -> Platform:
    source = tmp_path_factory.mktemp("benchweb") / "benchweb.py"
    source.write_text(WEB_APP_SOURCE)
    assert f"{WEB_APP}--api" in deployed.deploy(source, WEB_APP)
    return deployed


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


# --- web apps ----------------------------------------------------------------------------


def test_a_web_apps_route_is_loaded_and_its_events_timed(web_app: Platform) -> None:
    report = bench_json(
        web_app,
        f"{WEB_APP}/api/v1/completions",
        "--concurrency=2",
        "--num-requests=3",
        "--max-tokens=4",
        '--args={"stream": true}',
    )
    assert report["requests"] == {"finished": 3, "ok": 3, "failed": 0, "interrupted": 0}
    assert report["streamed"] is True
    assert report["output_tokens"] == 3 * 4  # [DONE] ends the stream; it is no token
    assert report["latency_s"]["itl"]["count"] == 3 * 3
    assert report["settings"]["url"].endswith(f"/{WEB_APP}--api/v1/completions")


def test_a_web_apps_url_with_a_path_is_a_target(web_app: Platform) -> None:
    url = f"{web_app.url.rstrip('/')}/{WEB_APP}--api/made"
    result = web_app.ember(
        "bench", url, "--workload=batch", "--concurrency=1", "--num-requests=2", "--json"
    )
    report = json.loads(result.stdout)
    assert report["requests"]["ok"] == 2  # 201 is a success
    assert report["streamed"] is False
    assert "__call__" not in result.stderr


@pytest.mark.parametrize(("path", "status"), [("", "405"), ("/nowhere", "404")])
def test_a_web_app_path_that_takes_no_post_stops_at_once(
    web_app: Platform, path: str, status: str
) -> None:
    result = web_app.ember(
        "bench", f"{WEB_APP}/api{path}", "--num-requests=20", "--rate=50", check=False
    )
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip().splitlines()[-1]
    # The hint names the route as a label with its path, which `ember bench` takes.
    assert status in message and f"{WEB_APP}--api/v1/chat/completions" in message
    assert "__call__" not in result.stderr


# --- inputs refused before the run -------------------------------------------------------


def refused(platform: Platform, *args: str) -> str:
    """The one line `ember bench` ends with when it refuses its arguments (exit status 2)."""
    result = platform.ember("bench", f"{APP}/ticks", "--num-requests=2", *args, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "exception" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    return line


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_arguments_json_cannot_carry_is_refused(deployed: Platform, value: str) -> None:
    assert value in refused(deployed, f'--args={{"x": {value}}}')


def test_a_prompts_file_with_nan_is_refused(deployed: Platform, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": NaN}\n')
    assert "line 2" in refused(deployed, f"--prompts={prompts}")


def test_a_prompts_file_that_is_not_utf8_is_refused(deployed: Platform, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "caf\xe9"}\n')
    assert "not UTF-8" in refused(deployed, f"--prompts={prompts}")


def test_a_plot_path_that_cannot_be_written_is_refused(deployed: Platform, tmp_path: Path) -> None:
    plot = tmp_path / "no such folder" / "p.png"
    assert f"cannot write {plot}" in refused(deployed, f"--plot={plot}")


def test_a_plot_of_streams_without_events(deployed: Platform, tmp_path: Path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        need("packages", "matplotlib is not installed: run `bash infra/install.sh --test`")
    plot = tmp_path / "latency.png"
    deployed.ember(
        "bench",
        f"{APP}/ticks",
        "--workload=batch",
        "--concurrency=2",
        "--num-requests=2",
        '--args={"max_tokens": 0, "first_delay": 0}',
        f"--plot={plot}",
    )
    assert plot.read_bytes().startswith(b"\x89PNG")


# --- requests that fit the method ----------------------------------------------------------


def test_the_chat_workload_sends_messages_to_a_chat_method(deployed: Platform) -> None:
    report = bench_json(
        deployed, f"{APP}/chat/v1/chat/completions", "--num-requests=3", "--max-tokens=4"
    )
    assert report["requests"] == {"finished": 3, "ok": 3, "failed": 0, "interrupted": 0}
    assert report["output_tokens"] == 3 * 4  # a valid `messages` list, max_tokens applied


def test_a_method_that_takes_no_prompt_is_refused_before_any_request(deployed: Platform) -> None:
    def calls() -> int:
        listed = deployed.ember("calls", "ls", f"{APP}--token-batches", "-n=1000", "--json")
        return len(json.loads(listed.stdout))

    before = calls()
    result = deployed.ember("bench", f"{APP}/token-batches", "--num-requests=2", check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert "takes count, per_event" in line
    assert "the synthetic load sends prompt, which it does not take" in line
    assert """--body '{"count": 3}'""" in line  # a body to start from: the first default
    assert calls() == before  # nothing was sent


def test_a_body_is_sent_with_every_request(deployed: Platform, tmp_path: Path) -> None:
    report = bench_json(deployed, f"{APP}/token-batches", "--num-requests=2", '--body={"count": 2}')
    assert report["requests"]["ok"] == 2
    assert report["output_tokens"] == 2 * 2 * 4
    body = tmp_path / "body.json"
    body.write_text('{"count": 1, "per_event": 5}')
    report = bench_json(deployed, f"{APP}/token-batches", "--num-requests=2", f"--body-file={body}")
    assert report["output_tokens"] == 2 * 5


def test_a_body_the_method_cannot_take_is_refused(deployed: Platform) -> None:
    line = refused(deployed, '--body={"prompt": "hi", "temperature": 0}')
    assert "--body's request sends temperature, which it does not take" in line


def test_max_tokens_applies_to_the_prompts_file(deployed: Platform, tmp_path: Path) -> None:
    prompts = tmp_path / "long.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50},
        {"messages": [{"role": "user", "content": "yo"}], "max_completion_tokens": 60},
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = bench_json(
        deployed,
        f"{APP}/chat/v1/chat/completions",
        "--num-requests=4",
        f"--prompts={prompts}",
        "--max-tokens=3",
    )
    assert report["requests"]["ok"] == 4
    assert report["output_tokens"] == 4 * 3
    assert report["settings"]["max_tokens"] == 3


def test_max_tokens_for_a_method_without_one_is_refused(deployed: Platform) -> None:
    result = deployed.ember(
        "bench", f"{APP}/token-batches", "--body={}", "--max-tokens=3", check=False
    )
    assert result.returncode == 2
    assert "--max-tokens" in result.stderr and "has no max_tokens" in result.stderr


def test_failed_requests_exit_1_after_the_report(deployed: Platform) -> None:
    args = ("bench", f"{APP}/ticks", "--workload=batch", "--num-requests=3", "--concurrency=3")
    bad = '--args={"first_delay": -1}'  # time.sleep refuses it: every request fails (500)
    result = deployed.ember(*args, bad, check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "0 ok, 3 failed" in result.stdout  # the report is printed all the same
    assert "3 of 3 requests failed" in result.stderr
    assert "sleep length must be non-negative" in result.stderr
    assert deployed.ember(*args, bad, "--allow-failures", check=False).returncode == 0


def _ticks_answered(platform: Platform) -> float:
    """The ticker's calls answered 200, as the platform's /metrics counts them."""
    with platform.client() as client:
        text = client.get("/metrics").text
    prefix = f'ember:requests_total{{app="{APP}",endpoint="ticks",'
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix) and 'status="200"' in line
    )


def test_ctrl_c_prints_the_report_of_what_finished_and_exits_130(deployed: Platform) -> None:
    answered = _ticks_answered(deployed)
    bench = subprocess.Popen(
        [
            *EMBER,
            "bench",
            f"{APP}/ticks",
            "--workload=batch",
            "--concurrency=2",
            "--num-requests=1000",
            '--args={"max_tokens": 2, "first_delay": 0.1, "gap": 0.05}',
        ],
        env=deployed.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The CLI starts, checks the endpoint, and some requests finish: four answered at
        # two at a time means the CLI had the first two's answers when it sent the last.
        wait_for(lambda: _ticks_answered(deployed) >= answered + 4, 60, interval=0.2)
        bench.send_signal(signal.SIGINT)
        stdout, stderr = bench.communicate(timeout=30)
    finally:
        bench.kill()
    assert bench.returncode == 130, stdout + stderr
    assert "stopping" in stderr
    counts = next(line for line in stdout.splitlines() if " ok, " in line)
    assert int(counts.split()[1]) > 0  # what finished is reported: "requests  N ok, ..."
    assert "E2E" in stdout


# --- bench/noisy_neighbour.py --------------------------------------------------------------

NOISY_PHASES = ["baseline", "large results", "log flood", "queue flood", "connection burst"]


def test_the_noisy_neighbour_bench_runs_to_its_verdicts() -> None:
    """Its quick mode with 2 s phases (about 30 s, a server of its own) measures every
    phase and judges every reach; whether the platform is within reach is the bench's to
    report."""
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "bench/noisy_neighbour.py", "--quick", "--seconds", "2"]
    command += ["--json", "--quiet"]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["complete"] is True
    phases = {row["phase"]: row for row in report["phases"]}
    assert list(phases) == NOISY_PHASES
    for row in phases.values():
        assert row["victim"]["calls"] >= 2 * 20, row  # 2 s at 20 calls/s, at least
        assert row["peak_memory_bytes"] > 0
    assert sum(phases["large results"]["noisy"]["calls"].values()) == 8 * 1
    assert phases["log flood"]["noisy"]["printed"] > 0
    assert sum(phases["queue flood"]["noisy"]["spawned"].values()) == 8 * 100
    assert sum(phases["connection burst"]["noisy"]["calls"].values()) == 300
    assert all(value is not None for value in report["reach"].values()), report["reach"]
    # Its clients were held to a CPU quota (as root here, with the cpu controller).
    assert report["attackers"] == {"cpus": 1.0, "not_confined": None}, report["attackers"]
