"""A replica's output, line by line, says which call printed it: `ember logs APP --call
ID` shows one call's lines among calls running at once, sync or async."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from harness import Platform, wait_for

import ember

APP = "talkative"
OUTPUT = ("stdout", "stderr")


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> dict[str, str]:
    return platform.deploy(apps_dir / "talkative.py", APP)


def _call_lines(platform: Platform, call_id: str) -> list[dict]:
    out = platform.ember("logs", APP, "--call", call_id, "--json", "-n", "100").stdout
    return [json.loads(line) for line in out.splitlines()]


@pytest.mark.parametrize(("endpoint", "printed"), [("chatter", 6), ("murmur", 3)])
def test_each_calls_lines_are_its_own_while_others_print_beside_it(
    platform: Platform, deployed: dict[str, str], endpoint: str, printed: int
) -> None:
    words = ["alpha", "bravo", "charlie", "delta"]

    def call(word: str) -> str:
        with platform.client() as client:
            answer = client.post(f"/{APP}--{endpoint}/", json={"word": word})
        assert answer.json() == {"word": word}
        return answer.headers["X-Ember-Call-Id"]

    with ThreadPoolExecutor(max_workers=4) as pool:
        call_ids = list(pool.map(call, words))

    def complete(call_id: str) -> list[dict] | None:
        found = _call_lines(platform, call_id)
        output = [e for e in found if e["stream"] in OUTPUT]
        logged = any(e["stream"] == "request" for e in found)
        return found if len(output) == printed and logged else None

    for word, call_id in zip(words, call_ids, strict=True):
        lines = wait_for(lambda c=call_id: complete(c), 15)
        output = [e for e in lines if e["stream"] in OUTPUT]
        assert all(e["call"] == call_id for e in output)
        # Whole lines, none cut into by another call's.
        assert all(e["text"].startswith(f"{word} ") for e in output), output
        assert [e["request_id"] for e in lines if e["stream"] == "request"] == [call_id]
    everything = platform.ember("logs", APP, "-n", "500").stdout
    assert "\x1f" not in everything  # the marks are the worker's to strip


@pytest.mark.parametrize("endpoint", ["whoami", "whoami-async"])
def test_code_knows_the_id_of_the_call_it_runs_for(
    platform: Platform, deployed: dict[str, str], endpoint: str
) -> None:
    with platform.client() as client:
        answer = client.post(f"/{APP}--{endpoint}/", json={})
    assert answer.json() == {"call": answer.headers["X-Ember-Call-Id"]}
    handle = ember.Endpoint.lookup(APP, endpoint, config=platform.config()).spawn()
    assert handle.get(timeout=30) == {"call": handle.call_id}


def test_lines_of_a_thread_the_code_started_are_the_calls_it_runs_for(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with platform.client() as client:
        answer = client.post(f"/{APP}--delegate/", json={"word": "echo"})
    assert answer.json() == {"word": "echo"}
    call_id = answer.headers["X-Ember-Call-Id"]

    def printed() -> list[dict] | None:
        found = [e for e in _call_lines(platform, call_id) if e["stream"] in OUTPUT]
        return found or None

    (line,) = wait_for(printed, 15)
    assert line["text"] == "echo from a helper thread"
