"""Worker nodes that join with `ember worker`, a full queue, and revoked tokens."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import Platform, join_worker, running_platform, wait_for

import ember

CHANNEL_SOCKET_PREFIX = "\0ember-channels-"
REPLICA_SOCKET = "replica-channels.sock"  # local_worker.py's, in the state dir


def test_the_local_worker_and_its_sandboxed_replicas_connect_over_unix_sockets(
    tmp_path: Path, apps_dir: Path
) -> None:
    """The control plane's abstract socket belongs to the node's network namespace: a
    sandboxed replica, in a network of its own, opens its channel over the socket file
    the worker mounts into its sandbox (never the abstract one, never TCP and TLS)."""
    with running_platform(tmp_path / "cp") as platform:
        assert platform.status()["workers"][0]["channel"] == "unix socket"
        platform.deploy(apps_dir / "channels.py", "peers")
        peers = ember.Endpoint.lookup("peers", "peers", config=platform.config()).call()
        assert not [p for p in peers if p.startswith(CHANNEL_SOCKET_PREFIX)], peers
        assert [p for p in peers if p.endswith("/" + REPLICA_SOCKET)], peers


def _turned_away(platform: Platform, app: str, endpoint: str) -> float:
    """How many calls a full queue turned away, from /metrics."""
    with platform.client() as client:
        text = client.get("/metrics").text
    series = f'ember:requests_total{{app="{app}",endpoint="{endpoint}",kind='
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(series) and 'status="429"}' in line
    )


def test_joined_worker_serves_and_full_queue_gets_429(tmp_path: Path, apps_dir: Path) -> None:
    with running_platform(tmp_path / "cp", extra=("--no-worker", "--max-queue", "2")) as platform:
        assert platform.status()["workers"] == []
        token = platform.ember("token", "create", "--scope", "worker").stdout.strip()
        worker = join_worker(platform, token, tmp_path / "node-b", "--cpu", "2")
        try:
            wait_for(lambda: platform.status()["workers"], 30)
            assert platform.status()["workers"][0]["name"] == "node-b"
            platform.deploy(apps_dir / "scaling.py", "joined")
            single = ember.Endpoint.lookup("joined", "single", config=platform.config())
            assert single.call(seconds=0.01) == {"slept": 0.01}
            assert "bundles" in {p.name for p in (tmp_path / "node-b").iterdir()}
            # A worker of its own joins over HTTPS, and so do its replicas' channels.
            assert platform.status()["workers"][0]["channel"] == "https"
            platform.deploy(apps_dir / "channels.py", "joinedpeers")
            peers = ember.Endpoint.lookup("joinedpeers", "peers", config=platform.config())
            assert not [p for p in peers.call() if CHANNEL_SOCKET_PREFIX in p]
            # One replica, one input at a time, two may wait: the rest are turned away.
            with platform.client() as client, ThreadPoolExecutor(max_workers=6) as pool:
                responses = list(
                    pool.map(
                        lambda _: client.post("/joined--single/", json={"seconds": 1.0}),
                        range(6),
                    )
                )
            statuses = sorted(r.status_code for r in responses)
            assert statuses.count(200) >= 3 and 429 in statuses
            rejected = next(r for r in responses if r.status_code == 429)
            assert rejected.headers["retry-after"] == "1"
            assert rejected.json()["error"]["type"] == "queue_full"
            # map waits a full queue out: eight inputs at once, one slot, two places.
            turned_away_before = _turned_away(platform, "joined", "single")
            assert turned_away_before >= 1
            results = list(single.map([{"seconds": 0.2}] * 8, concurrency=8))
            assert results == [{"slept": 0.2}] * 8
            assert _turned_away(platform, "joined", "single") > turned_away_before
        finally:
            worker.terminate()
            worker.wait(timeout=30)
        # The worker left: its replicas are gone with it.
        wait_for(lambda: not platform.status()["workers"], 30)


def test_node_labels_keep_replicas_on_the_nodes_that_carry_them(
    tmp_path: Path, apps_dir: Path
) -> None:
    extra = ("--worker-label", "zone=local")
    with running_platform(tmp_path / "cp", extra=extra) as platform:
        token = platform.ember("token", "create", "--scope", "worker").stdout.strip()
        eu = tmp_path / "node-eu"
        worker = join_worker(platform, token, eu, "--label", "zone=eu-west", "--label", "gpu=no")
        try:
            wait_for(lambda: len(platform.status()["workers"]) == 2, 30)
            labels = {w["name"]: w["labels"] for w in platform.status()["workers"]}
            assert labels == {
                "local": {"zone": "local"},
                "node-eu": {"zone": "eu-west", "gpu": "no"},
            }
            platform.deploy(apps_dir / "placed.py", "placed")
            config = platform.config()
            for _ in range(3):
                ember.Endpoint.lookup("placed", "in-eu", config=config).call()
            assert ember.Endpoint.lookup("placed", "anywhere", config=config).call()
            # Where they ran, as the control plane placed them (a sandboxed replica sees
            # its node's folders under the same inside paths on every node).
            rows = json.loads(platform.ember("replica", "ls", "placed", "--json").stdout)
            nodes = {row["label"]: row["node"] for row in rows}
            assert nodes["placed--in-eu"] == "node-eu"
            with platform.client() as client:
                refused = client.post("/placed--on-mars/", json={})
            assert refused.status_code == 503
            message = refused.json()["error"]["message"]
            assert "no worker has the labels zone=mars" in message
            assert "ember worker --label zone=mars" in message
            listed = platform.ember("ls").stdout
            assert "node_labels=zone=eu-west" in listed
            assert "node-eu (" in listed and "gpu=no,zone=eu-west)" in listed
        finally:
            worker.terminate()
            worker.wait(timeout=30)


def test_draining_a_node_lets_its_calls_finish_and_moves_its_replicas(
    tmp_path: Path, apps_dir: Path
) -> None:
    with running_platform(tmp_path / "cp", extra=("--no-worker",)) as platform:
        token = platform.ember("token", "create", "--scope", "worker").stdout.strip()
        workers = [join_worker(platform, token, tmp_path / name) for name in ("node-a", "node-b")]
        try:
            wait_for(lambda: len(platform.status()["workers"]) == 2, 30)
            platform.deploy(apps_dir / "scaling.py", "maint")
            slow = ember.Endpoint.lookup("maint", "slow", config=platform.config())
            assert slow.call(seconds=0.01) == {"slept": 0.01}

            def replicas() -> dict[str, int]:
                return {n["name"]: n["replicas"] for n in platform.status()["workers"]}

            (busy,) = [name for name, count in replicas().items() if count == 1]
            other = "node-b" if busy == "node-a" else "node-a"
            with ThreadPoolExecutor(max_workers=1) as pool:
                running = pool.submit(slow.call, seconds=2.0)
                wait_for(lambda: platform.endpoint_status("maint--slow")["running"] == 1, 10)
                drained = platform.ember("node", "drain", busy, "--wait")
                assert "runs no replica; it may be stopped" in drained.stdout
                assert running.result(timeout=30) == {"slept": 2.0}  # served, not failed
            listed = platform.ember("node", "ls").stdout
            assert any(line.startswith(busy) and "draining" in line for line in listed.splitlines())
            assert slow.call(seconds=0.01) == {"slept": 0.01}
            assert replicas() == {busy: 0, other: 1}
            platform.ember("node", "uncordon", busy)
            assert not any(n["draining"] for n in platform.status()["workers"])
            unknown = platform.ember("node", "drain", "node-z", check=False)
            assert unknown.returncode != 0 and "no worker node named node-z" in unknown.stderr
            again = platform.ember("node", "uncordon", busy, check=False)
            assert again.returncode != 0 and "is not draining" in again.stderr
        finally:
            for worker in workers:
                worker.terminate()
            for worker in workers:
                worker.wait(timeout=30)


def test_a_worker_asked_to_stop_lets_its_calls_finish_and_a_second_signal_is_now(
    tmp_path: Path, apps_dir: Path
) -> None:
    with running_platform(tmp_path / "cp", extra=("--no-worker",)) as platform:
        token = platform.ember("token", "create", "--scope", "worker").stdout.strip()
        node = tmp_path / "node-c"
        worker = join_worker(platform, token, node)
        try:
            wait_for(lambda: platform.status()["workers"], 30)
            platform.deploy(apps_dir / "scaling.py", "leaving")
            slow = ember.Endpoint.lookup("leaving", "slow", config=platform.config())
            with ThreadPoolExecutor(max_workers=1) as pool:
                running = pool.submit(slow.call, seconds=2.0)
                wait_for(lambda: platform.endpoint_status("leaving--slow")["running"] == 1, 30)
                worker.send_signal(signal.SIGTERM)
                wait_for(lambda: platform.status()["workers"][0]["draining"], 10)
                assert running.result(timeout=30) == {"slept": 2.0}  # finished, not lost
            assert worker.wait(timeout=30) == 0
            log = node.with_suffix(".log").read_text()
            assert "leaving: 1 replica(s) finish their inputs first" in log
        finally:
            if worker.poll() is None:
                worker.kill()
        # Again, with a call and a grace far longer than the wait below: only a second
        # signal can stop the node within it.
        worker = join_worker(platform, token, node, "--shutdown-grace", "600")
        try:
            wait_for(lambda: platform.status()["workers"], 30)
            with platform.client() as client, ThreadPoolExecutor(max_workers=1) as pool:
                long = pool.submit(client.post, "/leaving--slow/", json={"seconds": 60})
                wait_for(lambda: platform.endpoint_status("leaving--slow")["running"] == 1, 30)
                worker.send_signal(signal.SIGTERM)
                wait_for(lambda: platform.status()["workers"][0]["draining"], 10)
                worker.send_signal(signal.SIGTERM)
                worker.wait(timeout=30)
                assert long.result(timeout=30).status_code >= 500  # lost with its node
        finally:
            if worker.poll() is None:
                worker.kill()


def test_revoked_tokens_stop_working_at_once_and_their_workers_are_cut_off(
    tmp_path: Path, apps_dir: Path
) -> None:
    with running_platform(tmp_path / "cp", extra=("--no-worker",)) as platform:
        invoke = platform.ember("token", "create", "--name", "ci").stdout.strip()
        node = platform.ember("token", "create", "--scope", "worker", "--name", "node-c")
        worker_token = node.stdout.strip()
        listing = platform.ember("token", "ls").stdout
        assert "(this one)" in listing and "ci" in listing and "node-c" in listing
        assert invoke not in listing and worker_token not in listing
        ids = {
            t["name"]: t["id"] for t in json.loads(platform.ember("token", "ls", "--json").stdout)
        }
        worker = join_worker(platform, worker_token, tmp_path / "node-c")
        try:
            wait_for(lambda: platform.status()["workers"], 30)
            with platform.client(token=invoke) as client:
                assert client.get("/v1/calls/nope").status_code == 404  # accepted, no such call
            out = platform.ember("token", "revoke", ids["ci"]).stdout
            assert out.strip() == f"revoked invoke token {ids['ci']} (ci)"
            with platform.client(token=invoke) as client:
                assert client.get("/v1/calls/nope").status_code == 401
            # The worker that joined with a revoked token is disconnected and stays out:
            # refused when it tries again, it stops, since its token cannot change.
            platform.ember("token", "revoke", ids["node-c"])
            wait_for(lambda: not platform.status()["workers"], 15)
            assert worker.wait(timeout=30) == 1
            assert not platform.status()["workers"]
        finally:
            if worker.poll() is None:
                worker.terminate()
                worker.wait(timeout=30)
        errors = (tmp_path / "node-c.log").read_text()
        assert (
            "the control plane refused this worker's token (HTTP 401): the token is unknown: "
            "wrong, revoked or expired; start the worker with a worker token"
        ) in errors
        assert "ember token create --scope worker" in errors
        # A token that is valid but not a worker's is told so, and the worker stops.
        other = platform.ember("token", "create", "--name", "ci2").stdout.strip()
        wrong = join_worker(platform, other, tmp_path / "node-d")
        try:
            assert wrong.wait(timeout=30) == 1
        finally:
            if wrong.poll() is None:
                wrong.kill()
                wrong.wait(timeout=30)
        errors = (tmp_path / "node-d.log").read_text()
        assert (
            "refused this worker's token (HTTP 403): it is an invoke token, not a worker token"
        ) in errors
        assert not platform.status()["workers"]
        # Mistakes get clear answers.
        unknown = platform.ember("token", "revoke", "0123456789ab", check=False)
        assert unknown.returncode != 0 and "no token 0123456789ab" in unknown.stderr
        bad = platform.ember("token", "revoke", "../apps/x", check=False)
        assert bad.returncode == 2 and "is not a token id" in bad.stderr
        last = platform.ember("token", "revoke", ids["admin"], check=False)
        assert last.returncode != 0 and "last admin token" in last.stderr
        assert platform.status()["endpoints"] == []  # the admin token still works
        with platform.client() as client:
            listed = client.post("/v1/tokens", json=["ci"])
            assert listed.status_code == 400 and "send a JSON object" in listed.text
            garbled = client.post("/v1/tokens", json={"name": "a\nb\x1b[31m"})
            assert garbled.status_code == 400 and "control characters" in garbled.text
        # A worker token that expires keeps its node joined until then, as a revoke would.
        brief = platform.ember("token", "create", "--scope", "worker", "--expires", "8s")
        worker = join_worker(platform, brief.stdout.strip(), tmp_path / "node-d")
        try:
            wait_for(lambda: platform.status()["workers"], 30)
            wait_for(lambda: not platform.status()["workers"], 15)
        finally:
            worker.terminate()
            worker.wait(timeout=30)


def test_a_second_worker_with_a_joined_workers_name_waits_until_the_name_is_free(
    tmp_path: Path,
) -> None:
    with running_platform(tmp_path / "cp", extra=("--no-worker",)) as platform:
        token = platform.ember("token", "create", "--scope", "worker").stdout.strip()
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        first = join_worker(platform, token, tmp_path / "a" / "gpu-1")
        second = None
        try:
            wait_for(lambda: platform.status()["workers"], 30)
            second = join_worker(platform, token, tmp_path / "b" / "gpu-1")
            log = tmp_path / "b" / "gpu-1.log"
            wait_for(lambda: log.exists() and "already joined" in log.read_text(), 30)
            assert "start this one with another --name" in log.read_text()
            assert len(platform.status()["workers"]) == 1 and second.poll() is None
            first.terminate()
            assert first.wait(timeout=30) == 0
            # It tries again, and the name is its own once the first has gone.
            wait_for(lambda: len(platform.status()["workers"]) == 1, 30)
            wait_for(lambda: "registered as" in log.read_text(), 30)
        finally:
            for worker in (first, second):
                if worker is not None and worker.poll() is None:
                    worker.terminate()
                    worker.wait(timeout=30)
