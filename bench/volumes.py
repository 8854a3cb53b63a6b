"""ember.Volume transfers against a bare HTTPS file server, in the same run.

The baseline is a Starlette app on uvicorn, behind the same TLS certificate, that writes
an uploaded body to a file (synced, then renamed, as the blob store does) and streams a
file back: the least any HTTPS file store does. The platform's side is the SDK's
`Volume.upload` and `Volume.download` through `ember server` (token check, hashing,
the state store's record, content-addressed blobs). Both sides are driven by httpx
from this process, and they alternate round by round.

Reported: MB/s for one large file each way, and files/s for a folder of small files,
with the platform/bare ratio of each.

    .venv/bin/python bench/volumes.py               # about a minute
    .venv/bin/python bench/volumes.py --quick       # 16 MB, 20 small files, one round
    .venv/bin/python bench/volumes.py --mb 1024     # a larger file
    .venv/bin/python bench/volumes.py --json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import ssl
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from procs import (
    Parts,
    ServerProcess,
    isolated_env,
    progress,
    server_url,
    stopped_at_exit,
    wait_for_line,
)

from ember.config import ClientConfig
from ember.state.volumes import Volume

BOOT_TIMEOUT_S = 120.0
CHUNK_BYTES = 1024 * 1024

BARE_APP = """\
import os
import sys
import tempfile
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

ROOT = Path(sys.argv[3])


async def put(request):
    target = ROOT / request.path_params["name"]
    fd, tmp = tempfile.mkstemp(dir=ROOT)
    size = 0
    with os.fdopen(fd, "wb") as handle:
        async for chunk in request.stream():
            size += len(chunk)
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, target)
    return JSONResponse({"size": size})


def chunks(path):
    with open(path, "rb") as handle:
        while chunk := handle.read(1024 * 1024):
            yield chunk


async def get(request):
    path = ROOT / request.path_params["name"]
    return StreamingResponse(chunks(path), headers={"Content-Length": str(path.stat().st_size)})


app = Starlette(
    routes=[
        Route("/files/{name}", put, methods=["PUT"]),
        Route("/files/{name}", get, methods=["GET"]),
    ]
)

if __name__ == "__main__":
    import socket

    cert, key = sys.argv[1:3]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    print(f"serving at https://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(
        app, ssl_certfile=cert, ssl_keyfile=key, log_level="warning", access_log=False,
        lifespan="off",
    )
    uvicorn.Server(config).run(sockets=[sock])
"""


def _chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            yield chunk


def _timed(action: Callable[[], Any]) -> float:
    began = time.perf_counter()
    action()
    return time.perf_counter() - began


class Bare:
    """The baseline's client: the same httpx streaming the SDK does, without the platform."""

    def __init__(self, url: str, ca: Path) -> None:
        self.client = httpx.Client(
            base_url=url, verify=ssl.create_default_context(cafile=str(ca)), timeout=600
        )

    def upload(self, local: Path, name: str) -> None:
        self.client.put(f"/files/{name}", content=_chunks(local)).raise_for_status()

    def download(self, name: str, local: Path) -> None:
        with self.client.stream("GET", f"/files/{name}") as response, local.open("wb") as out:
            response.raise_for_status()
            for chunk in response.iter_bytes(CHUNK_BYTES):
                out.write(chunk)


@dataclass
class Side:
    upload: Callable[[], Any]
    download: Callable[[Path], Any]
    small: Callable[[], Any]
    reset: Callable[[], Any]


