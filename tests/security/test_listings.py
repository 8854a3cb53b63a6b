"""Listings cross workspaces (issue 47): a tenant with a deploy token of its own lists
what its workspace holds and nothing of another's, whatever the listing; the operator's
admin token alone lists every workspace (`--all-workspaces`), each row naming its own.

The attack as reported: `ember snapshot ls` with main's deploy token listed the
snapshots of `team` (its labels `team--app--endpoint`, split at the first `--`, read as
app `team` of main), and `team` saw none of its own."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from harness import EMBER, Platform, running_platform, wait_for
from machine_needs import need

from ember.calling.tlsclient import client_context

APP = """\
import ember


@ember.endpoint(scaledown_window=600)
def fn() -> dict:
    return {"ok": True}
"""

WORKSPACE = "team"
MAIN_LABEL = "shop--fn"
TEAM_LABEL = f"{WORKSPACE}--shop--fn"


@dataclass
class Tenants:
    platform: Platform
    main: str  # a deploy token of main
    team: str  # a deploy token of `team`


def cli(platform: Platform, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`ember ARGS` as a holder of `token` runs it, with no workspace named."""
    env = {**platform.env, "EMBER_TOKEN": token, "EMBER_SERVER_URL": platform.url}
    env["EMBER_CA_CERT"] = platform.ca
    env.pop("EMBER_WORKSPACE", None)
    return subprocess.run([*EMBER, *args], env=env, capture_output=True, text=True, timeout=120)


def listed(platform: Platform, token: str, *args: str) -> str:
    result = cli(platform, token, *args)
    assert result.returncode == 0, f"ember {' '.join(args)}:\n{result.stdout}{result.stderr}"
    return result.stdout


def client(platform: Platform, token: str, workspace: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"}
    if workspace is not None:
        headers["Ember-Workspace"] = workspace
    return httpx.Client(
        base_url=platform.url, verify=client_context(platform.ca), headers=headers, timeout=60
    )


def snapshots_of(platform: Platform, workspace: str, label: str) -> list[Any]:
    """The ready images of an endpoint, as `ember ls` (not the listing under test) says."""
    with client(platform, platform.token, workspace) as admin:
        rows = admin.get("/v1/apps").json()["endpoints"]
    return next((row["snapshots"] for row in rows if row["label"] == label), [])


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenants]:
    """One platform: main and `team` each deploy an app `shop` with its own deploy token,
    call it once and spawn a call, and its first replica takes the endpoint's snapshot."""
    root = tmp_path_factory.mktemp("listings")
    source = root / "shop" / "app.py"
    source.parent.mkdir()
    source.write_text(APP)
    with running_platform(root / "platform") as platform:
        problem = platform.status()["workers"][0]["snapshots"].get("problem")
        if problem is not None:  # the listings attacked are of snapshots
            need("criu", f"the snapshot listings need snapshots: {problem}")
        platform.ember("workspace", "create", WORKSPACE)
        made = {
            name: platform.ember("token", "create", *args, "--name", name).stdout.strip()
            for name, args in (
                ("main", ("--scope", "deploy")),
                ("team", ("--workspace", WORKSPACE, "--scope", "deploy")),
            )
        }
        for token, label in ((made["main"], MAIN_LABEL), (made["team"], TEAM_LABEL)):
            listed(platform, token, "deploy", str(source), "--name", "shop")
            with client(platform, token) as caller:
                assert caller.post(f"/{label}/", json={}).json() == {"ok": True}
                spawned = caller.post(f"/{label}/", json={}, headers={"Prefer": "respond-async"})
                assert spawned.status_code == 202, spawned.text
        for workspace, label in (("main", MAIN_LABEL), (WORKSPACE, TEAM_LABEL)):
            wait_for(lambda: snapshots_of(platform, workspace, label), 90)  # noqa: B023
        yield Tenants(platform, made["main"], made["team"])


