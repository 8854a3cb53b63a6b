"""`ember volume`: list, upload, download and remove the files of an app's ember.Volume."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ember.cli.common import app_and_name, byte_size, table
from ember.errors import InvalidError
from ember.progress import Progress
from ember.state.volumes import Volume, list_volumes, upload_plan


def register(commands: argparse._SubParsersAction) -> None:
    volume = commands.add_parser(
        "volume",
        help="list, upload, download or remove an app's ember.Volume files",
        description="An app's volumes hold files its replicas and clients share "
        "(`ember.Volume(NAME)` in the code).",
    )
    actions = volume.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = actions.add_parser(
        "ls",
        help="an app's volumes, or a volume's files",
        description="With APP, list its volumes; with APP/NAME, the volume's files "
        "(under PREFIX, a folder, if given).",
    )
    ls.add_argument("target", metavar="APP[/NAME]")
    ls.add_argument("prefix", nargs="?", default="", metavar="PREFIX")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    ls.set_defaults(run=run_ls)
    put = actions.add_parser(
        "put",
        help="upload a file or folder",
        description="Upload LOCAL (a file, or a folder and all it holds) to REMOTE in the "
        "volume (default: LOCAL's name; a file goes into a REMOTE ending in /), in place of "
        "what is there.",
    )
    put.add_argument("target", metavar="APP/NAME")
    put.add_argument("local", type=Path, metavar="LOCAL")
    put.add_argument("remote", nargs="?", default="", metavar="REMOTE")
    put.set_defaults(run=run_put)
    get = actions.add_parser(
        "get",
        help="download a file or folder",
        description="Download REMOTE (a file, or a folder and all it holds) to LOCAL "
        "(default: REMOTE's name here; a file goes into LOCAL if it is a folder or ends in "
        "/; - writes a file to stdout).",
    )
    get.add_argument("target", metavar="APP/NAME")
    get.add_argument("remote", metavar="REMOTE")
    get.add_argument("local", nargs="?", default=None, metavar="LOCAL")
    get.set_defaults(run=run_get)
    rm = actions.add_parser(
        "rm",
        help="remove a file or folder",
        description="Remove PATH from the volume (-r: a folder and all it holds; "
        "--all: every file).",
    )
    rm.add_argument("target", metavar="APP/NAME")
    rm.add_argument("path", nargs="?", default=None, metavar="PATH")
    rm.add_argument("-r", "--recursive", action="store_true", help="PATH may be a folder")
    rm.add_argument("--all", action="store_true", help="remove every file of the volume")
    rm.set_defaults(run=run_rm)


def _volume(target: str) -> Volume:
    app, name = app_and_name(target)
    return Volume(name, app=app)


def run_ls(args: argparse.Namespace) -> int:
    if "/" not in args.target:
        volumes = list_volumes(args.target)
        if args.json:
            for v in volumes:
                print(json.dumps({"name": v.name, "files": v.files, "bytes": v.bytes}))
        elif volumes:
            rows = [[v.name, str(v.files), byte_size(v.bytes)] for v in volumes]
            print(table(rows, ["VOLUME", "FILES", "SIZE"]))
        else:
            print(f"app {args.target} has no volume with files")
        return 0
    files = _volume(args.target).listdir(args.prefix)
    if args.json:
        for f in files:
            print(json.dumps({"path": f.path, "size": f.size, "digest": f.digest}))
        return 0
    modified = "%Y-%m-%d %H:%M"
    rows = [
        [f.path, byte_size(f.size), time.strftime(modified, time.localtime(f.modified))]
        for f in files
    ]
    print(table(rows, ["PATH", "SIZE", "MODIFIED"]) if rows else "no files")
    return 0


def run_put(args: argparse.Namespace) -> int:
    volume = _volume(args.target)
    pairs = upload_plan(args.local, args.remote)
    progress = Progress(len(pairs), "volume put", unit="file", noun="files")
    total = 0
    try:
        for path, remote in pairs:
            total += volume.upload(path, remote)[0].size
            progress.update(True)
    finally:
        progress.close()
    print(f"uploaded {len(pairs)} files ({byte_size(total)}) to {args.target}", file=sys.stderr)
    return 0


def run_get(args: argparse.Namespace) -> int:
    volume = _volume(args.target)
    if args.local == "-":
        sys.stdout.buffer.write(volume.read_file(args.remote))
        sys.stdout.buffer.flush()
        return 0
    # As text: a trailing "/" says to put a file into that folder.
    local = args.local or args.remote.rstrip("/").rsplit("/", 1)[-1]
    written = volume.download(args.remote, local)
    print(f"downloaded {len(written)} files to {local}", file=sys.stderr)
    return 0


def run_rm(args: argparse.Namespace) -> int:
    volume = _volume(args.target)
    if args.all == (args.path is not None):
        raise InvalidError("name a PATH to remove, or --all")
    removed = volume.clear() if args.all else volume.remove(args.path, recursive=args.recursive)
    print(f"removed {removed} files from {args.target}")
    return 0
