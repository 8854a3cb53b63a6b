"""`/dashboard`: the page, its policy, and its script run by Node against the platform."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from harness import Platform, wait_for
from machine_needs import need, snapshots_on

import ember

# A DOM just large enough for the page's script: elements record their text and rows.
FAKE_BROWSER = """
class Element {
  constructor(id) {
    this.id = id; this.children = []; this.textContent = ""; this.className = "";
    this.listeners = {};
  }
  replaceChildren() { this.children = []; }
  appendChild(child) { this.children.push(child); return child; }
  insertRow() { return this.appendChild(new Element("tr")); }
  insertCell() { return this.appendChild(new Element("td")); }
  addEventListener(kind, listener) { this.listeners[kind] = listener; }
}
const elements = {};
globalThis.document = {
  getElementById: (id) => (elements[id] ??= new Element(id)),
  createElement: (tag) => new Element(tag),
};
const stored = {};
globalThis.sessionStorage = {
  getItem: (k) => stored[k] ?? null,
  setItem: (k, v) => { stored[k] = v; },
};
const realFetch = globalThis.fetch;
globalThis.fetch = (path, options) => realFetch(process.env.EMBER_URL + path, options);
globalThis.setInterval = () => 0;
"""

AFTER = """
document.getElementById("token").value = process.env.EMBER_TOKEN;
elements.login.listeners.submit({ preventDefault() {} });
(async () => {
  await refresh();  // awaited here, rather than timed: the page's own call is not
  elements.endpoints.children[0].listeners.click();  // show the first endpoint's logs
  await refresh();
  const rows = (id) => elements[id].children.map((row) => row.children.map((c) => c.textContent));
  console.log(JSON.stringify({
    status: elements.status.textContent,
    endpoints: rows("endpoints"),
    workers: rows("workers"),
    replicas: rows("replicas"),
    snapshots: rows("snapshots"),
    logs: elements.logs.children.map((line) => line.textContent).join(""),
    title: elements["logs-title"].textContent,
  }));
})();
"""


def _script(html: str) -> str:
    return re.search(r"<script>(.*?)</script>", html, re.DOTALL).group(1)


def test_the_page_is_served_with_a_policy_that_allows_only_itself(platform: Platform) -> None:
    with platform.client() as client:
        response = client.get("/dashboard", headers={"Authorization": ""})  # no token needed
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    policy = response.headers["content-security-policy"]
    digest = hashlib.sha256(_script(response.text).encode()).digest()
    assert f"script-src 'sha256-{base64.b64encode(digest).decode()}'" in policy
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert "emb_" not in response.text  # no data, no token in the page itself


def test_its_script_shows_endpoints_workers_and_logs(
    platform: Platform, apps_dir: Path, tmp_path: Path
) -> None:
    node = shutil.which("node")
    if node is None:
        need("node", "no Node.js here to run the page's script")
    platform.deploy(apps_dir / "basic.py", "board")
    platform.deploy(apps_dir / "scheduled.py", "boardtimed")
    ember.Endpoint.lookup("board", "echo", config=platform.config()).call(text="on the board")
    # (Left out only where EMBER_TEST_ALLOW_SKIP names criu; else no snapshots fail the test.)
    with_snapshots = snapshots_on(platform.status()["workers"][0]["snapshots"].get("problem"))
    if with_snapshots:  # the first replica's image, for the snapshots table
        wait_for(lambda: platform.endpoint_status("board--echo")["snapshots"], 60)
    with platform.client() as client:
        html = client.get("/dashboard").text
    program = tmp_path / "dashboard.js"
    program.write_text(FAKE_BROWSER + _script(html) + AFTER)
    env = {
        **os.environ,
        "EMBER_URL": platform.url,
        "EMBER_TOKEN": platform.token,
        "NODE_EXTRA_CA_CERTS": platform.ca,
    }
    result = subprocess.run(
        [node, str(program)], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["status"].startswith("updated"), shown["status"]
    labels = [row[0] for row in shown["endpoints"]]
    assert "board--echo" in labels
    echo = shown["endpoints"][labels.index("board--echo")]
    assert echo[1].startswith("v") and "ready" in echo[2] and echo[7].startswith("cold")
    assert echo[6].endswith(" / 512 MiB")
    assert echo[9] == "-"  # no schedule
    tick = shown["endpoints"][labels.index("boardtimed--tick")]
    assert tick[9].startswith("every 2s"), tick
    assert shown["workers"][0][0] == "local"
    assert shown["workers"][0][1].startswith("ready, ") and "replica(s)" in shown["workers"][0][1]
    replica = next(row for row in shown["replicas"] if row[1] == "board--echo")
    assert replica[0].startswith("r-") and replica[3] == "local" and replica[4] == "ready"
    assert replica[6] == "1" and replica[8].startswith("cold ")  # served one, booted cold
    if with_snapshots:
        image = next(row for row in shown["snapshots"] if row[0] == "board--echo")
        assert image[2] == "ready" and image[3].startswith("v") and image[4].endswith(" MB")
        assert image[8] == "0"  # no replica restored from it yet
    assert shown["title"] == f"Logs of {labels[0]}"
    assert "[ember]" in shown["logs"] or "[request]" in shown["logs"]
    platform.ember("stop", "board")
    platform.ember("stop", "boardtimed")
