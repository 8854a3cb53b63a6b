"""`ember.Volume`: files an app's replicas and clients share, kept by the control plane.

    outputs = ember.Volume("outputs")          # in a replica: the replica's app
    (outputs.path / "run-17.json").write_text(...)
    outputs.commit()                            # publish this node's changes
    outputs.reload()                            # take in what others committed

    images = ember.Volume("images", app="gen")  # outside a replica, name the app
    images.write_file("cat.png", data)
    images.read_file("cat.png")

`path` is a local copy of the volume, made on first use: one folder per node, shared by
the node's replicas of the app (outside a replica, under ~/.ember/volumes). `commit()`
uploads the files added or changed there since the copy last met the volume, and
removes from the volume those deleted there; `reload()` brings in the volume's files
that changed. Each file is written whole, and the last commit of a file wins: commit
before reloading to keep your changes. Async code has twins that run on a thread:
`await v.aread_file(...)`, `awrite_file`, `alistdir`, `aremove`, `areload`, `acommit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from ember.client import error_from_response, request_timeout, shared_client
from ember.config import ClientConfig, load_config
from ember.errors import InvalidError, NotFoundError
from ember.labels import current_app
from ember.settings import check_name
from ember.volume_paths import check_volume_path, check_volume_prefix

VOLUMES_DIR_ENV = "EMBER_VOLUMES_DIR"  # the node's folder of local copies, in a replica
REQUEST_TIMEOUT_S = 30.0
TRANSFER_TIMEOUT_S = 3600.0  # a file's upload or download, however large
CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class VolumeFile:
    path: str
    size: int
    digest: str  # "sha256:…" of its content
    modified: float  # when it was written to the volume (Unix time)


@dataclass(frozen=True)
class VolumeSummary:
    name: str
    files: int
    bytes: int


def list_volumes(app: str, config: ClientConfig | None = None) -> list[VolumeSummary]:
    """The app's volumes that hold a file, by name."""
    app = check_name("app", app)
    client = shared_client(config or load_config())
    response = _ok(
        client.get(f"/v1/apps/{app}/volumes", timeout=request_timeout(REQUEST_TIMEOUT_S))
    )
    return [VolumeSummary(v["name"], v["files"], v["bytes"]) for v in response.json()["volumes"]]


_volumes: weakref.WeakSet[Volume] = weakref.WeakSet()


def forget_local_copies() -> None:
    """After a restore: the image's volumes bring their copies up to date on next use,
    as time has passed (and the node may be another)."""
    for volume in list(_volumes):
        volume._synced_into = None


