"""Files a replica has open or mapped that another node may lack, carried in its snapshot.

CRIU records open and mapped files by path and opens them again at a restore. A file the
process made itself (torch.compile's kernels in Inductor's cache under /tmp, a scratch
file in the home directory) exists only on the node that took the snapshot, so a restore
anywhere else would fail. At the dump, every regular file the process tree has open or
mapped outside the places every node has alike (the interpreter's installation, the
system's directories, the worker's own folder, where bundles are unpacked at the same
path everywhere) is copied into the image as `side-files.tar`; before a restore, those
that are missing are put back at their paths.

The agent reads them as root, after a dump that leaves the replica running: a replica may
swap a folder of its working area for a link by then. Every file is opened a component at
a time, never following a link (tenant_files.open_regular): a sandbox's below its
/proc/<pid>/root, any other from the node's root (the paths /proc shows hold no link).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ember_worker.processes import tenant_files

ARCHIVE = "side-files.tar"
MAX_BYTES = 256 * 2**20  # beyond this a snapshot stays usable on its own node only
SYSTEM_ROOTS = (
    "/usr",
    "/lib",
    "/lib32",
    "/lib64",
    "/bin",
    "/sbin",
    "/etc",
    "/opt",
    "/proc",
    "/sys",
    "/dev",
    "/run",
)


@dataclass
class Packed:
    files: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)  # over the budget or unreadable


def stable_roots(extra: Iterable[Path] = ()) -> tuple[Path, ...]:
    """Where files are the same on every node: system directories, this interpreter's
    installation (replicas run the worker's), and `extra` (the worker's folder)."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, *SYSTEM_ROOTS}
    return tuple(sorted({Path(p) for p in prefixes} | {Path(p).resolve() for p in extra}))


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (host PIDs, from /proc's children lists)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{current}/task").iterdir():
                with contextlib.suppress(OSError):
                    todo.extend(int(c) for c in (task / "children").read_text().split())
    return found


def used_files(pids: Iterable[int]) -> set[str]:
    """Absolute paths the processes have mapped or open (deleted files left out)."""
    paths: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    paths.add(parts[5])
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/"):
                        paths.add(target)
    return {p for p in paths if not p.endswith(" (deleted)")}


def files_of_tree(pid: int) -> set[str]:
    """`used_files` of `pid` and every process below it."""
    return used_files(process_tree(pid))


def to_carry(paths: Iterable[str], roots: Sequence[Path]) -> list[Path]:
    """The regular files among `paths` outside `roots` (no link followed to find them)."""
    carried = []
    for text in sorted(paths):
        path = Path(text)
        if any(path.is_relative_to(root) for root in roots):
            continue
        with contextlib.suppress(OSError):
            os.close(tenant_files.open_regular(*_beneath(path)))
            carried.append(path)
    return carried


def _beneath(path: Path) -> tuple[str, str]:
    """(the folder to resolve `path` from, its rest): a path under /proc/<pid>/root
    (a sandbox's root, a link to follow) from there, any other from the node's root."""
    parts = path.parts
    if len(parts) > 4 and parts[1] == "proc" and parts[2].isdigit() and parts[3] == "root":
        return str(Path(*parts[:4])), str(Path(*parts[4:]))
    return "/", str(path)


def pack(
    files: Sequence[Path],
    images: Path,
    limit: int = MAX_BYTES,
    names: Mapping[Path, str] | None = None,
) -> Packed:
    """Copy `files` into `images`/side-files.tar under their absolute paths (or the
    paths `names` gives them: a sandbox's, read through /proc/<pid>/root), up to `limit`
    bytes in all; nothing is written when there are none."""
    names = names or {}
    packed = Packed()
    if not files:
        return packed
    with tarfile.open(images / ARCHIVE, "w") as tar:
        for path in files:
            try:
                with open(tenant_files.open_regular(*_beneath(path)), "rb") as handle:
                    info = tar.gettarinfo(arcname=names.get(path, str(path)), fileobj=handle)
                    if packed.bytes + info.size > limit:
                        packed.skipped.append(str(path))
                        continue
                    info.name = info.name.lstrip("/")
                    tar.addfile(info, handle)
            except OSError:
                packed.skipped.append(str(path))
                continue
            packed.files += 1
            packed.bytes += info.size
    return packed


def put_back(images: Path, own: Sequence[tuple[str, Path]] = ()) -> list[str]:
    """Write the image's carried files that this node lacks to their paths, atomically;
    the paths written. `own`: a sandbox's folders of its own (their path inside, the
    restoring replica's folder on the node): files under the first go into the second,
    owned as they were (folders made for them as the folder's owner's). Raises OSError
    or tarfile.TarError."""
    archive = images / ARCHIVE
    if not archive.exists():
        return []
    written = []
    with tarfile.open(archive, "r") as tar:
        for member in tar:
            name = Path(member.name)
            if not member.isfile() or name.is_absolute() or ".." in name.parts:
                raise tarfile.TarError(f"{ARCHIVE} holds an unexpected entry {member.name!r}")
            target = Path("/") / name
            owner = None
            for inside, folder in own:
                if target.is_relative_to(inside):
                    target = folder / target.relative_to(inside)
                    owner = folder.stat()
                    break
            if os.path.lexists(target):
                # This node has it (the node that took the snapshot does). One that changed
                # since is left alone: it may be a live file of another process, and CRIU
                # refuses a file of another size rather than restore wrong state.
                continue
            source = tar.extractfile(member)
            if source is None:
                raise tarfile.TarError(f"{ARCHIVE} cannot read {member.name!r}")
            _make_parents(target, owner)
            handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
            try:
                with os.fdopen(handle, "wb") as out:
                    while chunk := source.read(1 << 20):
                        out.write(chunk)
                os.chmod(temporary, member.mode & 0o1777)  # never set-id: a replica's file
                if owner is not None:  # as it was in the sandbox it was taken from
                    os.chown(temporary, member.uid, member.gid)
                os.utime(temporary, (member.mtime, member.mtime))
                os.replace(temporary, target)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise
            written.append(str(target))
    return written


def _make_parents(target: Path, owner: os.stat_result | None) -> None:
    """The folders above `target`, made as `owner`'s where given (a working area's)."""
    missing = [p for p in target.parents if not p.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    if owner is not None:
        for folder in missing:
            os.chown(folder, owner.st_uid, owner.st_gid)
