"""`ember serve FILE.py`: deploy, then redeploy on every save until Ctrl+C stops the app."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from ember.cli.apps.deploy import default_app_name
from ember.cli.apps.watched_files import (
    FileId,
    GitIgnore,
    load_git_ignores,
    own_outputs,
    watched_mtimes,
)
from ember.cli.common import admin_client, check, stop_on_signals
from ember.declarations.settings import check_name
from ember.errors import InvalidError

POLL_SECONDS = 0.5
# A burst of saves (an editor's write and rename, a formatter, `git checkout`) is one
# change: the deploy waits until the files stay unchanged this long...
QUIET_SECONDS = 0.3
# ...but no longer than this, for a file that some program keeps writing.
MAX_SETTLE_SECONDS = 5.0


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve",
        help="deploy and redeploy on every save",
        description="Deploy FILE.py, watch its folder, and redeploy whenever a file that "
        "the deploy bundles changes (not one .emberignore or .gitignore names, nor the "
        "file this command's output goes to); a burst of changes redeploys once. "
        "Ctrl+C (or SIGTERM) stops the app.",
    )
    parser.add_argument("file", type=Path, metavar="FILE.py")
    parser.add_argument("--name", help="app name (as for `ember deploy`)")
    parser.add_argument("--keep", action="store_true", help="leave the app running on exit")
    parser.set_defaults(run=run)


def snapshot_mtimes(
    folder: Path, ignores: list[GitIgnore] | None = None, outputs: frozenset[FileId] = frozenset()
) -> dict[Path, float]:
    """The watched files with their times: a change to any other file (ignored by
    `.emberignore` or `.gitignore`, a cache, our own log) does not redeploy. A folder
    that changes under the walk is looked at again."""
    if ignores is None:
        ignores = load_git_ignores(folder)
    while (mtimes := watched_mtimes(folder, ignores, outputs)) is None:
        time.sleep(0.05)
    return mtimes


def _changed(before: dict[Path, float], after: dict[Path, float], folder: Path) -> list[str]:
    paths = set(before) ^ set(after) | {p for p in after if before.get(p) != after[p]}
    return sorted(str(p.relative_to(folder)) for p in paths)


def _settled(
    folder: Path, seen: dict[Path, float], ignores: list[GitIgnore], outputs: frozenset[FileId]
) -> dict[Path, float]:
    """The files once they have stayed unchanged for QUIET_SECONDS (or MAX_SETTLE_SECONDS
    have passed): what a burst of saves ends with."""
    deadline = time.monotonic() + MAX_SETTLE_SECONDS
    while True:
        time.sleep(QUIET_SECONDS)
        current = snapshot_mtimes(folder, ignores, outputs)
        if current == seen or time.monotonic() >= deadline:
            return current
        seen = current


def _deploy(file: Path, app: str) -> None:
    # A fresh process per deploy, so edited modules are imported anew.
    command = [sys.executable, "-m", "ember.cli.main", "deploy", str(file), "--name", app]
    subprocess.run(command, check=False)


def run(args: argparse.Namespace) -> int:
    if not args.file.is_file():
        raise InvalidError(f"no such file: {args.file}")
    app = check_name("app", default_app_name(args.file) if args.name is None else args.name)
    stop_on_signals()  # Ctrl+C, or SIGTERM from `kill`, stops the app
    folder = args.file.resolve().parent
    outputs = own_outputs()
    _deploy(args.file, app)
    ignores = load_git_ignores(folder)
    seen = snapshot_mtimes(folder, ignores, outputs)
    print(f"watching {folder} for changes (Ctrl+C stops app {app})", flush=True)
    try:
        while True:
            time.sleep(POLL_SECONDS)
            ignores = load_git_ignores(folder)  # an edited .gitignore counts at once
            current = snapshot_mtimes(folder, ignores, outputs)
            if current != seen:
                current = _settled(folder, current, ignores, outputs)
                changed = _changed(seen, current, folder)
                if not changed:
                    continue  # changed and changed back (an editor's atomic save)
                print(f"changed: {', '.join(changed)}; redeploying", flush=True)
                seen = current
                _deploy(args.file, app)
    except KeyboardInterrupt:
        if not args.keep:
            with admin_client() as client:
                check(client.delete(f"/v1/apps/{app}"))
            print(f"stopped app {app}")
    return 0
