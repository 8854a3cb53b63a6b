"""Admission per workspace: an admin sets a workspace's limits (`ember workspace set`);
past one, its calls (spawned, synchronous, streamed) get 429 naming the workspace and the
limit, with Retry-After, while another workspace's calls go on; every call it was told
was accepted still completes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from harness import Platform, wait_for

from ember.calling.tlsclient import client_context

APP = """\
import time

import ember


@ember.endpoint(max_replicas=1)
def hold() -> str:
    # Busy until the test opens the gate: its queue stays as the test made it.
    while ember.Dict("gate").get("open") is None:
        time.sleep(0.05)
    return "done"


@ember.endpoint()
def quick() -> str:
    return "ok"


@ember.endpoint()
def count(n: int = 3):
    yield from range(n)
"""

SPAWN = {"Prefer": "respond-async"}


def client(platform: Platform, token: str) -> httpx.Client:
    return httpx.Client(
        base_url=platform.url,
        verify=client_context(platform.ca),
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )


def workspace_with_app(platform: Platform, name: str, source: Path) -> str:
    """A new workspace with the app deployed by its own deploy token; the token."""
    platform.ember("workspace", "create", name)
    token = platform.ember(
        "token", "create", "--workspace", name, "--scope", "deploy", "--name", name
    ).stdout.strip()
    deployed = platform.ember_as(token, "deploy", str(source), "--name", "limits")
    assert deployed.returncode == 0, deployed.stderr
    return token


def refused(response: httpx.Response, said: str) -> None:
    """A 429 of the workspace's admission, with its message and a Retry-After."""
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["type"] == "workspace_limit", error
    assert said in error["message"], error["message"]
    assert int(response.headers["retry-after"]) >= 1


def status_of(calls: httpx.Client, call_id: str) -> tuple[int, Any]:
    answer = calls.get(f"/v1/calls/{call_id}")
    return answer.status_code, answer.json()


def test_a_workspace_past_its_limits_is_refused_and_the_other_goes_on(
    platform: Platform, tmp_path: Path
) -> None:
    source = tmp_path / "limits" / "app.py"
    source.parent.mkdir()
    source.write_text(APP)
    a = workspace_with_app(platform, "team-a", source)
    b = workspace_with_app(platform, "team-b", source)
    set_a = platform.ember("workspace", "set", "team-a", "--max-queued", "3").stdout
    assert "workspace team-a: max_queued 3, max_running 1000 (default)" in set_a
    listed = platform.ember("workspace", "ls").stdout
    assert "MAX QUEUED" in listed
    row = next(line.split() for line in listed.splitlines() if line.startswith("team-a"))
    assert "3" in row and "none" in row

    accepted_a: list[str] = []
    accepted_b: list[str] = []
    with client(platform, a) as as_a, client(platform, b) as as_b:
        # A workspace's token may read its limits, not change them.
        assert as_a.patch("/v1/workspaces/team-a/limits", json={"max_queued": 99}).is_error
        # One call on A's only replica, held there: A's queue then grows as sent.
        first = as_a.post("/team-a--limits--hold/", json={}, headers=SPAWN)
        assert first.status_code == 202
        accepted_a.append(first.json()["call_id"])
        wait_for(lambda: status_of(as_a, accepted_a[0])[1]["status"] == "running", 120)
        flood = None
        for _ in range(10):
            flood = as_a.post("/team-a--limits--hold/", json={}, headers=SPAWN)
            if flood.status_code != 202:
                break
            accepted_a.append(flood.json()["call_id"])
        assert flood is not None
        refused(flood, "workspace team-a has 3 inputs queued, its limit (max_queued)")
        assert len(accepted_a) == 4  # one running, three queued
        # Synchronous and streamed calls of A pass the same admission, whatever endpoint.
        refused(as_a.post("/team-a--limits--quick/", json={}), "its limit (max_queued)")
        refused(as_a.post("/team-a--limits--count/", json={}), "its limit (max_queued)")

        # B's calls go on meanwhile: spawned past A's limit, synchronous, streamed.
        for _ in range(5):
            spawned = as_b.post("/team-b--limits--hold/", json={}, headers=SPAWN)
            assert spawned.status_code == 202, spawned.text
            accepted_b.append(spawned.json()["call_id"])
        assert as_b.post("/team-b--limits--quick/", json={}).json() == "ok"
        streamed = as_b.post("/team-b--limits--count/", json={"n": 2})
        assert streamed.status_code == 200 and "data: 1" in streamed.text

        # The running limit: A has one call on a replica.
        platform.ember(
            "workspace", "set", "team-a", "--max-queued", "default", "--max-running", "1"
        )
        refused(
            as_a.post("/team-a--limits--hold/", json={}, headers=SPAWN),
            "workspace team-a has 1 calls running, its limit (max_running)",
        )
        # The rate: a burst of two, then 429 until the bucket refills.
        platform.ember("workspace", "set", "team-a", "--max-running", "default", "--rate", "2/s")
        for _ in range(2):
            spawned = as_a.post("/team-a--limits--hold/", json={}, headers=SPAWN)
            assert spawned.status_code == 202, spawned.text
            accepted_a.append(spawned.json()["call_id"])
        refused(
            as_a.post("/team-a--limits--hold/", json={}, headers=SPAWN),
            "workspace team-a may start 2/s calls, its limit (rate)",
        )
        platform.ember("workspace", "set", "team-a", "--rate", "default")
        assert "(default)" in platform.ember("workspace", "ls").stdout

        # Every call either workspace was told was accepted completes.
        for calls in (as_a, as_b):
            opened = calls.put("/v1/apps/limits/dicts/gate/items/open", json={"value": True})
            assert opened.status_code == 200, opened.text
        for calls, ids in ((as_a, accepted_a), (as_b, accepted_b)):
            for call_id in ids:
                answer = calls.get(f"/v1/calls/{call_id}", params={"wait": 60})
                assert answer.status_code == 200 and answer.json() == "done", answer.text
