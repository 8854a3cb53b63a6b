"""Autoscaling on queue depth, scale to zero, retries after a lost replica, draining."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx
import psutil
import pytest
from harness import Platform, wait_for

import ember

APP = "scaling"


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> dict[str, str]:
    return platform.deploy(apps_dir / "scaling.py", APP)


def _replica_count(platform: Platform, label: str) -> int:
    return sum(platform.endpoint_status(label)["replicas"].values())


def test_fifty_concurrent_calls_scale_out_within_max(
    platform: Platform, deployed: dict[str, str]
) -> None:
    label = f"{APP}--work"
    work = ember.Endpoint.lookup(APP, "work", config=platform.config())
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(_replica_count(platform, label))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(max_workers=50) as pool:
            results = list(pool.map(lambda i: work.call(i=i), range(50)))
    finally:
        stop.set()
        watcher.join()
    assert [r["i"] for r in results] == list(range(50))
    pids = {r["pid"] for r in results}
    assert 1 < len(pids) <= 3
    assert max(seen) > 1
    assert max(seen) <= 3
    # No replica ran more than `concurrency` inputs at once, and some ran two.
    assert max(r["at_once"] for r in results) == 2


def test_a_burst_past_the_target_runs_at_once_while_more_replicas_start(
    platform: Platform, deployed: dict[str, str]
) -> None:
    label = f"{APP}--bursty"
    bursty = ember.Endpoint.lookup(APP, "bursty", config=platform.config())
    bursty.call(seconds=0)  # one replica ready; three inputs come while it is alone
    # Spawned, the three are queued within milliseconds, long before a second replica
    # could be ready.
    handles = [bursty.spawn(seconds=1.5) for _ in range(3)]
    results = [handle.get(timeout=60) for handle in handles]
    # The ready replica took all three at once (concurrency=4) rather than queueing two
    # behind cold starts, and the autoscaler still sized for one input each.
    assert max(r["at_once"] for r in results) == 3
    assert len({r["pid"] for r in results}) == 1
    assert wait_for(lambda: _replica_count(platform, label) == 3, 30)


def test_a_call_that_waits_past_queue_timeout_is_shed_and_a_full_queue_turns_callers_away(
    platform: Platform, deployed: dict[str, str]
) -> None:
    label = f"{APP}--shedding"
    shedding = ember.Endpoint.lookup(APP, "shedding", config=platform.config())
    # Its one replica is ready. Spawned, so its start (a restore, or a cold boot on a
    # loaded machine) may take longer than queue_timeout.
    shedding.spawn().get(timeout=60)
    with ThreadPoolExecutor(max_workers=1) as pool:
        busy = pool.submit(shedding.call, seconds=4.0)
        wait_for(lambda: platform.endpoint_status(label)["running"] == 1, 30)
        with pytest.raises(ember.RemoteError) as shed:
            shedding.call()
        # Shed while the replica was still busy, not served after it.
        assert not busy.done()
        assert shed.value.status == 504 and shed.value.error_type == "queue_timeout"
        assert "within queue_timeout=0.5 s" in str(shed.value)
        # Spawned calls wait as long as it takes, up to max_queue=2 of them.
        spawned = [shedding.spawn() for _ in range(2)]
        with platform.client() as client:
            full = client.post(f"/{label}/", json={}, headers={"Prefer": "respond-async"})
        assert full.status_code == 429 and full.json()["error"]["type"] == "queue_full"
        assert busy.result(30)["pid"] == spawned[0].get(timeout=30)["pid"]
        spawned[1].get(timeout=30)


ROLLING = """
import time

import ember


@ember.endpoint(min_replicas=1, scaledown_window=60)
class Versioned:
    @ember.enter()
    def warm_up(self) -> None:
        # Each new version's start takes a while, as a model's does (the first's need not).
        time.sleep(3 if VERSION > 1 else 0)

    @ember.method
    def which(self) -> int:
        return VERSION