def test_a_workspace_lists_its_own_snapshots_and_no_others(tenants: Tenants) -> None:
    platform = tenants.platform
    as_main = listed(platform, tenants.main, "snapshot", "ls")
    assert WORKSPACE not in as_main, as_main  # the attack: team's image in main's listing
    own = [line for line in as_main.splitlines() if line.startswith(f"{MAIN_LABEL} ")]
    assert own and " ready " in own[0], as_main

    as_team = listed(platform, tenants.team, "snapshot", "ls")
    rows = [line for line in as_team.splitlines() if line.startswith(f"{TEAM_LABEL} ")]
    assert rows and " ready " in rows[0], as_team  # its own image, ready
    assert not any(line.startswith(f"{MAIN_LABEL} ") for line in as_team.splitlines())
    # Named by its app, as in its workspace; and in JSON each row says whose it is.
    assert TEAM_LABEL in listed(platform, tenants.team, "snapshot", "ls", "shop")
    data = json.loads(listed(platform, tenants.team, "snapshot", "ls", "--json"))
    ready = [s for s in data["snapshots"] if s["state"] == "ready"]
    assert [(s["workspace"], s["app"], s["label"]) for s in ready] == [
        (WORKSPACE, "shop", TEAM_LABEL)
    ]
    main_data = json.loads(listed(platform, tenants.main, "snapshot", "ls", "--json"))
    assert {s["workspace"] for s in main_data["snapshots"] + main_data["endpoints"]} == {"main"}
    # Nor can main drop team's image by its key.
    key = ready[0]["key"]
    with client(platform, tenants.main) as as_main_api:
        assert as_main_api.delete(f"/v1/snapshots/{key}").status_code == 404


def test_every_other_listing_stays_in_its_workspace(tenants: Tenants) -> None:
    platform = tenants.platform
    for args in (("ls",), ("replica", "ls"), ("usage",), ("calls", "ls")):
        as_main = listed(platform, tenants.main, *args)
        assert WORKSPACE not in as_main, (args, as_main)
    for args in (("ls",), ("replica", "ls"), ("usage",), ("calls", "ls")):
        as_team = listed(platform, tenants.team, *args)
        assert TEAM_LABEL in as_team, (args, as_team)
        assert not any(line.startswith(f"{MAIN_LABEL} ") for line in as_team.splitlines())
    replicas = json.loads(listed(platform, tenants.team, "replica", "ls", "--json"))
    assert {(r["workspace"], r["app"]) for r in replicas} == {(WORKSPACE, "shop")}


def test_only_the_operator_lists_every_workspace(tenants: Tenants) -> None:
    platform = tenants.platform
    everything = platform.ember("snapshot", "ls", "--all-workspaces").stdout
    lines = everything.splitlines()
    assert lines[0].split()[0] == "WORKSPACE", everything
    for workspace, label in (("main", MAIN_LABEL), (WORKSPACE, TEAM_LABEL)):
        assert any(line.split()[:2] == [workspace, label] for line in lines), everything
    for args in (("ls",), ("replica", "ls"), ("usage",), ("calls", "ls")):
        both = platform.ember(*args, "--all-workspaces").stdout
        assert MAIN_LABEL in both and TEAM_LABEL in both, (args, both)
        assert both.splitlines()[0].split()[0] == "WORKSPACE", (args, both)
    # Main's admin view without the flag is main's alone.
    assert WORKSPACE not in platform.ember("snapshot", "ls").stdout

    for token in (tenants.main, tenants.team):
        for args in (("snapshot", "ls"), ("ls",), ("replica", "ls"), ("usage",), ("calls", "ls")):
            refused = cli(platform, token, *args, "--all-workspaces")
            assert refused.returncode != 0, (args, refused.stdout)
            assert "admin token" in refused.stderr, (args, refused.stderr)
            assert TEAM_LABEL not in refused.stdout and MAIN_LABEL not in refused.stdout
        with client(platform, token) as api:
            for path in ("/v1/snapshots", "/v1/apps", "/v1/replicas", "/v1/usage", "/v1/calls"):
                answer = api.get(path, params={"all_workspaces": "true"})
                assert answer.status_code == 403, (path, answer.text)