def run(args: argparse.Namespace, parts: Parts, times: dict[str, dict[str, list[float]]]) -> None:
    """Fill `times` (side -> phase -> seconds) round by round."""
    with (
        tempfile.TemporaryDirectory(prefix="ember-bench-volumes-") as tmp,
        stopped_at_exit() as started,
    ):
        work = Path(tmp)
        env = isolated_env(work)
        parts.now = "writing the files"
        progress(args.quiet, f"writing a {args.mb} MB file and {args.files} small files ...")
        big = work / "big.bin"
        with big.open("wb") as handle:
            for _ in range(args.mb):
                handle.write(os.urandom(1024 * 1024))
        small = work / "small"
        small.mkdir()
        for index in range(args.files):
            (small / f"{index:04d}.bin").write_bytes(os.urandom(args.small_kb * 1024))
        parts.now = "starting the servers"
        progress(args.quiet, "starting ember server and the bare file server ...")
        command = [sys.executable, "-m", "ember.cli.main", "server", "--state-dir"]
        command += [str(work / "state"), "--port", "0", "--no-worker"]
        platform_server = ServerProcess.start("ember server", command, work / "ember.log", env)
        started.append(platform_server)
        url = server_url(platform_server, BOOT_TIMEOUT_S)
        state = work / "state"
        (work / "bare_app.py").write_text(BARE_APP)
        (work / "bare-files").mkdir()
        bare_command = [sys.executable, str(work / "bare_app.py"), str(state / "server.pem")]
        bare_command += [str(state / "server-key.pem"), str(work / "bare-files")]
        bare_server = ServerProcess.start("bare server", bare_command, work / "bare.log", env)
        started.append(bare_server)
        bare_url = wait_for_line(
            bare_server.process,
            bare_server.log,
            bare_server.name,
            r"serving at (https://\S+)",
            BOOT_TIMEOUT_S,
        )[1]
        progress(args.quiet, f"platform at {url}, bare file server at {bare_url}")
        config = ClientConfig(**json.loads((work / "config.json").read_text()))
        volume = Volume("bench", app="bench", config=config)
        volume.clear()
        # Closed before the servers stop: uvicorn waits for a kept connection to close.
        bare = Bare(bare_url, state / "ca.pem")
        with bare.client:
            digest = hashlib.sha256(big.read_bytes()).hexdigest()
            sides: dict[str, Side] = {
                "platform": Side(
                    upload=lambda: volume.upload(big, "big.bin"),
                    download=lambda path: volume.download("big.bin", path),
                    small=lambda: volume.upload(small, "small"),
                    reset=volume.clear,  # so the content is stored anew, not found stored
                ),
                "bare": Side(
                    upload=lambda: bare.upload(big, "big.bin"),
                    download=lambda path: bare.download("big.bin", path),
                    small=lambda: [
                        bare.upload(f, f"small-{f.name}") for f in sorted(small.iterdir())
                    ],
                    reset=lambda: None,
                ),
            }
            for number in range(args.rounds):
                progress(args.quiet, f"round {number + 1}/{args.rounds}")
                order = ["platform", "bare"] if number % 2 == 0 else ["bare", "platform"]
                for name in order:
                    side, back = sides[name], work / f"back-{name}.bin"
                    parts.now = f"round {number + 1}, {name}"
                    side.reset()
                    times[name]["upload"].append(_timed(side.upload))
                    times[name]["download"].append(_timed(partial(side.download, back)))
                    times[name]["small"].append(_timed(side.small))
                    if hashlib.sha256(back.read_bytes()).hexdigest() != digest:
                        raise RuntimeError(f"{name}: the downloaded file differs from the upload")
                    back.unlink()


PHASES = {  # phase -> (figure, its name in the table)
    "upload": ("upload_mb_s", "upload (MB/s)"),
    "download": ("download_mb_s", "download (MB/s)"),
    "small": ("small_files_s", "small files up (files/s)"),
}


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Each side's figures from the phases it has times for; a figure's ratio once both
    sides have it."""
    amounts = {"upload": raw["mb"], "download": raw["mb"], "small": raw["files"]}
    rows: dict[str, Any] = {}
    for side, phases in raw["times"].items():
        rows[side] = {
            PHASES[phase][0]: amounts[phase] / statistics.median(values)
            for phase, values in phases.items()
            if values
        }
    rows["ratio"] = {
        key: rows["platform"][key] / rows["bare"][key]
        for key in rows["bare"]
        if key in rows["platform"]
    }
    return rows


def report(raw: dict[str, Any], rows: dict[str, Any]) -> str:
    lines = [
        f"  one {raw['mb']} MB file each way; {raw['files']} files of {raw['small_kb']} KB; "
        "medians over the rounds",
        "",
        f"{'':28}{'bare':>10}{'platform':>12}{'platform/bare':>16}",
    ]

    def cell(side: str, key: str, width: int, form: str) -> str:
        value = rows[side].get(key)
        return " " * width if value is None else format(value, form).rjust(width)

    for key, name in PHASES.values():
        if key in rows["bare"] or key in rows["platform"]:
            bare, platform = cell("bare", key, 10, ".1f"), cell("platform", key, 12, ".1f")
            ratio = cell("ratio", key, 15, ".2f") + ("x" if key in rows["ratio"] else "")
            lines.append(f"{name:28}{bare}{platform}{ratio}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=None, help="the large file's MB (256; quick 16)")
    parser.add_argument("--files", type=int, default=None, help="small files (200; quick 20)")
    parser.add_argument("--small-kb", type=int, default=64, help="each small file's size")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per side (3; quick 1)")
    parser.add_argument("--quick", action="store_true", help="16 MB, 20 small files, one round")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    for name, (full, quick) in {"mb": (256, 16), "files": (200, 20), "rounds": (3, 1)}.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    parts = Parts("bench/volumes.py")
    times: dict[str, dict[str, list[float]]] = {
        side: {"upload": [], "download": [], "small": []} for side in ("platform", "bare")
    }
    failed = None
    try:
        run(args, parts, times)
    except Exception as error:
        failed = error
    raw = {"mb": args.mb, "files": args.files, "small_kb": args.small_kb, "times": times}
    rows = summarize(raw)
    if failed is not None:
        rows["failed"] = parts.line(failed)
    print(json.dumps(rows, indent=2) if args.json else report(raw, rows), flush=True)
    if failed is not None:
        parts.say(failed)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