VERSION = 1
"""


def test_a_redeploy_keeps_answering_from_the_old_version_until_the_new_one_is_ready(
    platform: Platform, tmp_path: Path
) -> None:
    app_file = tmp_path / "rolling" / "app.py"
    app_file.parent.mkdir()
    app_file.write_text(ROLLING)
    platform.deploy(app_file, "rolling")
    versioned = ember.Endpoint.lookup("rolling", "versioned", config=platform.config())
    assert versioned.which.call() == 1
    app_file.write_text(ROLLING.replace("VERSION = 1", "VERSION = 2"))
    platform.deploy(app_file, "rolling")
    # Version 2's replica spends its first 3 s warming up: the call does not wait for it.
    assert versioned.which.call() == 1
    wait_for(lambda: versioned.which.call() == 2, 60, interval=0.2)
    label = "rolling--versioned"
    wait_for(lambda: platform.endpoint_status(label)["replicas"] == {"ready": 1}, 30)
    # A version whose replicas cannot start leaves the one before it serving.
    broken = ROLLING.replace("VERSION = 1", "VERSION = 3").replace(
        "time.sleep(3 if VERSION > 1 else 0)", "raise RuntimeError('version 3 is broken')"
    )
    app_file.write_text(broken)
    failed = platform.ember("deploy", str(app_file), "--name", "rolling", "--wait", check=False)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "version 3 of rolling--versioned fails to start: RuntimeError: version 3 is broken" in (
        failed.stderr
    )
    assert versioned.which.call() == 2
    # --wait returns once the new version serves alone: calls get it from then on.
    app_file.write_text(ROLLING.replace("VERSION = 1", "VERSION = 4"))
    fixed = platform.ember("deploy", str(app_file), "--name", "rolling", "--wait")
    assert "version 4 serves" in fixed.stdout
    assert versioned.which.call() == 4
    assert platform.endpoint_status(label)["rollout"] == {"ready": 1, "starting": 0, "previous": 0}
    platform.ember("stop", "rolling")


def test_high_priority_calls_are_taken_before_normal_and_low_ones(
    platform: Platform, deployed: dict[str, str]
) -> None:
    label = f"{APP}--ordered"
    ordered = ember.Endpoint.lookup(APP, "ordered", config=platform.config())
    ordered.call()  # its one replica is ready
    # Busy long enough for the three below to be queued behind it on a loaded machine.
    busy = ordered.spawn(seconds=4.0)
    wait_for(lambda: platform.endpoint_status(label)["running"] == 1, 30)
    queued = {p: ordered.spawn(_priority=p) for p in ("low", "normal", "high")}
    turns = {p: handle.get(timeout=60) for p, handle in queued.items()}
    first = busy.get(timeout=60)
    assert turns["high"] == first + 1 and turns["normal"] == first + 2
    assert turns["low"] == first + 3
    with platform.client() as client:
        bad = client.post(f"/{label}/", json={}, headers={"X-Ember-Priority": "urgent"})
    assert bad.status_code == 400 and "not one of high, normal, low" in bad.text
    with pytest.raises(ember.InvalidError, match="not one of high, normal, low"):
        ordered.call(_priority="urgent")


STICKY = """
import os

import ember

_seen: set[str] = set()  # what this replica keeps between calls (a chat's KV cache)


@ember.endpoint(min_replicas=2, max_replicas=2, concurrency=2, scaledown_window=120)
def sticky(session: str, seconds: float = 0.0) -> dict:
    import time

    time.sleep(seconds)
    seen = session in _seen
    _seen.add(session)
    pid = int(os.environ.get("EMBER_REPLICA_PID") or os.readlink("/proc/self"))  # the node's
    return {"pid": pid, "seen": seen}
"""


def test_calls_with_the_same_affinity_key_reach_the_same_replica(
    platform: Platform, tmp_path: Path
) -> None:
    app_file = tmp_path / "affine" / "app.py"
    app_file.parent.mkdir()
    app_file.write_text(STICKY)
    platform.deploy(app_file, "affine")
    label = "affine--sticky"
    sticky = ember.Endpoint.lookup("affine", "sticky", config=platform.config())
    wait_for(lambda: platform.endpoint_status(label)["replicas"] == {"ready": 2}, 60)
    # A load that needs both replicas: keys spread over both from then on. (Calls
    # without keys, one at a time, would all go to the same replica.)
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda n: sticky.call(session=f"warm-{n}", seconds=1.0), range(4)))
    keys = [f"chat-{n}" for n in range(16)]
    first = {key: sticky.call(session=key, _affinity=key) for key in keys}
    again = {key: sticky.call(session=key, _affinity=key) for key in keys}
    assert all(not answer["seen"] for answer in first.values())
    assert all(answer["seen"] for answer in again.values()), again  # its state was there
    assert all(again[key]["pid"] == first[key]["pid"] for key in keys)
    assert len({answer["pid"] for answer in first.values()}) == 2  # spread over both
    with platform.client() as client:
        text = client.get("/metrics").text
        bad = client.post(f"/{label}/", json={"session": "x"}, headers={"X-Ember-Affinity": ""})
    assert bad.status_code == 400 and "1 to 256 bytes" in bad.text
    home = 'ember:affinity_inputs_total{app="affine",endpoint="sticky",placement="home"} 32.0'
    assert home in text.splitlines()
    called = platform.ember("call", label, '{"session": "chat-0"}', "--affinity", "chat-0")
    assert json.loads(called.stdout) == {"pid": first["chat-0"]["pid"], "seen": True}
    logged = platform.ember("logs", "affine", "--json", "-n", "200").stdout
    assert any(json.loads(line).get("affinity") == "chat-5" for line in logged.splitlines())
    platform.ember("stop", "affine")


CHATTY = """
import json
import os
import time

