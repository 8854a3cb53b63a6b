"""The process that serves one image's lazy file system on a node:

    python -m ember_worker.images.lazy.mount_process --index FILE --mountpoint DIR --store URL ...

`--store` is the control plane (`https://HOST:PORT`, or several, comma-separated, the
one in use first; with `--token-file` and `--ca`),
or a `file://` folder holding layer tars named by their sha256 (tests, benchmarks).
It mounts read-only for every user (`allow_other`; the kernel checks modes:
`default_permissions`), prints `ready` once mounted, writes its counts to `--stats`
while they change, and unmounts on SIGTERM or when its `--lifeline` pipe closes: the
agent holds the other end, so a mount never outlives the agent (whose replicas end
with it), however it ends. It runs in a session of its own: a signal to the agent's
process group reaches the agent, which stops its replicas before its mounts."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pyfuse3
import trio

from ember_worker.images.lazy.blob_origin import LayerBlobOrigin, StoreConnection
from ember_worker.images.lazy.file_index import FileIndex
from ember_worker.images.lazy.image_contents import ImageContents
from ember_worker.images.lazy.image_fs import ImageFs
from ember_worker.weights.cache.disk_cache import DiskCache
from ember_worker.weights.origins.file import FileOrigin
from ember_worker.weights.origins.origin import Origin

READY = "ready"
MOUNT_OPTIONS = {
    "fsname=ember-image",
    "subtype=ember",
    "ro",
    "allow_other",
    "default_permissions",
}


def origins(store: str, token: str, ca: str | None) -> Callable[[str, int], Origin]:
    if store.startswith("file://"):
        folder = store.rstrip("/")
        return lambda sha256, size: FileOrigin(f"{folder}/{sha256}")
    connection = StoreConnection(store.split(","), token, ca)
    return lambda sha256, size: LayerBlobOrigin(connection, sha256, size)


async def _serve(contents: ImageContents, stats: Path | None, lifeline: int | None) -> None:
    async with trio.open_nursery() as nursery:

        async def on_lifeline() -> None:
            assert lifeline is not None
            await trio.lowlevel.wait_readable(lifeline)  # nothing is written: its end
            pyfuse3.terminate()

        async def on_signals() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
                async for _ in received:
                    pyfuse3.terminate()
                    return

        async def write_stats() -> None:
            assert stats is not None
            last: dict[str, int] | None = None
            while True:
                now = contents.stats()
                if now != last:
                    temp = stats.with_suffix(".tmp")
                    temp.write_text(json.dumps(now))
                    os.replace(temp, stats)
                    last = now
                await trio.sleep(0.2)

        nursery.start_soon(on_signals)
        if lifeline is not None:
            nursery.start_soon(on_lifeline)
        if stats is not None:
            nursery.start_soon(write_stats)
        await pyfuse3.main(min_tasks=4, max_tasks=64)
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ember-image-mount")
    parser.add_argument("--index", required=True, type=Path)
    parser.add_argument("--mountpoint", required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--token-file", type=Path)
    parser.add_argument("--ca")
    parser.add_argument("--cache", type=Path, help="the node's disk cache of layer tars")
    parser.add_argument("--cache-bytes", type=int, default=50 * 2**30)
    parser.add_argument("--memory-bytes", type=int, default=256 * 2**20)
    parser.add_argument("--stats", type=Path)
    # A pipe's read end whose writer is the agent: when it closes (the agent stopped or
    # died, and its replicas with it), the mount goes too.
    parser.add_argument("--lifeline", type=int)
    # Paths the sandbox mounts over or starts in, made where the image lacks them.
    parser.add_argument("--mount-file", action="append", default=[])
    parser.add_argument("--mount-dir", action="append", default=[])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="ember-image-mount: %(message)s")

    index = FileIndex.from_bytes(args.index.read_bytes())
    index.add_mount_points(args.mount_file, args.mount_dir)
    token = args.token_file.read_text().strip() if args.token_file else ""
    disk = DiskCache(args.cache, args.cache_bytes) if args.cache else None
    contents = ImageContents(index, origins(args.store, token, args.ca), disk, args.memory_bytes)
    pyfuse3.init(ImageFs(index, contents), args.mountpoint, MOUNT_OPTIONS)
    print(READY, flush=True)
    try:
        trio.run(_serve, contents, args.stats, args.lifeline)
    finally:
        pyfuse3.close(unmount=True)
        contents.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
