"""ember.Dict and ember.Queue: state shared by an app's replicas and its clients, kept by
the control plane; reached over HTTPS with tokens that may call the app."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from pathlib import Path

import pytest
from harness import Platform

import ember

APP = "stateful"


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> dict[str, str]:
    return platform.deploy(apps_dir / "stateful.py", APP)


def test_a_dict_holds_json_values_by_key_with_expiry(
    platform: Platform, deployed: dict[str, str]
) -> None:
    config = platform.config()
    notes = ember.Dict("notes", app=APP, config=config)
    notes.clear()
    notes["a/b c?"] = {"x": [1, 2.5, None, "é"]}  # any key text reaches the platform intact
    # 5 s: the four requests below, slow on a loaded machine, still find it there.
    put_at = time.monotonic()
    notes.put("short", "lived", ttl=5.0)
    assert notes["a/b c?"] == {"x": [1, 2.5, None, "é"]}
    assert "short" in notes and len(notes) == 2 and notes.keys() == ["a/b c?", "short"]
    time.sleep(max(0.0, put_at + 5.2 - time.monotonic()))
    assert "short" not in notes and notes.get("short", "gone") == "gone"
    assert notes.pop("a/b c?") == {"x": [1, 2.5, None, "é"]}
    with pytest.raises(KeyError):
        notes["a/b c?"]
    with pytest.raises(ember.RemoteError, match="payload_too_large") as caught:
        notes["big"] = "x" * (1024 * 1024 + 1)
    assert caught.value.status == 413
    with pytest.raises(ember.InvalidError, match="values are JSON"):
        notes["nan"] = float("nan")  # refused before it is sent
    with pytest.raises(ember.InvalidError, match="values are JSON"):
        ember.Queue("jobs", app=APP, config=config).put({1, 2})
    with pytest.raises(ember.InvalidError, match="keys are strings"):
        notes[7] = 1  # type: ignore[index]
    with pytest.raises(ember.InvalidError, match="needs app="):
        ember.Dict("notes").get("k")  # outside a replica


def test_keys_that_look_like_paths_or_hold_line_breaks_are_keys_or_refused(
    platform: Platform, deployed: dict[str, str]
) -> None:
    config = platform.config()
    kept = ember.Dict("kept", app=APP, config=config)
    kept.clear()
    kept["safe"] = 1
    # "." and ".." are keys like any other: an HTTP client drops such a path segment, which
    # made removing ".." clear the whole dict.
    for key in (".", "..", "a/../b", "./x"):
        assert kept.pop(key, None) is None and kept.get(key, "none") == "none"
        kept[key] = key
        assert kept[key] == key
    assert kept.pop("..") == ".." and kept["safe"] == 1 and len(kept) == 4
    for bad in ("abc\n", "a\nb", "tab\there", "\ud800", "k" * 513):
        with pytest.raises(ember.InvalidError):
            kept[bad] = 1
        assert bad not in kept
    with platform.client() as client:
        # The route's pattern would have taken "safe\n" for "safe".
        answer = client.put(f"/v1/apps/{APP}/dicts/kept/items/safe%0A", json={"value": 2})
        assert answer.status_code == 400 and "control characters" in answer.text
        deep = client.put(
            f"/v1/apps/{APP}/dicts/kept/items/deep", content=b'{"value": ' + b"[" * 100_000
        )
        assert deep.status_code == 400, deep.text
    assert kept["safe"] == 1
    with pytest.raises(ember.InvalidError, match="nested too deep"):
        nested: list = []
        for _ in range(5000):
            nested = [nested]
        kept["deep"] = nested


def test_every_key_is_listed_however_many_there_are(
    platform: Platform, deployed: dict[str, str]
) -> None:
    many = ember.Dict("many", app=APP, config=platform.config())
    many.clear()
    jobs = ember.Queue("many-jobs", app=APP, config=platform.config())
    jobs.put_many([])  # nothing to do
    with pytest.raises(ember.InvalidError, match="get_many takes 1 to 1000"):
        jobs.get_many(0)
    with pytest.raises(ember.InvalidError, match="8 MiB"):
        jobs.put_many(["x" * (1024 * 1024 - 10)] * 9)
    with platform.client() as client:  # 1,200 keys, in a few requests
        for start in range(0, 1200, 100):
            for n in range(start, start + 100):
                client.put(f"/v1/apps/{APP}/dicts/many/items/k{n:05d}", json={"value": n})
    assert len(many) == 1200
    keys = list(many)
    assert keys == [f"k{n:05d}" for n in range(1200)]
    assert many.keys(limit=3) == keys[:3] and many.keys() == keys
    listed = platform.ember("dict", f"{APP}/many").stdout.split()
    assert listed == keys


def test_replicas_and_clients_share_a_dict(platform: Platform, deployed: dict[str, str]) -> None:
    config = platform.config()
    ember.Dict("counts", app=APP, config=config).clear()
    tally = ember.Endpoint.lookup(APP, "tally", config=config)
    assert [tally.call(word="ember") for _ in range(3)] == [1, 2, 3]
    assert ember.Dict("counts", app=APP, config=config)["ember"] == 3
    # `ember logs --grep` keeps the lines that hold the text, in any case.
    found = platform.ember("logs", f"{APP}/tally", "--grep", "__CALL__ 200", "-n", "10").stdout
    assert found.count("__call__ 200 in") == 3, found


def test_a_queue_hands_each_value_to_one_taker_in_order(
    platform: Platform, deployed: dict[str, str]
) -> None:
    config = platform.config()
    jobs = ember.Queue("jobs", app=APP, config=config)
    jobs.clear()
    jobs.put_many([{"n": 1}, {"n": 2}, {"n": 3}])
    assert len(jobs) == 3
    worker = ember.Endpoint.lookup(APP, "worker", config=config)
    assert worker.call(most=2) == [{"n": 1}, {"n": 2}]  # taken in a replica
    assert jobs.get() == {"n": 3} and len(jobs) == 0
    began = time.monotonic()
    with pytest.raises(queue.Empty):
        jobs.get(timeout=0.5)
    assert 0.4 < time.monotonic() - began < 15  # a loaded machine's margin
    # A waiting get is woken by a put, long before its timeout.
    threading.Timer(0.5, lambda: jobs.put("late")).start()
    began = time.monotonic()
    assert jobs.get(timeout=60) == "late"
    assert time.monotonic() - began < 30  # woken, not timed out (a loaded machine's margin)
    with pytest.raises(queue.Empty):
        jobs.get(block=False)


def test_only_tokens_that_may_call_the_app_reach_its_state(
    platform: Platform, deployed: dict[str, str]
) -> None:
    other = platform.ember("token", "create", "--app", "someone-else").stdout.strip()
    mine = platform.ember("token", "create", "--app", APP).stdout.strip()
    metrics = platform.ember("token", "create", "--scope", "metrics").stdout.strip()
    path = f"/v1/apps/{APP}/dicts/notes/items/k"
    with platform.client(token=mine) as client:
        assert client.put(path, json={"value": 1}).status_code == 200
        assert client.get(path).json() == {"value": 1}
        assert client.put(path, content=b"{oops").status_code == 400
        nan = client.put(path, content=b'{"value": NaN}')
        assert nan.status_code == 400 and "not valid JSON" in nan.text
        assert client.put(path, json={"ttl": 5}).status_code == 400  # no value
        bad = client.post(f"/v1/apps/{APP}/queues/jobs/get", json={"max": 0})
        assert bad.status_code == 400 and "max is 1 to 1000" in bad.text
        assert client.get(f"/v1/apps/{APP}/dicts/Not_A_Name").status_code == 400
    with platform.client(token=other) as client:
        assert client.get(path).status_code == 404
    with platform.client(token=metrics) as client:
        assert client.get(path).status_code == 403
    with platform.client(token="") as client:
        assert client.get(path, headers={"Authorization": ""}).status_code == 401


def test_the_cli_reads_and_changes_dicts_and_queues(
    platform: Platform, deployed: dict[str, str]
) -> None:
    platform.ember("dict", f"{APP}/cli", "--clear")
    platform.ember("dict", f"{APP}/cli", "greeting", '{"text": "hi"}')
    platform.ember("dict", f"{APP}/cli", "soon", '"gone"', "--ttl", "60")
    assert platform.ember("dict", f"{APP}/cli").stdout.split() == ["greeting", "soon"]
    assert platform.ember("dict", f"{APP}/cli", "greeting").stdout.strip() == '{"text": "hi"}'
    missing = platform.ember("dict", f"{APP}/cli", "nope", check=False)
    assert missing.returncode != 0 and "has no key 'nope'" in missing.stderr
    bad = platform.ember("dict", f"{APP}/cli", "k", "not json", check=False)
    assert bad.returncode != 0 and "is not JSON" in bad.stderr
    platform.ember("queue", f"{APP}/cli-jobs", "--clear")
    platform.ember("queue", f"{APP}/cli-jobs", "--put", "[1, 2]")
    assert platform.ember("queue", f"{APP}/cli-jobs").stdout.strip() == "1"
    assert platform.ember("queue", f"{APP}/cli-jobs", "--get").stdout.strip() == "[1, 2]"
    empty = platform.ember("queue", f"{APP}/cli-jobs", "--get", "--timeout", "0", check=False)
    assert empty.returncode != 0 and "is empty" in empty.stderr
    # Flags that would be ignored, or do more than asked, are refused.
    for args, said in (
        (("nope", "--delete"), "has no key 'nope'"),
        (("--delete",), "--delete removes one KEY"),
        (("greeting", "1", "--clear"), "--clear removes every key"),
        (("greeting", "--ttl", "5"), "--ttl is for setting"),
    ):
        refused = platform.ember("dict", f"{APP}/cli", *args, check=False)
        assert refused.returncode != 0 and said in refused.stderr, refused.stderr
    assert platform.ember("dict", f"{APP}/cli").stdout.split() == ["greeting", "soon"]


def test_async_code_has_twins_and_a_wrong_app_is_an_error_not_a_missing_key(
    platform: Platform, deployed: dict[str, str]
) -> None:
    config = platform.config()

    async def main() -> None:
        notes = ember.Dict("async-notes", app=APP, config=config)
        await notes.aput("k", [1, 2])
        assert await notes.aget("k") == [1, 2]
        assert await notes.apop("k") == [1, 2]
        assert await notes.aget("k", "none") == "none"
        jobs = ember.Queue("async-jobs", app=APP, config=config)
        await jobs.aput_many(["a", "b"])
        assert await jobs.aget_many(5) == ["a", "b"]
        with pytest.raises(queue.Empty):
            await jobs.aget(timeout=0.2)

    asyncio.run(main())
    other = platform.ember("token", "create", "--app", "someone-else").stdout.strip()
    elsewhere = ember.config.ClientConfig(platform.url, other, platform.ca)
    with pytest.raises(ember.NotFoundError, match="no app named stateful"):
        ember.Dict("notes", app=APP, config=elsewhere).get("k")