import ember


@ember.endpoint(
    min_replicas=2,
    max_replicas=2,
    concurrency=4,
    target_concurrency=1,
    scaledown_window=120,
    route_by="prefix",
)
class Chat:
    @ember.enter()
    def start(self) -> None:
        self.seen: set[str] = set()  # the conversations this replica served (its cache)

    @ember.method(path="v1/chat/completions")
    def chat_completions(self, **body) -> dict:
        messages = body["messages"]
        cached = json.dumps(messages[:-2]) in self.seen  # the turn before this one
        self.seen.add(json.dumps(messages))
        pid = int(os.environ.get("EMBER_REPLICA_PID") or os.readlink("/proc/self"))
        return {"pid": pid, "cached": cached}

    @ember.method
    def hold(self, seconds: float) -> None:
        time.sleep(seconds)
"""


def test_a_conversation_goes_back_to_the_replica_that_served_its_last_turn(
    platform: Platform, tmp_path: Path
) -> None:
    """route_by="prefix", no key: agent B's first turn goes to the second replica (the
    first is busy), and its next turn goes back there once both are idle, where plain
    routing packs it onto the first one, whose cache lacks it."""
    app_file = tmp_path / "chatty" / "app.py"
    app_file.parent.mkdir()
    app_file.write_text(CHATTY)
    platform.deploy(app_file, "chatty")
    label = "chatty--chat"
    wait_for(lambda: platform.endpoint_status(label)["replicas"] == {"ready": 2}, 60)
    chats = {name: [{"role": "system", "content": f"You are agent {name}. " * 20}] for name in "AB"}

    def turn(client: httpx.Client, name: str, headers: dict[str, str] | None = None) -> dict:
        chats[name].append({"role": "user", "content": f"step {len(chats[name])} for {name}"})
        answer = client.post(
            f"/{label}/v1/chat/completions", json={"messages": chats[name]}, headers=headers
        )
        assert answer.status_code == 200, answer.text
        chats[name].append({"role": "assistant", "content": "done"})
        return dict(answer.json())

    with platform.client() as client:
        a1 = turn(client, "A")
        with ThreadPoolExecutor(max_workers=1) as pool:
            held = pool.submit(client.post, f"/{label}/hold", json={"seconds": 2.0})
            wait_for(lambda: platform.endpoint_status(label).get("running") == 1, 10)
            b1 = turn(client, "B")  # the first replica runs the hold: the other one
            assert held.result().status_code == 200
        b2, a2 = turn(client, "B"), turn(client, "A")  # both replicas idle again
        keyed = turn(client, "A", {"X-Ember-Affinity": "a-key"})  # a key wins: not counted
        text = client.get("/metrics").text
    assert keyed["pid"] in (a1["pid"], b1["pid"])
    assert b1["pid"] != a1["pid"]
    assert (b2["pid"], a2["pid"]) == (b1["pid"], a1["pid"])
    assert [a1["cached"], b1["cached"], b2["cached"], a2["cached"]] == [False, False, True, True]
    routed = 'ember:prefix_routed_total{app="chatty",endpoint="chat",placement="%s"} %s'
    assert routed % ("cached", "2.0") in text.splitlines(), text
    assert routed % ("new", "2.0") in text.splitlines(), text
    platform.ember("stop", "chatty")


def test_a_multiplexed_endpoint_loads_each_tenants_model_once_and_keeps_two(
    platform: Platform, deployed: dict[str, str]
) -> None:
    predict = ember.Endpoint.lookup(APP, "tenants", config=platform.config()).predict
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = list(pool.map(lambda x: predict.call(x=x, _affinity="acme"), range(4)))
    assert [a["y"] for a in answers] == [0, 4, 8, 12]
    assert answers[-1]["key"] == "acme" and answers[-1]["tenant"] == "acme"
    assert answers[-1]["loads"] == ["acme"]  # four calls at once, one load
    predict.call(x=1, _affinity="globex")
    predict.call(x=1, _affinity="acme")
    third = predict.call(x=1, _affinity="initech")  # globex is the least recently used
    assert third["loads"] == ["acme", "globex", "initech"]
    assert predict.call(x=1, _affinity="acme")["loads"] == ["acme", "globex", "initech"]
    assert predict.call(x=1, _affinity="globex")["loads"][-1] == "globex"  # loaded again
    with pytest.raises(ember.RemoteError, match="needs a model id") as caught:
        predict.call(x=1)
    assert caught.value.status == 400
    logs = platform.ember("logs", f"{APP}/tenants", "-n", "200").stdout
    assert "Tenants.model: loaded model 'initech' in" in logs
    assert "unloaded model 'globex', the least recently used" in logs


def test_ember_scale_changes_replicas_without_a_deploy_until_reset(
    platform: Platform, deployed: dict[str, str]
) -> None:
    label = f"{APP}--work"
    scaled = platform.ember("scale", label, "--min", "2").stdout
    assert "min_replicas      2  (deployed: 0)" in scaled
    wait_for(lambda: platform.endpoint_status(label)["replicas"] == {"ready": 2}, 60)
    listed = platform.ember("ls").stdout
    assert "0..3" not in listed.split(label)[1].splitlines()[0]
    assert "2..3*" in listed and "scaled: min_replicas=2 (until the next deploy)" in listed
    refused = platform.ember("scale", f"{APP}/work", "--min", "5", check=False)
    assert refused.returncode != 0
    assert "max_replicas=3 is below min_replicas=5" in refused.stderr
    missing = platform.ember("scale", f"{APP}--nothing", "--min", "1", check=False)
    assert missing.returncode != 0 and "no endpoint named" in missing.stderr
    with platform.client() as client:
        path = f"/v1/endpoints/{label}/scaling"
        bad = client.patch(path, content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_json"
        bad = client.patch(path, json={"timeout": 5})
        assert bad.status_code == 400 and "cannot be changed without a deploy" in bad.text
        assert client.get(path).json()["override"] == {"min_replicas": 2}
    invoke_token = platform.ember("token", "create").stdout.strip()
    with platform.client(token=invoke_token) as client:  # changing scale is for admins
        assert client.patch(path, json={"min_replicas": 0}).status_code == 403
        assert client.delete(f"/v1/apps/{APP}/canary").status_code == 403
    reset = platform.ember("scale", label, "--reset").stdout
    assert "min_replicas      0" in reset and "deployed" not in reset
    wait_for(lambda: _replica_count(platform, label) == 0, 30)  # its window is 1 s
    # The same from Python (Modal's update_autoscaler), for code that warms up a launch.
    work = ember.Endpoint.lookup(APP, "work", config=platform.config())
    settings = work.update_autoscaler(max_replicas=2, scaledown_window=5)
    assert settings["max_replicas"] == 2 and settings["scaledown_window"] == 5
    with pytest.raises(ember.RemoteError, match="max_replicas=2 is below min_replicas=4"):
        work.update_autoscaler(min_replicas=4)
    with pytest.raises(ember.InvalidError, match="needs at least one of"):
        work.update_autoscaler()
    with platform.client() as client:
        assert client.get(path).json()["override"] == {"max_replicas": 2, "scaledown_window": 5}
    assert work.reset_autoscaler()["max_replicas"] == 3
    invoked = ember.Endpoint.lookup(
        APP, "work", config=replace(platform.config(), token=invoke_token)
    )
    with pytest.raises(ember.AuthError):
        invoked.update_autoscaler(min_replicas=1)


def test_scale_to_zero_and_back(
    platform: Platform, deployed: dict[str, str], replica_writable: Path
) -> None:
    label = f"{APP}--work"
    work = ember.Endpoint.lookup(APP, "work", config=platform.config())
    note = replica_writable / "exit-note"
    first = work.call(i=1, exit_note=str(note))["pid"]
    # scaledown_window is 1 s: the replica drains and stops. It is counted until its
    # process is gone (its atexit handler makes it slow to go), so the node's share it
    # held is not handed out while it still runs; atexit handlers run as in any program.
    wait_for(lambda: _replica_count(platform, label) == 0, 20)
    assert not psutil.pid_exists(first)
    assert note.read_text() == f"{first} ran its atexit handlers"
    # Back from zero: a new replica served it. (Counting replicas now would race its
    # 1 s window on a slow machine.)
    second = work.call(i=2)["pid"]
    assert second != first


def test_a_buffer_replica_waits_ready_beside_the_busy_one(
    platform: Platform, deployed: dict[str, str]
) -> None:
    label = f"{APP}--buffered"
    buffered = ember.Endpoint.lookup(APP, "buffered", config=platform.config())
    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(buffered.call, seconds=3.0)
        # One replica for the input, one more ready for the next.
        wait_for(lambda: platform.endpoint_status(label)["replicas"].get("ready") == 2, 30)
        second = buffered.call()  # served at once, by the buffer
        assert second["pid"] != first.result(timeout=30)["pid"]
    # With no work left the buffer is not kept: both go after their window.
    wait_for(lambda: _replica_count(platform, label) == 0, 30)


def test_sigkilled_replica_input_is_retried(
    platform: Platform, deployed: dict[str, str], replica_writable: Path
) -> None:
    victim = ember.Endpoint.lookup(APP, "victim", config=platform.config())
    pid_file = replica_writable / "pid"
    result: dict = {}

    def call() -> None:
        result.update(victim.call(pid_file=str(pid_file), seconds=1.5))

    caller = threading.Thread(target=call)
    caller.start()
    first_pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), 30))
    os.kill(first_pid, signal.SIGKILL)
    caller.join(60)
    assert result["pid"] != first_pid
    logs = platform.ember("logs", f"{APP}/victim").stdout
    assert "requeued" in logs


def test_max_inputs_gives_every_two_calls_a_fresh_process(
    platform: Platform, deployed: dict[str, str]
) -> None:
    fresh = ember.Endpoint.lookup(APP, "fresh", config=platform.config())
    pids = [fresh.call()["pid"] for _ in range(4)]
    assert pids[0] == pids[1] and pids[2] == pids[3]
    assert pids[0] != pids[2]
    # The retired replica stopped once its two were done; it is not kept idle.
    wait_for(lambda: not psutil.pid_exists(pids[0]), timeout=30)
    logs = platform.ember("logs", f"{APP}/fresh", "-n", "200").stdout
    assert "took its max_inputs=2" in logs
    listed = platform.ember("ls", APP).stdout
    assert "max_inputs=2" in next(line for line in listed.splitlines() if "--fresh" in line)
    endpoint_rows = [line for line in listed.splitlines() if "--" in line and "https://" in line]
    assert endpoint_rows and all(row.startswith(f"{APP}--") for row in endpoint_rows)
    missing = platform.ember("ls", "no-such-app", check=False)
    assert missing.returncode == 1 and "no endpoints of an app named no-such-app" in missing.stderr


def test_stop_drains_inputs_in_flight(platform: Platform, deployed: dict[str, str]) -> None:
    slow = ember.Endpoint.lookup(APP, "slow", config=platform.config())
    slow.call(seconds=0.01)  # a replica is up
    with ThreadPoolExecutor(max_workers=1) as pool:
        # Long enough that the stop (a CLI process) comes while it runs, even when slow.
        pending = pool.submit(slow.call, seconds=4.0)
        wait_for(lambda: platform.endpoint_status(f"{APP}--slow")["running"] == 1, 10)
        platform.ember("stop", APP)
        assert not pending.done()
        assert pending.result(timeout=30) == {"slept": 4.0}
    with platform.client() as client:
        assert client.post(f"/{APP}--slow/", json={}).status_code == 404


def test_killed_worker_is_restarted_and_the_input_retried(
    platform: Platform, apps_dir: Path, replica_writable: Path
) -> None:
    platform.deploy(apps_dir / "scaling.py", "again")
    victim = ember.Endpoint.lookup("again", "victim", config=platform.config())
    pid_file = replica_writable / "pid"
    result: dict = {}
    caller = threading.Thread(
        target=lambda: result.update(victim.call(pid_file=str(pid_file), seconds=1.5))
    )
    caller.start()
    replica_pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), 30))
    worker = next(p for p in psutil.Process(replica_pid).parents() if "--lifeline" in p.cmdline())
    worker.kill()
    caller.join(90)
    assert result and result["pid"] != replica_pid
    assert not psutil.pid_exists(replica_pid) or psutil.Process(replica_pid).status() == "zombie"
    assert len(platform.status()["workers"]) == 1
