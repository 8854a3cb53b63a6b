"""OpenAI's Batch API on an endpoint that serves OpenAI routes, driven by OpenAI's own
Python client (`client.files.create`, `client.batches.create`, polling,
`client.files.content`): its shapes, statuses and counts, the per-line errors, the
limits, cancelling, online calls served before a batch's, the token's workspace, and a
batch that outlives a killed control plane."""

from __future__ import annotations

import json
import signal
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from harness import Platform, free_port, running_platform, wait_for

from ember.calling.tlsclient import client_context

APP = "batchapp"
LABEL = f"{APP}--chat"
SOURCE = textwrap.dedent(
    """
    import time
    from typing import Any

    import ember


    @ember.endpoint(concurrency=1, max_replicas=1)
    class Chat:
        @ember.method(path="v1/chat/completions", stream_flag="stream")
        def chat(self, **request: Any) -> dict:
            if request.get("fail"):
                raise ember.InputError(
                    "asked to fail", status=400, error_type="invalid_request_error",
                    param="fail", code="asked",
                )
            time.sleep(float(request.get("delay", 0)))
            text = request["messages"][-1]["content"]
            return {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "model": request.get("model", "echo"),
                "system_fingerprint": ember.current_priority(),
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": text.upper()},
                    "finish_reason": "stop",
                }],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }

        @ember.method
        def hello(self) -> str:
            return "hi"
    """
)


def request_line(custom_id: str, content: str, **extra: Any) -> str:
    body = {"model": "echo", "messages": [{"role": "user", "content": content}], **extra}
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    )


@contextmanager
def openai_client(platform: Platform, token: str | None = None) -> Iterator[openai.OpenAI]:
    http = httpx.Client(verify=client_context(platform.ca), timeout=60)
    with http:
        yield openai.OpenAI(
            base_url=f"{platform.url}/{LABEL}/v1",
            api_key=token or platform.token,
            http_client=http,
            max_retries=0,
        )


def upload(client: openai.OpenAI, lines: list[str]) -> str:
    made = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    assert made.object == "file" and made.purpose == "batch" and made.status == "processed"
    return made.id


def start(client: openai.OpenAI, lines: list[str]) -> Any:
    file_id = upload(client, lines)
    return client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def ended(client: openai.OpenAI, batch_id: str, timeout: float = 60) -> Any:
    def done() -> Any:
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in ("completed", "failed", "cancelled", "expired") else None

    return wait_for(done, timeout, interval=0.2)


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def write_app(folder: Path) -> Path:
    source = folder / "batchapp.py"
    source.write_text(SOURCE)
    return source


@pytest.fixture(scope="module")
def deployed(platform: Platform, tmp_path_factory: pytest.TempPathFactory) -> Platform:
    assert LABEL in platform.deploy(write_app(tmp_path_factory.mktemp("batch")), APP)
    return platform


def test_a_batch_runs_to_its_output_and_error_files(deployed: Platform) -> None:
    lines = [request_line(f"req-{n}", f"hello {n}") for n in range(5)]
    lines.insert(2, '{"custom_id": "broken", "method": "POST", "url": ')  # not JSON
    lines.append(request_line("refused", "no", fail=True))
    lines.append(request_line("elsewhere", "x").replace("/v1/chat/completions", "/v1/embeddings"))
    with openai_client(deployed) as client:
        batch = start(client, lines)
        assert batch.object == "batch" and batch.status == "in_progress", batch
        assert batch.endpoint == "/v1/chat/completions" and batch.completion_window == "24h"
        assert batch.expires_at == batch.created_at + 86400
        batch = ended(client, batch.id)
        assert batch.status == "completed", batch
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (8, 5, 3), counts
        assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
        output = lines_of(client, batch.output_file_id)
        assert sorted(line["custom_id"] for line in output) == [f"req-{n}" for n in range(5)]
        for line in output:
            number = line["custom_id"].removeprefix("req-")
            assert line["response"]["status_code"] == 200 and line["error"] is None
            answer = line["response"]["body"]["choices"][0]["message"]["content"]
            assert answer == f"HELLO {number}"
            assert line["response"]["body"]["system_fingerprint"] == "low"  # a batch's
            assert line["id"].startswith("batch_req_")
        errors = {line["custom_id"]: line for line in lines_of(client, batch.error_file_id)}
        assert set(errors) == {None, "refused", "elsewhere"}, errors
        assert errors[None]["error"]["code"] == "invalid_json_line"
        assert errors[None]["response"] is None
        refused = errors["refused"]["response"]
        assert refused["status_code"] == 400 and refused["body"]["error"]["code"] == "asked"
        assert errors["elsewhere"]["error"]["code"] == "invalid_url"
        # The endpoint's files and batches are listed; the output file is a file of its.
        assert batch.id in [b.id for b in client.batches.list()]
        listed = {f.id: f.purpose for f in client.files.list()}
        assert listed[batch.input_file_id] == "batch"
        assert listed[batch.output_file_id] == "batch_output"
        deleted = client.files.delete(batch.input_file_id)
        assert deleted.deleted is True
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(batch.input_file_id)


