"""A dashboard session outlives the control-plane process that opened it: signed in, the
server restarted on the same state, the browser's cookie still opens the dashboard. (The
next owner of a platform of several processes finds it the same way, in the shared
store.) A revoked token's session does not come back."""

from __future__ import annotations

from pathlib import Path

import httpx
from harness import Platform, running_platform

from ember.calling.tlsclient import client_context

COOKIE = "ember_dashboard"


def signed_in(platform: Platform, token: str | None = None) -> str:
    with platform.client(token) as client:
        response = client.post("/dashboard/session")
    assert response.status_code == 200, response.text
    return response.cookies[COOKIE]


def whoami(platform: Platform, cookie: str) -> httpx.Response:
    with httpx.Client(
        base_url=platform.url, verify=client_context(platform.ca), cookies={COOKIE: cookie}
    ) as browser:
        return browser.get("/dashboard/session")


def test_a_session_and_its_reads_survive_a_restart(tmp_path: Path) -> None:
    with running_platform(tmp_path) as platform:
        cookie = signed_in(platform)
        made = platform.ember("token", "create", "--scope", "deploy", "--name", "brief").stdout
        brief = next(word for word in made.split() if word.startswith("emb_"))
        revoked = signed_in(platform, brief)
        assert whoami(platform, revoked).status_code == 200
        platform.stop()
        platform.start()
        shown = whoami(platform, cookie)
        assert shown.status_code == 200, shown.text
        assert shown.json()["scope"] == "admin"
        with httpx.Client(
            base_url=platform.url, verify=client_context(platform.ca), cookies={COOKIE: cookie}
        ) as browser:
            assert browser.get("/dashboard/api/v1/apps").status_code == 200
        tokens = platform.ember("token", "ls").stdout
        brief_id = next(line.split()[0] for line in tokens.splitlines() if "brief" in line)
        platform.ember("token", "revoke", brief_id)
        assert whoami(platform, revoked).status_code == 401
        platform.stop()
        platform.start()
        assert whoami(platform, revoked).status_code == 401
        assert whoami(platform, cookie).status_code == 200
