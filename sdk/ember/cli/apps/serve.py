"""`ember serve FILE.py`: deploy, then redeploy on every save until Ctrl+C stops the app."""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

from ember.bundle import EXCLUDED_NAMES, EXCLUDED_SUFFIXES
from ember.cli.apps.deploy import default_app_name
from ember.cli.common import admin_client, check, stop_on_signals
from ember.endpoints.settings import check_name
from ember.errors import InvalidError
from ember.ignore_rules import leaves_out, load_rules

POLL_SECONDS = 0.5


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve",
        help="deploy and redeploy on every save",
        description="Deploy FILE.py, watch its folder, and redeploy whenever a file changes. "
        "Ctrl+C (or SIGTERM) stops the app.",
    )
    parser.add_argument("file", type=Path, metavar="FILE.py")
    parser.add_argument("--name", help="app name (as for `ember deploy`)")
    parser.add_argument("--keep", action="store_true", help="leave the app running on exit")
    parser.set_defaults(run=run)


def snapshot_mtimes(folder: Path) -> dict[Path, float]:
    """The files a deploy would bundle, with their times: a change to any other file
    (ignored by `.emberignore`, a cache) does not redeploy. A file or folder removed
    while it is read (an editor's swap file) is simply not there."""
    mtimes = {}
    rules = load_rules(folder)
    # os.walk passes over folders that vanish under it, where rglob would raise.
    for parent, folders, files in os.walk(folder):
        folders[:] = [name for name in folders if name not in EXCLUDED_NAMES]
        for name in files:
            path = Path(parent, name)
            relative = path.relative_to(folder)
            if name in EXCLUDED_NAMES or name.endswith(EXCLUDED_SUFFIXES):
                continue
            if rules and leaves_out(rules, relative.as_posix()):
                continue
            try:
                status = path.stat()
            except FileNotFoundError:
                continue
            if stat.S_ISREG(status.st_mode):
                mtimes[path] = status.st_mtime
    return mtimes


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
    _deploy(args.file, app)
    seen = snapshot_mtimes(folder)
    print(f"watching {folder} for changes (Ctrl+C stops app {app})", flush=True)
    try:
        while True:
            time.sleep(POLL_SECONDS)
            current = snapshot_mtimes(folder)
            if current != seen:
                changed = sorted(
                    str(p.relative_to(folder))
                    for p in set(current) ^ set(seen)
                    | {p for p in current if seen.get(p) != current[p]}
                )
                print(f"changed: {', '.join(changed)}; redeploying", flush=True)
                seen = current
                _deploy(args.file, app)
    except KeyboardInterrupt:
        if not args.keep:
            with admin_client() as client:
                check(client.delete(f"/v1/apps/{app}"))
            print(f"stopped app {app}")
    return 0
