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
that changed, and keeps what changed here and was not committed (a warning names a file
changed both here and in the volume: this copy's version stays until you commit it or
remove it). Each file is written whole, and the last commit of a file wins. Async code
has twins that run on a thread:
`await v.aread_file(...)`, `awrite_file`, `alistdir`, `aremove`, `areload`, `acommit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from stat import S_IMODE
from typing import Any
from urllib.parse import quote

import httpx

from ember.calling.client import error_from_response
from ember.calling.connections import request_timeout, shared_client
from ember.config import ClientConfig, load_config
from ember.declarations.settings import check_name
from ember.errors import EmberError, InvalidError, NotFoundError, RemoteError
from ember.state.volume_paths import (
    VOLUMES_DIR_ENV,
    check_volume_path,
    check_volume_prefix,
    parents,
    path_text,
)
from ember.wire.labels import app_here, check_app, current_app

REQUEST_TIMEOUT_S = 30.0
TRANSFER_TIMEOUT_S = 3600.0  # a file's upload or download, however large
CHUNK_BYTES = 1024 * 1024
LIST_PAGE_FILES = 100_000  # files asked for per listing request (the server's most)
DIGEST_HEADER = "X-Ember-Digest"  # the content's digest, on a file the volume sends
# A file being downloaded, beside its target; one of a local copy's fetches waits in a
# folder beside the copy instead (`.NAME.incoming`), so that no commit meets it.
TEMPORARY_NAME = re.compile(r"\.ember-download-[0-9a-f]{32}\.partial")
OLD_TEMPORARY_NAME = re.compile(r"\.ember-[a-z0-9_]{8}")  # mkstemp's, in older SDKs
STALE_TEMPORARY_S = TRANSFER_TIMEOUT_S  # a download this long untouched has ended

PathText = str | os.PathLike[str]
Content = bytes | bytearray | memoryview | str
log = logging.getLogger("ember.state.volumes")


@dataclass(frozen=True)
class VolumeFile:
    path: str
    size: int
    digest: str  # "sha256:…" of its content
    modified: float  # when it was written to the volume (Unix time)


class VolumeConflictError(InvalidError):
    """commit() could not upload these files of the local copy: the volume has a folder
    where each is a file here, or a file where each is inside a folder here."""

    def __init__(self, volume: str, conflicts: list[str]) -> None:
        super().__init__(
            f"ember.Volume({volume!r}).commit() left out {'; '.join(conflicts)}: rename or "
            "remove them in the local copy, or remove what is in their way from the volume "
            "(remove(PATH, recursive=True)); the rest was committed"
        )
        self.conflicts = conflicts


@dataclass(frozen=True)
class VolumeSummary:
    name: str
    files: int
    bytes: int


def list_volumes(app: str, config: ClientConfig | None = None) -> list[VolumeSummary]:
    """The app's volumes that hold a file, by name."""
    app = check_app(app)
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


def upload_plan(local: str | Path, remote: PathText = "") -> list[tuple[Path, str]]:
    """(local file, path in the volume) of each file an upload of `local` (a file, or a
    folder and all it holds) sends to `remote` (default: its own name; a file goes into
    a `remote` that ends in "/", as with cp)."""
    local = Path(local)
    remote = path_text(remote)
    target = remote.strip("/") or local.name
    if local.is_file():
        into_folder = remote.endswith("/") and remote.strip("/") != ""
        return [(local, f"{target}/{local.name}" if into_folder else target)]
    if not local.is_dir():
        raise InvalidError(f"{local} is neither a file nor a folder")
    files = sorted(p for p in local.rglob("*") if p.is_file())
    return [(file, f"{target}/{file.relative_to(local).as_posix()}") for file in files]


def _file_of(answer: dict[str, Any]) -> VolumeFile:
    return VolumeFile(answer["path"], answer["size"], answer["digest"], answer["modified"])


def _content_of(data: object) -> bytes:
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    raise InvalidError(f"a volume file's content is bytes or str, not {type(data).__name__}")


def _stamp(stat: os.stat_result, digest: str) -> dict[str, Any]:
    return {"digest": digest, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


class _Conflict(Exception):
    """A file of the volume that a reload leaves out, so as to keep what is here."""


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
        self._app = None if app is None else check_app(app)
        self._config = config
        self._synced_into: Path | None = None  # where `path` was last brought up to date
        _volumes.add(self)

    def __repr__(self) -> str:
        return f"ember.Volume({self.name!r}, app={self._app or current_app()!r})"

    @property
    def app(self) -> str:
        if self._app is None:
            self._app = check_app(app_here(f"ember.Volume({self.name!r})"))
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

    def _file_url(self, path: PathText) -> str:
        return f"{self._api}/files/{quote(check_volume_path(path))}"

    def listdir(self, prefix: PathText = "") -> list[VolumeFile]:
        """Every file under `prefix` (a folder, or one file; "" for all), in path order."""
        prefix = check_volume_prefix(prefix)
        files: list[VolumeFile] = []
        while True:  # in pages: a large volume's listing comes in parts
            page, more = self._list_page(prefix, files[-1].path if files else None)
            files += page
            if not more or not page:
                return files

    def _list_page(self, prefix: str, after: str | None) -> tuple[list[VolumeFile], bool]:
        """Files past `after`, and whether more follow."""
        params = {"limit": str(LIST_PAGE_FILES)}
        if prefix:
            params["prefix"] = prefix
        if after is not None:
            params["after"] = after
        answer = _ok(self._send("GET", self._api, params=params)).json()
        page = [_file_of(f) for f in answer["files"]]
        if after is not None and page and page[0].path <= after:
            raise EmberError(  # a server too old to page: its listing stops at its most
                f"the server lists only {len(page)} files of volume {self.name} and cannot "
                "give the rest; upgrade it"
            )
        return page, bool(answer.get("truncated"))

    def read_file(self, path: PathText) -> bytes:
        response = _ok(self._send("GET", self._file_url(path), timeout=TRANSFER_TIMEOUT_S))
        return response.content

    def write_file(self, path: PathText, data: Content) -> VolumeFile:
        """Set a file's content (bytes, or text as UTF-8), in place of any it had."""
        return self._put(path, _content_of(data))

    def _put(self, path: PathText, content: bytes | Iterator[bytes]) -> VolumeFile:
        response = _ok(
            self._send("PUT", self._file_url(path), timeout=TRANSFER_TIMEOUT_S, content=content)
        )
        return _file_of(response.json())

    def remove(self, path: PathText, *, recursive: bool = False) -> int:
        """Remove a file, or with `recursive=True` a folder; how many files went."""
        params = {"recursive": "true"} if recursive else {}
        response = _ok(self._send("DELETE", self._file_url(path), params=params))
        return int(response.json()["removed"])

    def clear(self) -> int:
        """Remove every file of the volume; how many went."""
        response = _ok(self._send("DELETE", self._api))
        return int(response.json()["removed"])

    def upload(self, local: str | Path, remote: PathText = "") -> list[VolumeFile]:
        """A local file or folder into the volume, at `remote` (default: its own name; a
        file goes into a `remote` that ends in "/")."""
        return [self._put(path, _chunks_of(file)) for file, path in upload_plan(local, remote)]

    def download(self, remote: PathText, local: str | Path) -> list[Path]:
        """A file of the volume, or a folder and all it holds, to `local`. A file goes
        into `local` if that is a folder, or ends in "/"; a folder's files go under it.
        New files get the mode the umask allows; files removed from the volume while
        the others download are left out."""
        remote = check_volume_path(remote)
        written = []
        for path, target in self._download_plan(remote, local):
            try:
                self._fetch(path, target)
            except NotFoundError:
                continue  # removed from the volume since it was listed
            written.append(target)
        if not written:
            raise NotFoundError(
                404, "not_found", f"volume {self.name} has no file or folder {remote}"
            )
        return written

    def _download_plan(self, remote: str, local: str | Path) -> list[tuple[str, Path]]:
        """(path in the volume, local file) of each file, each checked to fit on disk."""
        into_folder = os.fspath(local).endswith("/")
        local = Path(local)
        plan = []
        for file in self.listdir(remote):
            inside = file.path[len(remote) :].lstrip("/")
            if inside:
                target = local / inside
            elif into_folder or local.is_dir():  # `remote` is a file
                target = local / remote.rsplit("/", 1)[-1]
            else:
                target = local
            _check_writable(target)
            plan.append((file.path, target))
        return plan

    def _fetch(
        self, remote: str, target: Path, staging: Path | None = None
    ) -> tuple[str | None, os.stat_result]:
        """A file into `target`, whole or not at all: a temporary file (in `staging`, else
        beside `target`), then a rename. The digest the volume sent, and the file's stat."""
        target.parent.mkdir(parents=True, exist_ok=True)
        name = f".ember-download-{secrets.token_hex(16)}.partial"
        temporary = (staging or target.parent) / name
        # Made with 0666 less the umask, as any new file (mkstemp's would be 0600).
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        client = shared_client(self.config)
        try:
            with (
                os.fdopen(fd, "wb") as handle,
                client.stream(
                    "GET", self._file_url(remote), timeout=request_timeout(TRANSFER_TIMEOUT_S)
                ) as response,
            ):
                if response.status_code != 200:
                    raise error_from_response(response.status_code, response.read())
                digest = response.headers.get(DIGEST_HEADER)
                for chunk in response.iter_bytes(CHUNK_BYTES):
                    handle.write(chunk)
            stat = temporary.stat()  # a rename keeps it
            os.replace(temporary, target)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        return digest, stat

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
        the node's other replicas for the length of a reload or commit. The record is
        saved even when they fail midway: what they did is known."""
        folder, state_file = self._local()
        folder.mkdir(parents=True, exist_ok=True)
        with (state_file.parent / f".{self.name}.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                state = json.loads(state_file.read_text()) if state_file.exists() else {}
            except ValueError:
                state = {}  # a damaged record: every file is compared by its content
            try:
                yield folder, state
            finally:
                temporary = state_file.with_suffix(".tmp")
                temporary.write_text(json.dumps(state))
                os.replace(temporary, state_file)

    @contextlib.contextmanager
    def _staging(self) -> Iterator[Path]:
        """Where a reload's fetches wait until whole (under the lock): beside the copy,
        so a commit never meets one; what a reload cut short left there goes."""
        staging = self._local()[0].parent / f".{self.name}.incoming"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            yield staging
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    @staticmethod
    def _unchanged(file: Path, known: dict[str, Any] | None) -> bool:
        if known is None or not file.is_file():
            return False
        stat = file.stat()
        return stat.st_size == known["size"] and stat.st_mtime_ns == known["mtime_ns"]

    def reload(self) -> list[str]:
        """Bring the local copy up to date with the volume; the paths that changed here.

        Only files that changed in the volume are fetched, and what changed here and was
        not committed stays: a file the volume no longer has stays if changed here
        since; where the volume changed a file that changed here too, or has a file
        where a file or folder made here stands in the way, this copy's stays and a
        warning names the path. Files removed while the reload runs are left out."""
        remote = {f.path: f for f in self.listdir()}
        changed: list[str] = []
        conflicts: list[str] = []
        with self._locked() as (folder, state), self._staging() as staging:
            changed += self._drop_removed(folder, state, remote)
            for file in remote.values():
                try:
                    if self._take(folder, state, file, staging):
                        changed.append(file.path)
                except _Conflict as conflict:
                    conflicts.append(str(conflict))
        self._synced_into = folder
        for message in conflicts:
            log.warning("ember.Volume(%r).reload() kept this copy's %s", self.name, message)
        return changed

    def _drop_removed(
        self, folder: Path, state: dict[str, dict[str, Any]], remote: dict[str, VolumeFile]
    ) -> list[str]:
        """Remove here the files the volume no longer has, but those changed here since.
        First, so that a file may take the place of a folder that went, and back."""
        gone = []
        for path in [p for p in state if p not in remote]:
            local = folder / path
            if self._unchanged(local, state.pop(path)):
                local.unlink()
                gone.append(path)
                _remove_empty_parents(local.parent, folder)
        return gone

    def _take(
        self, folder: Path, state: dict[str, dict[str, Any]], file: VolumeFile, staging: Path
    ) -> bool:
        """Fetch a file the volume has, if it changed there and fetching it loses nothing
        here (else _Conflict); whether it was fetched."""
        known = state.get(file.path)
        if known is not None and known["digest"] == file.digest:
            return False  # as it was when this copy last met the volume
        local = folder / file.path
        _check_no_file_above(folder, file.path)
        if local.is_dir():
            _remove_empty_folders(local)
            if local.is_dir():
                raise _Conflict(
                    f"folder {file.path}, with files not committed, where the volume has a "
                    "file: move them elsewhere here and reload() to take the file, or "
                    "remove the file from the volume and commit() them"
                )
        elif local.exists() and not self._unchanged(local, known):
            stat = local.stat()
            if file_digest(local) == file.digest:
                state[file.path] = _stamp(stat, file.digest)
                return False  # made here as the volume has it
            raise _Conflict(
                f"{file.path}, changed here and not committed, over the volume's new "
                "version: commit() makes this copy's the volume's, or remove it here and "
                "reload() to take the volume's"
            )
        try:
            digest, stat = self._fetch(file.path, local, staging)
        except NotFoundError:
            return False  # removed from the volume since it was listed
        state[file.path] = _stamp(stat, digest or file.digest)
        return True

    def commit(self) -> list[str]:
        """Upload what changed in the local copy, and remove from the volume what was
        deleted here; the paths that changed. A file the volume cannot take (it has a
        folder where the file is, or a file where the file's folder is) is left out, and
        VolumeConflictError names it once the rest is committed."""
        changed = []
        conflicts = []
        with self._locked() as (folder, state):
            present = set()
            for local in _files_of_copy(folder, state):
                path = local.relative_to(folder).as_posix()
                present.add(path)
                try:
                    if self._send_if_changed(path, local, state):
                        changed.append(path)
                except RemoteError as exc:
                    if (exc.status, exc.error_type) != (409, "path_conflict"):
                        raise
                    conflicts.append(f"{path} ({exc.message})")
            changed += self._remove_deleted(state, present)
        self._synced_into = folder
        if conflicts:
            raise VolumeConflictError(self.name, conflicts)
        return changed

    def _send_if_changed(self, path: str, local: Path, state: dict[str, dict[str, Any]]) -> bool:
        """Upload a file of the copy unless the volume has its content; whether it did."""
        known = state.get(path)
        if self._unchanged(local, known):
            return False
        # Its stat from before it is read: a file written while it is hashed or sent
        # then differs from its stamp, so the next commit sends it again.
        before = local.stat()
        digest = file_digest(local)
        sent = known is None or known["digest"] != digest
        if sent:
            digest = self._put(path, _chunks_of(local)).digest  # what the volume got
        state[path] = _stamp(before, digest)
        return sent

    def _remove_deleted(self, state: dict[str, dict[str, Any]], present: set[str]) -> list[str]:
        """Remove from the volume the files this copy had and no longer has."""
        removed = []
        for path in [p for p in state if p not in present]:
            response = self._send("DELETE", self._file_url(path))
            if response.status_code not in (200, 404):  # 404: gone already
                raise error_from_response(response.status_code, response.content)
            del state[path]
            removed.append(path)
        return removed

    # ----- asyncio twins: the same work on a thread, so an async endpoint's loop runs on
    async def alistdir(self, prefix: PathText = "") -> list[VolumeFile]:
        return await asyncio.to_thread(self.listdir, prefix)

    async def aread_file(self, path: PathText) -> bytes:
        return await asyncio.to_thread(self.read_file, path)

    async def awrite_file(self, path: PathText, data: Content) -> VolumeFile:
        return await asyncio.to_thread(self.write_file, path, data)

    async def aremove(self, path: PathText, *, recursive: bool = False) -> int:
        return await asyncio.to_thread(self.remove, path, recursive=recursive)

    async def areload(self) -> list[str]:
        return await asyncio.to_thread(self.reload)

    async def acommit(self) -> list[str]:
        return await asyncio.to_thread(self.commit)


def _files_of_copy(folder: Path, state: dict[str, dict[str, Any]]) -> list[Path]:
    """The copy's files in path order, less those being downloaded; stale ones go."""
    files = []
    for local in sorted(p for p in folder.rglob("*") if p.is_file()):
        if TEMPORARY_NAME.fullmatch(local.name):
            _remove_if_stale(local)  # a download() into the copy, or one cut short
        elif _left_by_an_older_sdk(local, folder, state):
            local.unlink(missing_ok=True)
        else:
            files.append(local)
    return files


def _left_by_an_older_sdk(file: Path, folder: Path, state: dict[str, dict[str, Any]]) -> bool:
    """A fetch of an older SDK, cut short: its fetches into the copy held this lock, so
    none is under way. Known by mkstemp's name and mode, and by never having been part
    of the volume, so that a file of the user's named alike is not taken for one."""
    if not OLD_TEMPORARY_NAME.fullmatch(file.name) or file.relative_to(folder).as_posix() in state:
        return False
    return S_IMODE(file.stat().st_mode) == 0o600


def _remove_if_stale(file: Path) -> None:
    with contextlib.suppress(OSError):
        if time.time() - file.stat().st_mtime > STALE_TEMPORARY_S:
            file.unlink()


def _check_writable(target: Path) -> None:
    """Refuse, before any download, a file that a file or folder on disk is in the way of."""
    for folder in reversed(target.parents):
        if folder.exists() and not folder.is_dir():
            raise InvalidError(f"cannot write {target}: {folder} is a file, not a folder")
    if target.is_dir():
        raise InvalidError(f"cannot write {target}: it is a folder")


def _check_no_file_above(folder: Path, path: str) -> None:
    """A file of the copy where the volume has a folder is one made or changed here, not
    committed (one the volume had and this copy did not change went before)."""
    for above in parents(path):
        if (folder / above).exists() and not (folder / above).is_dir():
            raise _Conflict(
                f"file {above}, not committed, where the volume has folder {above} (its "
                f"{path}; commit() fails on it too): rename or remove it here, or remove "
                "the folder from the volume"
            )


def _remove_empty_folders(folder: Path) -> None:
    for parent, _, _ in os.walk(folder, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(parent)  # only an empty one goes


def _remove_empty_parents(folder: Path, root: Path) -> None:
    while folder != root and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent


def _ok(response: httpx.Response) -> httpx.Response:
    if response.status_code != 200:
        raise error_from_response(response.status_code, response.content)
    return response
