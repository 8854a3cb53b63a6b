"""Workspaces: two tenants on one platform, each with a deploy token, apps of the same
name, secrets of the same name, Dicts, and replicas whose own tokens reach their own
workspace only; main goes on as before; a workspace removed takes everything with it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import httpx
from harness import EMBER, Platform, running_platform

from ember.calling.tlsclient import client_context

APP = """\
import os

import httpx

import ember


@ember.endpoint(secrets=["greeting"])
def greet(name: str = "you") -> dict:
    label = os.environ["EMBER_REPLICA_LABEL"]
    return {"greeting": f"{os.environ['GREETING']}, {name}", "label": label}


@ember.endpoint()
def probe(method: str, path: str, body: dict | None = None) -> dict:
    # What this replica's own token may reach on the platform, as any client would.
    with httpx.Client(
        base_url=os.environ["EMBER_SERVER_URL"],
        verify=os.environ.get("EMBER_CA_CERT") or True,
        headers={"Authorization": f"Bearer {os.environ['EMBER_TOKEN']}"},
        timeout=30,
    ) as client:
        answer = client.request(method, path, json=body)
    return {"status": answer.status_code, "body": answer.text[:500]}


@ember.endpoint()
def remember(key: str, value: str) -> dict:
    ember.Dict("notes")[key] = value
    ember.Volume("files").write_file(key, value.encode())
    local = (ember.Volume("files").path / key).read_text()  # the node's copy
    return {"kept": ember.Dict("notes").get(key), "file": local}
