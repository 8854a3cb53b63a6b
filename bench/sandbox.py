"""What the replica sandbox costs: a hello endpoint's cold start, restore and calls, with
the sandbox and without it (`ember server --no-sandbox`), side by side in one run.

Two platforms side by side, each with the same file deployed twice: app `cold`
(snapshot=False: every start boots cold) and app `snap` (its first replica is
checkpointed, later ones restore the image). Each round waits for scale-to-zero, then
calls each app once: the request-to-answer time of a start from zero; each round
measures both platforms, in turn. Then a warm replica of each answers `--calls` calls,
alternating: the per-call time. Both platforms run as
root with the same replica uids and PID namespaces; only the mount namespace, seccomp
filter and egress rule differ.

Reach (issue 34): the sandbox adds at most 100 ms to a cold start and 20 ms to a
restore (medians); the per-call overhead is reported.

    .venv/bin/python bench/sandbox.py            # about a minute on 2 CPUs
    .venv/bin/python bench/sandbox.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from procs import ServerProcess, isolated_env, progress, server_url, stopped_at_exit

from ember.calling.tlsclient import client_context

REACH_COLD_S = 0.100
REACH_RESTORE_S = 0.020
APPS = ("cold", "snap")
SIDES = ("on", "off")  # with the sandbox, without it
ZERO_TIMEOUT_S = 120.0
SNAPSHOT_TIMEOUT_S = 180.0
HELLO = """\
import ember


@ember.endpoint(snapshot={snapshot}, scaledown_window=1, max_replicas=1)
class Hello:
    @ember.enter(snap=True)
    def load(self) -> None:
        self.greeting = "hello"

    @ember.method
    def hi(self) -> str:
        return self.greeting
"""


class Platform:
    def __init__(self, server: ServerProcess, url: str, state: Path) -> None:
        self.server = server
        self.client = httpx.Client(
            base_url=url,
            verify=client_context(str(state / "ca.pem")),
            headers={"Authorization": f"Bearer {(state / 'admin-token').read_text().strip()}"},
            timeout=300,
        )

    def rows(self) -> dict[str, dict[str, Any]]:
        rows = self.client.get("/v1/apps").raise_for_status().json()["endpoints"]
        return {row["label"]: row for row in rows}

    def wait_for_zero(self) -> None:
        deadline = time.monotonic() + ZERO_TIMEOUT_S
        while any(any(r["replicas"].values()) for r in self.rows().values()):
            self.server.remember()
            if time.monotonic() > deadline:
                raise RuntimeError("replicas did not scale to zero")
            time.sleep(0.1)

    def wait_for_snapshot(self) -> None:
        deadline = time.monotonic() + SNAPSHOT_TIMEOUT_S
        while not self.rows()["snap--hello"]["snapshots"]:
            self.server.remember()
            if time.monotonic() > deadline:
                raise RuntimeError("no snapshot of snap--hello:\n" + self.server.tail())
            time.sleep(0.1)

    def call(self, app: str) -> tuple[float, dict[str, Any]]:
        started = time.perf_counter()
        answer = self.client.post(f"/{app}--hello/hi", json={})
        seconds = time.perf_counter() - started
        if answer.status_code != 200 or answer.json() != "hello":
            raise RuntimeError(f"{app}: HTTP {answer.status_code} {answer.text[:300]}")
        return seconds, dict(self.rows()[f"{app}--hello"].get("last_start") or {})


def start(work: Path, sandbox: bool, started: list[ServerProcess]) -> Platform:
    """An `ember server` (with or without the sandbox) with both apps deployed, and the
    snap app's image taken."""
    env = isolated_env(work)
    state = work / "state"
    command = [sys.executable, "-m", "ember.cli.main", "server", "--state-dir", str(state)]
    command += ["--port", "0", *([] if sandbox else ["--no-sandbox"])]
    server = ServerProcess.start("ember server", command, work / "server.log", env)
    started.append(server)
    platform = Platform(server, server_url(server, 60), state)
    for app in APPS:
        source = work / app / "app.py"
        source.parent.mkdir()
        source.write_text(HELLO.format(snapshot=app == "snap"))
        deploy = [sys.executable, "-m", "ember.cli.main", "deploy", str(source)]
        done = subprocess.run(
            [*deploy, "--name", app, "--wait"], env=env, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"deploy {app}: {done.stderr}")
    platform.call("snap")  # the first replica boots cold and is checkpointed
    platform.wait_for_snapshot()
    return platform