def test_bad_batches_are_refused_as_openai_refuses_them(deployed: Platform) -> None:
    with openai_client(deployed) as client:
        # A custom_id used twice fails the batch before any request runs.
        twice = start(client, [request_line("same", "a"), request_line("same", "b")])
        assert twice.status == "failed", twice
        assert twice.errors is not None and twice.errors.data is not None
        error = twice.errors.data[0]
        assert (error.code, error.line, error.param) == ("duplicate_custom_id", 2, "custom_id")
        # More requests than a batch takes (the server's limit: 50,000): a 400.
        many = [request_line(f"r{n}", "x") for n in range(50_001)]
        too_many = upload(client, many)
        with pytest.raises(openai.BadRequestError, match="at most 50000"):
            client.batches.create(
                input_file_id=too_many,
                endpoint="/v1/chat/completions",
                completion_window="24h",
            )
        file_id = upload(client, [request_line("one", "x")])
        with pytest.raises(openai.BadRequestError, match="completion_window"):
            client.batches.create(
                input_file_id=file_id,
                endpoint="/v1/chat/completions",
                completion_window="1h",  # type: ignore[arg-type]
            )
        with pytest.raises(openai.NotFoundError):
            client.batches.create(
                input_file_id="file-nothere",
                endpoint="/v1/chat/completions",
                completion_window="24h",
            )
        with pytest.raises(openai.BadRequestError, match="purpose"):
            client.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
        with pytest.raises(openai.NotFoundError):
            client.batches.retrieve("batch_nothere")


def test_a_cancel_stops_what_waits_and_keeps_what_finished(deployed: Platform) -> None:
    lines = [request_line(f"slow-{n}", f"s{n}", delay=0.4) for n in range(20)]
    with openai_client(deployed) as client:
        batch = start(client, lines)
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, 60)
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled"), cancelling
        batch = ended(client, batch.id)
        assert batch.status == "cancelled" and batch.cancelled_at, batch
        finished = batch.request_counts.completed
        assert 2 <= finished < 20 and batch.request_counts.failed == 0, batch
        output = lines_of(client, batch.output_file_id)
        assert len(output) == finished
        assert all(line["response"]["status_code"] == 200 for line in output)
        assert batch.error_file_id is None  # what never ran is in neither file


def test_online_calls_go_before_a_batchs_requests(deployed: Platform) -> None:
    lines = [request_line(f"bg-{n}", f"b{n}", delay=0.5) for n in range(12)]
    with openai_client(deployed) as client, deployed.client() as http:
        batch = start(client, lines)
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, 60)
        for _ in range(3):  # each waits for the batch request running now, not the rest
            online = http.post(f"/{LABEL}/v1/chat/completions", json=json.loads(lines[0])["body"])
            assert online.status_code == 200
            assert online.json()["system_fingerprint"] == "normal"
        assert client.batches.retrieve(batch.id).request_counts.completed <= 6
        assert ended(client, batch.id).request_counts.completed == 12


def test_a_batch_is_its_endpoints_and_its_workspaces(deployed: Platform) -> None:
    other = deployed.ember("token", "create", "--scope", "invoke", "--app", "elsewhere")
    with openai_client(deployed) as client:
        file_id = upload(client, [request_line("mine", "x")])
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    with openai_client(deployed, other.stdout.strip()) as stranger:
        for attempt in (
            lambda: stranger.files.retrieve(file_id),
            lambda: stranger.files.content(file_id),
            lambda: stranger.batches.retrieve(batch.id),
            lambda: stranger.batches.cancel(batch.id),
        ):
            with pytest.raises(openai.PermissionDeniedError):
                attempt()
    with httpx.Client(verify=client_context(deployed.ca)) as anonymous:
        answer = anonymous.get(f"{deployed.url}/{LABEL}/v1/files/{file_id}/content")
        assert answer.status_code == 401