def volumes_root() -> Path:
    configured = os.environ.get(VOLUMES_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".ember" / "volumes"


def file_digest(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            hasher.update(chunk)
    return "sha256:" + hasher.hexdigest()


def upload_plan(local: str | Path, remote: str = "") -> list[tuple[Path, str]]:
    """(local file, path in the volume) of each file an upload of `local` (a file, or a
    folder and all it holds) sends to `remote` (default: its own name)."""
    local = Path(local)
    target = remote.strip("/") or local.name
    if local.is_file():
        return [(local, target)]
    if not local.is_dir():
        raise InvalidError(f"{local} is neither a file nor a folder")
    files = sorted(p for p in local.rglob("*") if p.is_file())
    return [(file, f"{target}/{file.relative_to(local).as_posix()}") for file in files]


def _file_of(answer: dict[str, Any]) -> VolumeFile:
    return VolumeFile(answer["path"], answer["size"], answer["digest"], answer["modified"])


def _chunks_of(path: Path) -> Iterator[bytes]:
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            yield chunk


class Volume:
    def __init__(
        self, name: str, *, app: str | None = None, config: ClientConfig | None = None
    ) -> None:
        self.name = check_name("volume", name)
        # Found when first used: a module-level volume is made when `ember deploy`
        # imports the file too, outside any replica.
        self._app = None if app is None else check_name("app", app)
        self._config = config
        self._synced_into: Path | None = None  # where `path` was last brought up to date
        _volumes.add(self)

    def __repr__(self) -> str:
        return f"ember.Volume({self.name!r}, app={self._app or current_app()!r})"

    @property
    def app(self) -> str:
        if self._app is None:
            app = current_app()
            if app is None:
                raise InvalidError(
                    f"ember.Volume({self.name!r}) outside a replica needs app= "
                    "(the app it belongs to)"
                )
            self._app = check_name("app", app)
        return self._app

    @property
    def _api(self) -> str:
        return f"/v1/apps/{self.app}/volumes/{self.name}"

    @property
    def config(self) -> ClientConfig:
        if self._config is None:
            self._config = load_config()  # read when first used, not at import
        return self._config

    # ----- the volume itself ---------------------------------------------------------
    def _send(
        self, method: str, path: str, timeout: float = REQUEST_TIMEOUT_S, **kwargs: Any
    ) -> httpx.Response:
        client = shared_client(self.config)
        return client.request(method, path, timeout=request_timeout(timeout), **kwargs)

    def _file_url(self, path: str) -> str:
        return f"{self._api}/files/{quote(check_volume_path(path))}"

    def listdir(self, prefix: str = "") -> list[VolumeFile]:
        """Every file under `prefix` (a folder, or one file; "" for all), in path order."""
        params = {"prefix": check_volume_prefix(prefix)} if prefix.strip("/") else {}
        response = _ok(self._send("GET", self._api, params=params))
        return [_file_of(f) for f in response.json()["files"]]

    def read_file(self, path: str) -> bytes:
        response = _ok(self._send("GET", self._file_url(path), timeout=TRANSFER_TIMEOUT_S))
        return response.content

    def write_file(self, path: str, data: bytes | str) -> VolumeFile:
        """Set a file's content (text as UTF-8), in place of any it had."""
        content = data.encode() if isinstance(data, str) else data
        return self._put(path, content)

    def _put(self, path: str, content: bytes | Iterator[bytes]) -> VolumeFile:
        response = _ok(
            self._send("PUT", self._file_url(path), timeout=TRANSFER_TIMEOUT_S, content=content)
        )
        return _file_of(response.json())

    def remove(self, path: str, *, recursive: bool = False) -> int:
        """Remove a file, or with `recursive=True` a folder; how many files went."""
        params = {"recursive": "true"} if recursive else {}
        response = _ok(self._send("DELETE", self._file_url(path), params=params))
        return int(response.json()["removed"])

    def clear(self) -> int:
        """Remove every file of the volume; how many went."""
        response = _ok(self._send("DELETE", self._api))
        return int(response.json()["removed"])

    def upload(self, local: str | Path, remote: str = "") -> list[VolumeFile]:
        """A local file or folder into the volume, at `remote` (default: its own name)."""
        return [self._put(path, _chunks_of(file)) for file, path in upload_plan(local, remote)]

    def download(self, remote: str, local: str | Path) -> list[Path]:
        """A file of the volume, or a folder and all it holds, to `local` (into it, if
        it is a folder already and `remote` a file)."""
        remote = check_volume_path(remote)
        local = Path(local)
        written = []
        for file in self.listdir(remote):
            inside = file.path[len(remote) :].lstrip("/")
            if inside:
                target = local / inside
            else:  # `remote` is a file
                target = local / remote.rsplit("/", 1)[-1] if local.is_dir() else local
            self._fetch(file.path, target)
            written.append(target)
        if not written:
            raise NotFoundError(
                404, "not_found", f"volume {self.name} has no file or folder {remote}"
            )
        return written

    def _fetch(self, remote: str, target: Path, *, in_copy: bool = False) -> None:
        """A file into `target`, whole or not at all (a temporary file, then a rename).
        In the local copy (`in_copy`), a folder where the volume now has a file goes."""
        target.parent.mkdir(parents=True, exist_ok=True)
        client = shared_client(self.config)
        fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=".ember-")
        try:
            with (
                os.fdopen(fd, "wb") as handle,
                client.stream(
                    "GET", self._file_url(remote), timeout=request_timeout(TRANSFER_TIMEOUT_S)
                ) as response,
            ):
                if response.status_code != 200:
                    raise error_from_response(response.status_code, response.read())
                for chunk in response.iter_bytes(CHUNK_BYTES):
                    handle.write(chunk)
            if in_copy and target.is_dir():
                shutil.rmtree(target)
            os.replace(temporary, target)  # a folder in the way elsewhere: IsADirectoryError
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    # ----- the local copy ------------------------------------------------------------
    @property
    def path(self) -> Path:
        """The local copy's folder, brought up to date on first use (in each place: a
        replica restored on another node gets its own node's copy)."""
        folder, _ = self._local()
        if self._synced_into != folder:
            self.reload()
        return folder

    def _local(self) -> tuple[Path, Path]:
        parent = volumes_root() / self.app
        return parent / self.name, parent / f".{self.name}.state.json"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[tuple[Path, dict[str, dict[str, Any]]]]:
        """The local copy and what it last had in common with the volume, held against
        the node's other replicas for the length of a reload or commit."""
        folder, state_file = self._local()
        folder.mkdir(parents=True, exist_ok=True)
        with (state_file.parent / f".{self.name}.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                state = json.loads(state_file.read_text()) if state_file.exists() else {}
            except ValueError:
                state = {}  # a damaged record: every file is compared by its content
            yield folder, state
            temporary = state_file.with_suffix(".tmp")
            temporary.write_text(json.dumps(state))
            os.replace(temporary, state_file)

    @staticmethod
    def _stamp(file: Path, digest: str) -> dict[str, Any]:
        stat = file.stat()
        return {"digest": digest, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}

    @staticmethod
    def _unchanged(file: Path, known: dict[str, Any] | None) -> bool:
        if known is None or not file.is_file():
            return False
        stat = file.stat()
        return stat.st_size == known["size"] and stat.st_mtime_ns == known["mtime_ns"]

    def reload(self) -> list[str]:
        """Bring the local copy up to date with the volume; the paths that changed.

        Only files that changed in the volume are fetched: changes made here and not yet
        committed to others stay, as do files made here. Files the volume no longer has
        are removed here unless changed here since."""
        remote = {f.path: f for f in self.listdir()}
        changed = []
        with self._locked() as (folder, state):
            for path, file in remote.items():
                local = folder / path
                known = state.get(path)
                if known and known["digest"] == file.digest:
                    continue  # as it was when this copy last met the volume
                self._fetch(path, local, in_copy=True)
                state[path] = self._stamp(local, file.digest)
                changed.append(path)
            for path in [p for p in state if p not in remote]:
                local = folder / path
                if self._unchanged(local, state.pop(path)):
                    local.unlink()
                    changed.append(path)
                    _remove_empty_parents(local.parent, folder)
        self._synced_into = folder
        return changed

    def commit(self) -> list[str]:
        """Upload what changed in the local copy, and remove from the volume what was
        deleted here; the paths that changed."""
        changed = []
        with self._locked() as (folder, state):
            present = set()
            for local in sorted(p for p in folder.rglob("*") if p.is_file()):
                if local.name.startswith(".ember-"):
                    continue  # a download in progress
                path = local.relative_to(folder).as_posix()
                present.add(path)
                known = state.get(path)
                if self._unchanged(local, known):
                    continue
                digest = file_digest(local)
                if known is None or known["digest"] != digest:
                    self._put(path, _chunks_of(local))
                    changed.append(path)
                state[path] = self._stamp(local, digest)
            for path in [p for p in state if p not in present]:
                response = self._send("DELETE", self._file_url(path))
                if response.status_code not in (200, 404):  # 404: gone already
                    raise error_from_response(response.status_code, response.content)
                del state[path]
                changed.append(path)
        self._synced_into = folder
        return changed

    # ----- asyncio twins: the same work on a thread, so an async endpoint's loop runs on
    async def alistdir(self, prefix: str = "") -> list[VolumeFile]:
        return await asyncio.to_thread(self.listdir, prefix)

    async def aread_file(self, path: str) -> bytes:
        return await asyncio.to_thread(self.read_file, path)

    async def awrite_file(self, path: str, data: bytes | str) -> VolumeFile:
        return await asyncio.to_thread(self.write_file, path, data)

    async def aremove(self, path: str, *, recursive: bool = False) -> int:
        return await asyncio.to_thread(self.remove, path, recursive=recursive)

    async def areload(self) -> list[str]:
        return await asyncio.to_thread(self.reload)

    async def acommit(self) -> list[str]:
        return await asyncio.to_thread(self.commit)


def _remove_empty_parents(folder: Path, root: Path) -> None:
    while folder != root and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent


def _ok(response: httpx.Response) -> httpx.Response:
    if response.status_code != 200:
        raise error_from_response(response.status_code, response.content)
    return response