def measure(folder: Path, rounds: int, calls: int, quiet: bool) -> dict[str, dict[str, Any]]:
    """Both platforms up at once; each round measures both, in turn (the order swapped
    every round), so that a change in the machine's load weighs on both alike."""
    runs: dict[str, dict[str, Any]] = {
        side: {"cold": [], "restore": [], "kinds": [], "call": []} for side in SIDES
    }
    with stopped_at_exit() as started:
        platforms = {}
        for side in SIDES:
            (folder / side).mkdir()
            platforms[side] = start(folder / side, side == "on", started)
        for index in range(rounds):
            order = SIDES if index % 2 == 0 else SIDES[::-1]
            for side in order:
                platform, result = platforms[side], runs[side]
                platform.wait_for_zero()
                cold, _ = platform.call("cold")
                platform.wait_for_zero()
                restored, last = platform.call("snap")
                result["cold"].append(cold)
                result["restore"].append(restored)
                result["kinds"].append(last.get("kind"))
                name = "sandbox" if side == "on" else "no sandbox"
                timing = f"cold {cold:.3f} s, restore {restored:.3f} s"
                progress(quiet, f"round {index + 1}, {name}: {timing}")
        for side in SIDES:
            platforms[side].call("cold")  # warm
        for _ in range(calls):
            for side in SIDES:
                runs[side]["call"].append(platforms[side].call("cold")[0])
    return runs


def verdict(ok: bool) -> str:
    return "within reach" if ok else "OUT OF REACH"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="starts from zero (default 5)")
    parser.add_argument("--calls", type=int, default=50, help="warm calls (default 50)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ember-bench-sandbox-") as folder:
        runs = measure(Path(folder), args.rounds, args.calls, args.quiet)
    if any(kind != "restore" for kind in runs["on"]["kinds"] + runs["off"]["kinds"]):
        print(f"warning: not every snap start was a restore: {runs}", file=sys.stderr)
    med = {
        (side, what): statistics.median(runs[side][what])
        for side in runs
        for what in ("cold", "restore", "call")
    }
    added = {what: med[("on", what)] - med[("off", what)] for what in ("cold", "restore", "call")}
    report = {
        "medians_s": {f"{side} {what}": value for (side, what), value in med.items()},
        "added_s": added,
        "ratios": {what: med[("on", what)] / med[("off", what)] for what in added},
        "within_reach": {
            "cold": added["cold"] <= REACH_COLD_S,
            "restore": added["restore"] <= REACH_RESTORE_S,
        },
        "runs": runs,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{'':24}{'sandbox':>10}{'no sandbox':>12}{'added':>10}{'ratio':>8}")
    for what, title in (("cold", "cold start"), ("restore", "restore"), ("call", "warm call")):
        on, off = med[("on", what)], med[("off", what)]
        print(
            f"{title + ' (median)':24}{on * 1000:>8.1f}ms{off * 1000:>10.1f}ms"
            f"{added[what] * 1000:>8.1f}ms{on / off:>8.2f}"
        )
    print(f"cold start: sandbox adds <= 100 ms: {verdict(report['within_reach']['cold'])}")
    print(f"restore: sandbox adds <= 20 ms: {verdict(report['within_reach']['restore'])}")
    print(f"per call: {added['call'] * 1000:+.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