def test_a_batch_outlives_a_killed_control_plane(tmp_path: Path) -> None:
    root = tmp_path / "platform"
    port = free_port()
    lines = [request_line(f"d-{n}", f"d{n}", delay=0.4) for n in range(10)]
    with running_platform(root, port=port) as platform:
        platform.deploy(write_app(tmp_path), APP)
        with openai_client(platform) as client:
            batch = start(client, lines)
            wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, 60)
        platform.stop(signal.SIGKILL)  # mid-batch: a request runs, others wait their turn
    with running_platform(root, port=port) as platform, openai_client(platform) as client:
        done = ended(client, batch.id, timeout=120)
        assert done.status == "completed", done
        counts = done.request_counts
        assert (counts.total, counts.completed, counts.failed) == (10, 10, 0), counts
        output = lines_of(client, done.output_file_id)
        assert sorted(line["custom_id"] for line in output) == sorted(f"d-{n}" for n in range(10))


def test_malformed_batch_api_requests_get_openais_errors(deployed: Platform) -> None:
    with deployed.client() as http:
        answer = http.get(f"/{LABEL}/v1/batches/batch_0000/cancel")
        assert answer.status_code == 405 and answer.json()["error"]["code"] == "not_allowed"
        answer = http.post(f"/{LABEL}/v1/batches", content=b"{not json")
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_json"
        answer = http.post(
            f"/{LABEL}/v1/files", content=b"plain", headers={"content-type": "text/plain"}
        )
        assert answer.status_code == 400 and "multipart/form-data" in answer.text


def test_usage_says_tokens_and_their_cost_online_and_batch_apart(tmp_path: Path) -> None:
    price = "cpu=3.6/h,memory-gib=0.36/h"  # 0.001 a CPU-second, 0.0001 a GiB-second
    with running_platform(tmp_path / "platform", extra=("--price", price)) as platform:
        platform.deploy(write_app(tmp_path), APP)
        with openai_client(platform) as client:
            for n in range(3):  # online: each answer says 1 token in, 1 out
                client.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": f"hi {n}"}]
                )
            batch = start(client, [request_line(f"u{n}", "x") for n in range(4)])
            assert ended(client, batch.id).status == "completed"

        def counted() -> Any:
            used = json.loads(platform.ember("usage", "--json").stdout)
            row = next(r for r in used["endpoints"] if r["endpoint"] == "chat")
            return (used, row) if len(row["tokens"]) == 2 else None

        used, row = wait_for(counted, 10)
        assert used["prices"]["cpu_per_hour"] == pytest.approx(3.6)
        assert row["tokens"] == {
            "batch": {"input": 4, "output": 4, "requests": 4},
            "online": {"input": 3, "output": 3, "requests": 3},
        }
        assert row["cost"] > 0
        online, batched = row["by_traffic"]["online"], row["by_traffic"]["batch"]
        assert online["cost"] + batched["cost"] == pytest.approx(row["cost"], abs=1e-5)
        assert batched["cost"] == pytest.approx(row["cost"] * 4 / 7, abs=1e-5)  # by output
        per_million = batched["cost_per_million_output_tokens"]
        assert per_million == pytest.approx(batched["cost"] / 4 * 1e6, rel=1e-3)
        assert batched["million_tokens_per_unit"] == pytest.approx(
            8 / 1e6 / batched["cost"], rel=1e-3
        )
        # `ember bench` says what its run cost at the server's prices.
        benched = platform.ember(
            "bench",
            f"{LABEL}/v1/chat/completions",
            "--workload=batch",
            "--concurrency=1",
            "--num-requests=3",
            "--max-tokens=2",
            "--allow-failures",
        ).stdout
        assert "per million output tokens" in benched, benched
        shown = platform.ember("usage").stdout
        assert "COST/M OUT" in shown and "online" in shown and "batch" in shown, shown
        with platform.client() as http:
            metrics = http.get("/metrics").text
        series = f'app="{APP}",endpoint="chat",kind="output",traffic="batch"'
        assert f"ember:llm_tokens_total{{{series}}} 4.0" in metrics
        cost = [
            line for line in metrics.splitlines() if line.startswith("ember:replica_cost_total{")
        ]
        assert cost and float(cost[0].rsplit(" ", 1)[1]) > 0, cost
