"""`/dashboard` in a real headless Chromium against a real server with traffic: the login
link and its cookie, the plots drawn from the control plane's history, logs newest
first while following, and a refused token or an ended session clearing the page."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import numpy
import pytest
from harness import Platform, running_platform, wait_for
from headless_chromium import HeadlessChromium
from machine_needs import need
from PIL import Image

import ember
from ember_platform.http.dashboard.page import assemble

# Points every half second: the test sees several without waiting for the default 5 s.
SAMPLE_ENV = {"EMBER_HISTORY_SAMPLE_SECONDS": "0.5"}
UPLOT = Path(__file__).parents[2] / "platform/ember_platform/http/static/vendor/uplot"
# The requests/s line's colour in the page (#ff7a1a), as pixels near it are counted.
ORANGE = (255, 122, 26)
# Pixels of a plot's canvas near `colour`: its line is drawn, not only its axes.
COLOURED_PIXELS = """
((id, [r, g, b]) => {
  const canvas = document.querySelector("#" + id + " canvas");
  if (!canvas) return 0;
  const { data } = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height);
  let count = 0;
  for (let i = 0; i < data.length; i += 4) {
    if (Math.abs(data[i] - r) < 40 && Math.abs(data[i + 1] - g) < 40
        && Math.abs(data[i + 2] - b) < 40 && data[i + 3] > 200) count++;
  }
  return count;
})
"""


def text_of(element: str) -> str:
    return f"document.getElementById({element!r}).textContent"


def rows_of(element: str) -> str:
    return f"document.getElementById({element!r}).children.length"


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("platform"), env=SAMPLE_ENV) as running:
        yield running


@pytest.fixture(scope="module")
def board(platform: Platform, apps_dir: Path) -> Platform:
    """basic.py as `board`, with calls, streams and failures behind it."""
    platform.deploy(apps_dir / "basic.py", "board")
    config = platform.config()
    echo = ember.Endpoint.lookup("board", "echo", config=config)
    numbers = ember.Endpoint.lookup("board", "numbers", config=config)
    boom = ember.Endpoint.lookup("board", "boom", config=config)
    deadline = time.monotonic() + 3  # several of the history's points
    while time.monotonic() < deadline:
        echo.call(text="on the board")
        assert [event["n"] for event in numbers.stream(to=4, delay=0.01)] == [0, 1, 2, 3]
        with pytest.raises(Exception, match="kaboom"):
            boom.call()
    return platform


@pytest.fixture(scope="module")
def browser() -> Iterator[HeadlessChromium]:
    chromium = shutil.which("chromium") or need(
        "packages", "no chromium here: `bash infra/install.sh --test` installs it"
    )
    if not (UPLOT / "uPlot.iife.min.js").exists():
        need("packages", "uPlot is not installed: `bash infra/uplot.sh` installs it")
    running = HeadlessChromium(chromium)
    try:
        yield running
    finally:
        running.close()


LABELS = ("board--echo", "board--boom", "board--numbers")


def history(platform: Platform, token: str | None = None) -> dict[str, Any]:
    with platform.client(token) as client:
        response = client.get("/v1/dashboard/history")
    assert response.status_code == 200, response.text
    endpoints: dict[str, Any] = response.json()["endpoints"]
    return endpoints


def test_the_page_is_served_with_a_policy_that_allows_only_itself(platform: Platform) -> None:
    with platform.client() as client:
        response = client.get("/dashboard", headers={"Authorization": ""})  # no token needed
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    policy = response.headers["content-security-policy"]
    scripts = re.findall(r"<script>(.*?)</script>", response.text, re.DOTALL)
    assert len(scripts) == 2  # uPlot, inline (served by the platform, no CDN), and the page's
    for script in scripts:
        digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in policy
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert "http" not in policy  # nothing from elsewhere
    assert "emb_" not in response.text  # no data, no token in the page itself


def test_history_needs_a_token_and_shows_a_workspace_its_own_endpoints(
    board: Platform,
) -> None:
    def complete() -> dict[str, Any] | None:
        shown = history(board)
        series = {label: shown.get(label, {}).get("series", {}) for label in LABELS}
        if (
            any(series["board--echo"].get("requests_per_s", []))
            and any(series["board--boom"].get("errors_per_s", []))
            and any(v is not None for v in series["board--numbers"].get("ttft_p95", []))
        ):
            return shown
        return None

    shown = wait_for(complete, 30)
    echo, numbers = shown["board--echo"]["series"], shown["board--numbers"]["series"]
    assert max(v or 0 for v in echo["requests_per_s"]) > 0
    assert any(v for v in shown["board--boom"]["series"]["errors_per_s"])
    assert any(v is not None for v in numbers["ttft_p95"])
    assert any(v is not None for v in numbers["itl_p50"])
    assert any(v is not None for v in echo["e2e_p99"])
    assert max(echo["replicas_ready"]) >= 1
    assert sum(v or 0 for v in echo["starts_cold"] + echo["starts_restore"]) >= 1
    with board.client() as client:
        assert client.get("/v1/dashboard/history", headers={"Authorization": ""}).status_code == 401
        invoke = client.post("/v1/tokens", json={"scope": "invoke"}).json()["token"]
        assert (
            client.get(
                "/v1/dashboard/history", headers={"Authorization": f"Bearer {invoke}"}
            ).status_code
            == 403
        )
        assert client.post("/v1/workspaces", json={"name": "team-b"}).status_code == 201
        other = client.post("/v1/tokens", json={"scope": "deploy", "workspace": "team-b"})
        assert other.status_code == 201, other.text
        # The dashboard's own reads need its cookie: a token is not taken there.
        assert client.get("/dashboard/api/v1/apps").status_code == 401
        assert client.get("/dashboard/api/v1/tokens").status_code == 404  # not a read it makes
        assert client.delete("/dashboard/api/v1/apps/board").status_code == 405
        assert client.get("/dashboard/login?code=nonsense").status_code == 401
    assert history(board, other.json()["token"]) == {}  # none of main's endpoints


def test_a_login_link_signs_in_and_the_plots_are_drawn(
    board: Platform, browser: HeadlessChromium, tmp_path: Path
) -> None:
    link = board.ember("dashboard", "--print").stdout.splitlines()[0]
    assert link.startswith(board.url + "/dashboard/login?code=")
    browser.open(link.replace("code=", "code=x"))  # a wrong link
    assert "not valid" in browser.evaluate("document.body.textContent")
    assert browser.cookies(board.url + "/dashboard") == []
    browser.open(link)
    assert browser.evaluate("location.href") == board.url + "/dashboard"  # no code kept
    [cookie] = browser.cookies(board.url + "/dashboard")
    assert cookie["name"] == "ember_dashboard" and cookie["path"] == "/dashboard"
    assert cookie["httpOnly"] and cookie["secure"] and cookie["sameSite"] == "Strict"
    assert 0 < cookie["expires"] - time.time() <= 8 * 3600 + 60
    assert browser.cookies(board.url + "/board--echo/") == []  # endpoints never see it
    browser.open(link)  # single use
    assert "used already" in browser.evaluate("document.body.textContent")
    # A new tab (a new load of the page) is signed in by the cookie alone.
    browser.open(board.url + "/dashboard#board--numbers")
    browser.wait_for(f"{text_of('who')}.startsWith('admin token (every workspace)')")
    browser.wait_for(f"{text_of('plots-title')} === 'Last hour of board--numbers'")
    assert browser.wait_for(f"{COLOURED_PIXELS}('plot-rate', {list(ORANGE)}) > 50")
    assert browser.wait_for(f"{COLOURED_PIXELS}('plot-ttft', [31, 119, 180]) > 20")  # P50
    assert browser.evaluate(rows_of("endpoints")) >= 5
    time.sleep(0.5)  # a last refresh's drawing
    png = browser.screenshot(tmp_path / "dashboard.png")
    pixels = numpy.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=numpy.int16)
    near = int((numpy.abs(pixels - numpy.array(ORANGE)) < 40).all(axis=2).sum())
    assert near > 100, "the screenshot shows no requests/s line"
    if target := os.environ.get("EMBER_DASHBOARD_SCREENSHOT"):
        shutil.copyfile(tmp_path / "dashboard.png", target)  # for the docs


def test_logs_are_newest_first_and_followed(board: Platform, browser: HeadlessChromium) -> None:
    browser.open(board.url + "/dashboard#board--echo")
    browser.wait_for(f"{text_of('logs-title')} === 'Logs of board--echo'")
    echo = ember.Endpoint.lookup("board", "echo", config=board.config())
    first, second = (f"mark-{uuid.uuid4().hex[:8]}" for _ in range(2))
    browser.wait_for(f"{rows_of('logs')} > 0")  # the follow's history came
    # The stdout line, just under the call's own [request] line: the newest ones on top.
    near_top = "Array.from(document.getElementById('logs').children).slice(0, 3)"
    echo.call(text=first)
    browser.wait_for(f"{near_top}.some((line) => line.textContent.includes({first!r}))")
    echo.call(text=second)
    browser.wait_for(f"{near_top}.some((line) => line.textContent.includes({second!r}))")
    text = browser.evaluate(text_of("logs"))
    assert text.index(second) < text.index(first)


def signed_out(browser: HeadlessChromium, platform: Platform) -> None:
    """The page, loaded afresh with no session (so what it shows next is a new one's)."""
    browser.open(platform.url + "/dashboard")
    browser.evaluate("fetch('/dashboard/session', { method: 'DELETE' })")
    browser.open(platform.url + "/dashboard")
    browser.wait_for(f"{text_of('status')}.startsWith('not signed in')")


def paste(browser: HeadlessChromium, token: str) -> None:
    browser.evaluate(
        f"document.getElementById('token').value = {token!r};"
        "document.getElementById('login').requestSubmit()"
    )


def test_an_admin_picks_the_workspace_shown(board: Platform, browser: HeadlessChromium) -> None:
    with board.client() as client:
        made = client.post("/v1/workspaces", json={"name": "team-c"}).status_code
        assert made in (201, 409)
    signed_out(browser, board)
    paste(browser, board.token)
    browser.wait_for(f"{rows_of('endpoints')} > 5")
    pick = "document.getElementById('workspace')"
    browser.wait_for(f"!{pick}.hidden && [...{pick}.options].some((o) => o.value === 'team-c')")
    browser.evaluate(f"{pick}.value = 'team-c'; {pick}.dispatchEvent(new Event('change'))")
    browser.wait_for(f"{text_of('endpoints')}.startsWith('no endpoints deployed')")
    assert browser.evaluate(rows_of("plots")) == 0
    browser.evaluate(f"{pick}.value = 'main'; {pick}.dispatchEvent(new Event('change'))")
    browser.wait_for(f"{rows_of('endpoints')} > 5 && {rows_of('plots')} > 5")


def test_a_refused_token_or_an_ended_session_clears_the_page(
    board: Platform, browser: HeadlessChromium
) -> None:
    signed_out(browser, board)
    paste(browser, board.token)  # pasting a token signs in too
    browser.wait_for(f"{rows_of('endpoints')} > 5 && {rows_of('plots')} > 5")
    paste(browser, "emb_not-a-token")
    browser.wait_for(f"{text_of('status')}.includes('refused')")
    assert browser.evaluate(rows_of("endpoints")) == 0
    assert browser.evaluate(rows_of("plots")) == 0 and browser.evaluate(rows_of("logs")) == 0
    assert browser.evaluate(text_of("who")) == ""
    assert browser.evaluate("document.getElementById('token').value") == ""
    with board.client() as client:  # a brief deploy token: its session ends with it
        brief = client.post("/v1/tokens", json={"scope": "deploy", "expires_in": 4}).json()
    paste(browser, brief["token"])
    browser.wait_for(f"{rows_of('endpoints')} > 5 && {text_of('who')}.startsWith('deploy')")
    browser.wait_for(f"{text_of('status')}.startsWith('signed out')", timeout=15)
    assert browser.evaluate(rows_of("endpoints")) == 0
    assert browser.evaluate(rows_of("plots")) == 0
    browser.open(board.url + "/dashboard")  # and a reload does not bring it back
    browser.wait_for(f"{text_of('status')}.startsWith('not signed in')")
    assert browser.evaluate(rows_of("endpoints")) == 0


def test_without_uplot_the_page_says_how_to_install_it(browser: HeadlessChromium) -> None:
    html = resources.files("ember_platform.http").joinpath("static/dashboard.html").read_text()
    body, _ = assemble(html, None)
    assert b"<script>" in body and b"uPlot.iife" not in body
    browser.open("data:text/html;base64," + base64.b64encode(body).decode())
    notice = browser.wait_for("!document.getElementById('notice').hidden && " + text_of("notice"))
    assert "infra/uplot.sh" in notice
    assert browser.evaluate(rows_of("plots")) == 0
