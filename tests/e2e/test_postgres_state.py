"""`ember server --database postgresql://…`: the platform's state in PostgreSQL (a throwaway
cluster, tests/postgres_cluster.py), none of it in the state dir's SQLite file; a restart
finds the app, its secrets and tokens there. A database that cannot be reached stops the
server at once, saying which; one lost while serving answers 503 until it is back."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from harness import EMBER, Platform, free_port, running_platform, wait_for
from machine_needs import need
from postgres_cluster import ClusterError, start_cluster

HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello" / "app.py"


def test_state_in_postgres_outlives_a_restart(tmp_path: Path, postgres_url: str) -> None:
    extra = ("--database", postgres_url)
    with running_platform(tmp_path, extra=extra) as platform:
        platform.deploy(HELLO, "hello")
        platform.ember("secret", "set", "greeting", "WORD=hi")
        token = platform.ember("token", "create", "--app", "hello", "--name", "web").stdout
        with platform.client(token=token.strip()) as client:
            answer = client.post("/hello--greet/", json={"name": "Ada"})
            assert answer.json() == {"greeting": "Hello, Ada."}
    assert not (platform.state_dir / "state.db").exists()  # nothing kept in SQLite
    with running_platform(tmp_path, extra=extra) as again:
        apps = [row["label"] for row in again.status()["endpoints"]]
        assert sorted(apps) == ["hello--count", "hello--greet"]
        secrets = json.loads(again.ember("secret", "ls", "--json").stdout)
        assert "greeting" in json.dumps(secrets)
        listed = again.ember("token", "ls").stdout
        assert any(line.split()[1:6] == ["invoke", "main", "hello", "-", "web"]
                   for line in listed.splitlines())  # fmt: skip
        with again.client(token=token.strip()) as client:
            answer = client.post("/hello--greet/", json={"name": "Grace", "excited": True})
            assert answer.json() == {"greeting": "Hello, Grace!"}


def test_a_database_that_cannot_be_reached_stops_the_server_naming_it(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    url = f"postgresql://ember:hunter2@127.0.0.1:{port}/ember"
    command = [*EMBER, "server", "--state-dir", str(tmp_path / "state"), "--port", "0"]
    started = time.monotonic()
    done = subprocess.run(
        [*command, "--no-worker", "--database", url],
        env=Platform(tmp_path).env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert time.monotonic() - started < 30
    said = f"cannot reach the state database postgresql://ember:***@127.0.0.1:{port}/ember"
    assert said in done.stderr, done.stderr
    assert "hunter2" not in done.stderr + done.stdout
    assert "Traceback" not in done.stderr
    # Not a URL of PostgreSQL: refused before anything starts, from the environment too.
    env = {**Platform(tmp_path).env, "EMBER_DATABASE_URL": "mysql://127.0.0.1/ember"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "is not a PostgreSQL URL" in done.stderr


def test_a_database_lost_while_serving_answers_503_until_it_is_back(tmp_path: Path) -> None:
    try:
        cluster = start_cluster()  # of this test's own, to stop and start
    except ClusterError as error:
        need("postgres", str(error))
    try:
        extra = ("--no-worker", "--database", cluster.new_database())
        with running_platform(tmp_path, extra=extra) as platform, platform.client() as client:
            assert client.post("/v1/tokens", json={"name": "before"}).status_code == 201
            platform.deploy(HELLO, "hello")  # no worker: its spawned calls wait, recorded
            spawn = {"Prefer": "respond-async"}
            cluster.stop_server()
            refused = client.post("/v1/tokens", json={"name": "while-down"})
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["type"] == "state_store_unavailable"
            assert "the state database postgresql://" in refused.json()["error"]["message"]
            assert refused.headers["retry-after"] == "5"
            again = client.post("/v1/tokens", json={"name": "while-down"})
            assert again.status_code == 503 and "cannot be reached" in again.text
            # A spawned call is refused rather than promised without a record.
            spawned = client.post("/hello--greet/", json={}, headers=spawn)
            assert spawned.status_code == 503, spawned.text
            assert spawned.json()["error"]["type"] == "state_store_unavailable"
            assert "retry once the state database answers" in spawned.text
            cluster.start_server()
            wait_for(lambda: client.post("/v1/tokens", json={"name": "after"}).is_success, 15)
            assert client.post("/hello--greet/", json={}, headers=spawn).status_code == 202
            names = [t["name"] for t in client.get("/v1/tokens").json()["tokens"]]
            assert "before" in names and "after" in names and "while-down" not in names
            assert not [line for line in platform.output if "Traceback" in line]
    finally:
        cluster.stop()
