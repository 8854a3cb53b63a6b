"""`ember serve` redeploys for edits to the code and for nothing else: not for its own
log in the app's folder (`ember serve app.py > serve.log`), not for files .gitignore
names, and a burst of saves redeploys once."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

from harness import EMBER, Platform, wait_for

import ember

APP = "watched"
SOURCE = """
import ember

@ember.endpoint(scaledown_window=60)
def version() -> dict:
    return {"version": VERSION}

VERSION = 1
"""


def versions(platform: Platform) -> int:
    history = json.loads(platform.ember("history", APP, "--json").stdout)
    return len(history["versions"])


def test_serve_ignores_its_log_and_gitignored_files_and_redeploys_a_burst_once(
    platform: Platform, tmp_path: Path
) -> None:
    folder = tmp_path / "app"
    folder.mkdir()
    app_file = folder / "app.py"
    app_file.write_text(SOURCE)
    (folder / ".gitignore").write_text("*.out\nruns/\n")
    log = folder / "serve.log"
    with log.open("w") as output:
        serve = subprocess.Popen(
            [*EMBER, "serve", "app.py", "--name", APP],
            cwd=folder,
            env=platform.env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: "watching" in log.read_text(), 60)
        endpoint = ember.Endpoint.lookup(APP, "version", config=platform.config())
        assert endpoint.call() == {"version": 1}
        assert versions(platform) == 1

        # Output that goes on being written into the folder: serve's own log (which the
        # deploy prints into), files .gitignore names, a folder it names.
        (folder / "runs").mkdir()
        for n in range(8):
            with log.open("a") as appended:
                appended.write(f"a line the app's author added {n}\n")
            (folder / "results.out").write_text(f"step {n}\n")
            (folder / "runs" / f"{n}.txt").write_text("x")
            time.sleep(0.25)
        time.sleep(2 * 0.5 + 0.5)  # two polls and a settle after the last write
        assert "redeploying" not in log.read_text(), log.read_text()
        assert versions(platform) == 1

        # A burst of saves of the code: one redeploy, of the last.
        for version in (2, 3, 4):
            app_file.write_text(SOURCE.replace("VERSION = 1", f"VERSION = {version}"))
            time.sleep(0.05)
        wait_for(lambda: endpoint.call() == {"version": 4}, 60, interval=0.3)
        time.sleep(2)  # any second redeploy would have begun by now
        said = log.read_text()
        assert said.count("redeploying") == 1, said
        assert "changed: app.py; redeploying" in said
        assert versions(platform) == 2
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait(10)
            raise AssertionError("ember serve did not stop:\n" + log.read_text()) from None
    assert "stopped app watched" in log.read_text()