"""


def cli(platform: Platform, token: str, *args: str, workspace: str | None = None) -> Any:
    env = {**platform.env, "EMBER_TOKEN": token, "EMBER_SERVER_URL": platform.url}
    env["EMBER_CA_CERT"] = platform.ca
    env.pop("EMBER_WORKSPACE", None)
    if workspace is not None:
        env["EMBER_WORKSPACE"] = workspace
    return subprocess.run([*EMBER, *args], env=env, capture_output=True, text=True, timeout=180)


def client(platform: Platform, token: str, workspace: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"}
    if workspace is not None:
        headers["Ember-Workspace"] = workspace
    return httpx.Client(
        base_url=platform.url, verify=client_context(platform.ca), headers=headers, timeout=120
    )


def new_token(platform: Platform, *args: str) -> str:
    made = platform.ember("token", "create", *args)
    return made.stdout.strip()


def test_two_workspaces_share_a_platform_and_nothing_else(tmp_path: Path) -> None:
    source = tmp_path / "shop" / "app.py"
    source.parent.mkdir()
    source.write_text(APP)
    with running_platform(tmp_path / "platform") as platform:
        listed = platform.ember("workspace", "ls").stdout
        assert listed.splitlines()[1].startswith("main")
        for name in ("team-a", "team-b"):
            made = platform.ember("workspace", "create", name).stdout
            assert f"created workspace {name}" in made
        again = platform.ember("workspace", "create", "team-a", check=False)
        assert again.returncode == 1 and "exists already" in again.stderr
        a = new_token(platform, "--workspace", "team-a", "--scope", "deploy", "--name", "a")
        b = new_token(platform, "--workspace", "team-b", "--scope", "deploy", "--name", "b")

        # Each deploys an app named shop, with a secret named greeting of its own value.
        for token, word in ((a, "Hello"), (b, "Hej")):
            made = cli(platform, token, "secret", "set", "greeting", f"GREETING={word}")
            assert made.returncode == 0, made.stderr
            deployed = cli(platform, token, "deploy", str(source), "--name", "shop")
            assert deployed.returncode == 0, deployed.stderr
        assert "team-a--shop--greet" in cli(platform, a, "ls").stdout
        assert "team-b" not in cli(platform, a, "ls").stdout

        with client(platform, a) as as_a, client(platform, b) as as_b:
            own = as_a.post("/team-a--shop--greet/", json={"name": "Ada"})
            assert own.json() == {"greeting": "Hello, Ada", "label": "team-a--shop--greet"}
            assert as_b.post("/team-b--shop--greet/", json={}).json()["greeting"] == "Hej, you"
            # Another workspace's endpoint: refused, naming the token's workspace.
            across = as_b.post("/team-a--shop--greet/", json={})
            assert across.status_code == 403
            assert "workspace team-b" in across.json()["error"]["message"]
            # main's label form is main's: a 404 that tells the token its own label.
            short = as_a.post("/shop--greet/", json={})
            assert short.status_code == 404
            assert "this token's workspace has team-a--shop--greet" in short.text
            # Webhooks: each workspace's receivers check a secret of its own.
            secret_a = as_a.get("/v1/webhooks/secret").json()["secret"]
            secret_b = as_b.get("/v1/webhooks/secret").json()["secret"]
            main_secret = platform.ember("calls", "webhook-secret").stdout.strip()
            assert len({secret_a, secret_b, main_secret}) == 3
            # A workspace token cannot act as the platform's operator.
            for method, path, body in (
                ("POST", "/v1/workspaces", {"name": "mine"}),
                ("POST", "/v1/tokens", {"scope": "admin"}),
                ("POST", "/v1/nodes/node/drain", None),
                ("GET", "/metrics", None),
            ):
                refused = as_a.request(method, path, json=body)
                assert refused.status_code == 403, (path, refused.text)
            named = as_a.get("/v1/apps", headers={"Ember-Workspace": "team-b"})
            assert named.status_code == 403
            assert "belongs to workspace team-a" in named.json()["error"]["message"]
            # What the other workspace owns is not there to read.
            assert as_b.get("/v1/apps/shop/logs").status_code == 200  # its own shop
            assert [s["name"] for s in as_a.get("/v1/secrets").json()["secrets"]] == ["greeting"]
            tokens = as_a.get("/v1/tokens").json()["tokens"]
            assert [t["workspace"] for t in tokens] == ["team-a"]
            assert as_a.get("/v1/workspaces").json()["workspaces"][0]["name"] == "team-a"
            # A deploy token makes deploy and invoke tokens of its own workspace only.
            made = as_a.post("/v1/tokens", json={"scope": "invoke", "app": "shop"})
            assert made.status_code == 201 and made.json()["workspace"] == "team-a"
            other = as_a.post("/v1/tokens", json={"scope": "invoke", "workspace": "team-b"})
            assert other.status_code == 403

            # Dicts: the same name in two workspaces is two Dicts.
            kept = as_a.post("/team-a--shop--remember/", json={"key": "k", "value": "a's"})
            assert kept.json() == {"kept": "a's", "file": "a's"}, kept.text
            kept = as_b.post("/team-b--shop--remember/", json={"key": "k", "value": "b's"})
            assert kept.json() == {"kept": "b's", "file": "b's"}, kept.text
            item = "/v1/apps/shop/dicts/notes/items/k"
            assert as_a.get(item).json()["value"] == "a's"
            assert as_b.get(item).json()["value"] == "b's"
            assert as_b.get("/v1/apps/team-a--shop/dicts/notes/items/k").status_code == 404
            # Volumes alike: each workspace's shop has its own files.
            volume = "/v1/apps/shop/volumes/files/files/k"
            assert as_a.get(volume).content == b"a's" and as_b.get(volume).content == b"b's"

            # A replica's own token reaches its own workspace only.
            def probe(method: str, path: str, body: dict | None = None) -> dict:
                asked = {"method": method, "path": path, "body": body}
                answer = as_a.post("/team-a--shop--probe/", json=asked)
                assert answer.status_code == 200, answer.text
                return answer.json()

            assert probe("POST", "/team-a--shop--greet/", {})["status"] == 200
            assert probe("POST", "/team-b--shop--greet/", {})["status"] == 403
            assert probe("GET", "/v1/apps/team-b--shop/dicts/notes/items/k")["status"] == 404
            assert probe("GET", "/v1/apps/shop/dicts/notes/items/k")["status"] == 200
            assert probe("GET", "/v1/tokens")["status"] == 403
            assert probe("POST", "/v1/tokens", {"scope": "admin"})["status"] == 403

        # The operator's scrape names each series' workspace apart from its app.
        with platform.client() as admin:
            metrics = admin.get("/metrics").text
        assert 'workspace="team-a",app="shop",endpoint="greet"' in metrics
        assert 'app="team-a--shop"' not in metrics

        # main, the admin's, goes on as it did: two-part labels, its own secrets.
        assert "greeting" not in platform.ember("secret", "ls").stdout
        unknown = cli(platform, platform.token, "ls", workspace="nope")
        assert unknown.returncode == 1 and "no workspace named nope" in unknown.stderr
        assert (
            "team-b--shop--greet" in cli(platform, platform.token, "ls", workspace="team-b").stdout
        )

        # Removing a workspace with apps needs --force; then all of it is gone.
        kept = platform.ember("workspace", "rm", "team-b", check=False)
        assert kept.returncode == 1 and "still has apps (shop)" in kept.stderr
        platform.ember("workspace", "rm", "team-b", "--force")
        assert "team-b" not in platform.ember("workspace", "ls").stdout
        with client(platform, b) as as_b:
            assert as_b.get("/v1/apps").status_code == 401  # its tokens went with it
        platform.ember("workspace", "create", "team-b")
        with client(platform, platform.token, "team-b") as admin_b:
            assert admin_b.get("/v1/secrets").json()["secrets"] == []
            fresh = admin_b.get("/v1/apps/shop/dicts/notes/items/k")
            assert fresh.status_code == 404  # a new workspace of the old name starts empty
        with client(platform, a) as as_a:
            assert as_a.post("/team-a--shop--greet/", json={}).json()["greeting"] == "Hello, you"
