"""`ember deploy`'s image builds: each endpoint's `image=` built before the deploy, on a
worker node of the platform, its output streamed here. A built image builds nothing
(one request says so). The local files of copy steps travel with the request: each
step's file or folder as one tar, uploaded to the control plane first, since the node
that builds may be another machine."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import httpx

from ember.cli.common import check
from ember.errors import InvalidError
from ember.wire.spec import AppManifest

COPY_KINDS = ("local_dir", "local_file")
FILES_MEMBER = "file"  # a local_file step's one member (the worker's node_builds.py)
BUILD_TIMEOUT = httpx.Timeout(60.0, read=3600.0)  # a step may be quiet for long


def _clean(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """The same bytes for the same files: no owners, times or mode bits but the kind's
    and the executable ones (what the step's digest counts)."""
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    if info.isreg():
        info.mode = 0o755 if info.mode & 0o111 else 0o644
    elif info.isdir():
        info.mode = 0o755
    return info


def pack_step_files(step: dict[str, Any], out: IO[bytes]) -> None:
    """A copy step's file or folder (its `local` path) as a tar written to `out`."""
    local = Path(step["local"])
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        if step["kind"] == "local_file":
            tar.add(local, arcname=FILES_MEMBER, recursive=False, filter=_clean)
            return
        for folder, dirs, files in os.walk(local):
            dirs.sort()
            for name in sorted(dirs + files):
                path = Path(folder) / name
                mode = path.lstat().st_mode
                if not (stat.S_ISDIR(mode) or stat.S_ISLNK(mode) or stat.S_ISREG(mode)):
                    raise InvalidError(f"{path}: only files, folders and links are copied")
                relative = path.relative_to(local).as_posix()
                tar.add(path, arcname=relative, recursive=False, filter=_clean)


def _chunks(handle: IO[bytes]) -> Iterator[bytes]:
    handle.seek(0)
    while chunk := handle.read(1024 * 1024):
        yield chunk


def upload_files(client: httpx.Client, image: dict[str, Any]) -> dict[str, str]:
    """Each copy step's files uploaded; {its layer digest: the tar's sha256}."""
    files: dict[str, str] = {}
    for step in image["steps"]:
        if step["kind"] not in COPY_KINDS:
            continue
        with tempfile.TemporaryFile() as out:
            pack_step_files(step, out)
            out.seek(0)
            digest = hashlib.sha256()
            for chunk in _chunks(out):
                digest.update(chunk)
            sha256 = digest.hexdigest()
            check(client.put(f"/v1/image-files/sha256:{sha256}", content=_chunks(out)), (201,))
        files[step["digest"]] = sha256
    return files


def build_image(
    client: httpx.Client, image: dict[str, Any], say: Callable[[str], None]
) -> dict[str, Any]:
    """Build `image` unless it is built, its output to `say`; its last line's summary.
    InvalidError when a step fails (the step, its command and its last lines)."""
    digest = image["digest"]
    if check(client.get(f"/v1/image-builds/{digest}")).get("built"):
        say(f"image {digest[7:19]}: built already, nothing to build")
        return {"built": 0}
    body = {"image": image, "files": upload_files(client, image)}
    done: dict[str, Any] | None = None
    with client.stream("POST", "/v1/image-builds", json=body, timeout=BUILD_TIMEOUT) as answer:
        if answer.status_code != 200:
            answer.read()
            check(answer)
        for text in answer.iter_lines():
            if not text.strip():
                continue
            message = json.loads(text)
            if "line" in message:
                say(str(message["line"]))
            if message.get("done"):
                done = message
    if done is None:
        raise InvalidError(f"the build of image {digest[7:19]} ended without a word")
    if done.get("error"):
        raise InvalidError(f"image {digest[7:19]} did not build:\n{done['error']}")
    return done


def build_images(client: httpx.Client, manifest: AppManifest) -> None:
    """Every endpoint's image built (each image once), output on standard error."""

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    seen: set[str] = set()
    for spec in manifest.endpoints:
        image = spec.settings.image
        if image is None or image["digest"] in seen:
            continue
        seen.add(image["digest"])
        try:
            build_image(client, image, say)
        except InvalidError as exc:
            raise InvalidError(f"endpoint {spec.name}: {exc}") from None
