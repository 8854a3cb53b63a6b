"""Between overlayfs and OCI layers. A step runs on an overlay mount whose upper folder
collects its changes: new and changed files as they are, a deleted file as a whiteout
(a character device 0/0) and a folder replaced whole as an opaque folder (the
`trusted.overlay.opaque` attribute). An OCI layer tar writes those as `.wh.NAME` and
`.wh..wh..opq` entries; a layer unpacked for the next step's overlay turns them back."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tarfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import StrOrBytesPath

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARK = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"


def _is_whiteout(info: os.stat_result) -> bool:
    return stat.S_ISCHR(info.st_mode) and info.st_rdev == 0


def _is_opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP):
            return False
        raise


def pack_upper(upper: Path, archive: Path, owners: Callable[[int], int] = int) -> int:
    """The changes in overlay folder `upper` as an OCI layer tar at `archive`, each
    entry's owner and group as `owners` maps the node's (a build step's shifted uids
    back to the image's); returns how many entries it holds."""
    count = 0
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for folder, dirs, files in os.walk(upper):
            dirs.sort()
            here = Path(folder)
            for name in sorted(dirs + files):
                path = here / name
                relative = path.relative_to(upper).as_posix()
                info = path.lstat()
                if _is_whiteout(info):
                    parent = str(Path(relative).parent)
                    marker = tarfile.TarInfo(
                        WHITEOUT_PREFIX + name
                        if parent == "."
                        else f"{parent}/{WHITEOUT_PREFIX}{name}"
                    )
                    tar.addfile(marker)
                    count += 1
                    continue
                entry = tar.gettarinfo(str(path), arcname=relative)
                entry.uname = entry.gname = ""  # numeric owners: the image's, not the node's
                entry.uid, entry.gid = owners(entry.uid), owners(entry.gid)
                if entry.isreg():
                    with path.open("rb") as handle:
                        tar.addfile(entry, handle)
                else:
                    tar.addfile(entry)
                count += 1
                if stat.S_ISDIR(info.st_mode) and _is_opaque(path):
                    tar.addfile(tarfile.TarInfo(f"{relative}/{OPAQUE_MARK}"))
                    count += 1
    return count


class _TenantTar(tarfile.TarFile):
    """A tar whose entries are a tenant's, extracted by root: no owner, mode or time is
    ever set through a link (a folder a later entry swapped for a link, whose
    attributes tarfile sets last by path; a hard link to a link), a link's own owner
    aside. Nothing of the tenant's runs while it is extracted, so a check by path holds."""

    def chown(
        self, tarinfo: tarfile.TarInfo, targetpath: StrOrBytesPath, numeric_owner: bool
    ) -> None:
        if os.path.islink(targetpath) and not tarinfo.issym():
            return
        super().chown(tarinfo, targetpath, numeric_owner)  # lchown for a link's own

    def chmod(self, tarinfo: tarfile.TarInfo, targetpath: StrOrBytesPath) -> None:
        if not os.path.islink(targetpath):
            super().chmod(tarinfo, targetpath)

    def utime(self, tarinfo: tarfile.TarInfo, targetpath: StrOrBytesPath) -> None:
        if not os.path.islink(targetpath):
            super().utime(tarinfo, targetpath)


NOBODY = 65534  # the owner of a file whose own is past a build's uid range


def unpack_for_overlay(archive: Path, target: Path, shift: int = 0, span: int = 65536) -> None:
    """An OCI layer tar unpacked into `target`, a folder usable as an overlay lower
    layer: whiteouts become 0/0 devices, opaque markers the opaque attribute, owners
    the image's plus `shift` (a build step's user namespace of `span` ids maps them
    back; an owner past it is nobody's, never one that wraps round to the node's root).
    Entries that would land outside `target` are refused."""

    def shifted(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
        kept = _root_fs_filter(member, path)
        if kept is None:
            return None
        uid = kept.uid if 0 <= kept.uid < span else NOBODY
        gid = kept.gid if 0 <= kept.gid < span else NOBODY
        return kept.replace(uid=uid + shift, gid=gid + shift, uname="", gname="", deep=False)

    target.mkdir(parents=True, exist_ok=True)
    with _TenantTar.open(archive, "r:*") as tar:
        members = []
        markers: list[str] = []
        for member in tar:
            name = Path(member.name).name
            if name.startswith(WHITEOUT_PREFIX):
                markers.append(member.name)
            else:
                members.append(member)
        tar.extractall(target, members=members, numeric_owner=True, filter=shifted)
    for marker in markers:
        relative = Path(marker)
        parent = (target / relative.parent).resolve()
        if not parent.is_relative_to(target.resolve()):
            raise tarfile.OutsideDestinationError(tarfile.TarInfo(marker), str(parent))
        parent.mkdir(parents=True, exist_ok=True)
        if relative.name == OPAQUE_MARK:
            os.setxattr(parent, OPAQUE_XATTR, b"y")
        else:
            os.mknod(parent / relative.name[len(WHITEOUT_PREFIX) :], stat.S_IFCHR | 0o000, 0)


def apply_layer(archive: Path, tree: Path) -> None:
    """An OCI layer tar applied onto `tree`, a whole root file system (a registry image's
    layers flattened into one): its whiteouts delete what the layers below made, its
    opaque folders drop their old contents, then its entries are written."""
    root = tree.resolve()
    with _TenantTar.open(archive, "r:*") as tar:
        members = []
        for member in tar:
            relative = PurePosixPath(member.name)
            if not relative.name.startswith(WHITEOUT_PREFIX):
                members.append(member)
                continue
            parent = (tree / relative.parent).resolve()
            if not parent.is_relative_to(root):
                raise tarfile.OutsideDestinationError(member, str(parent))
            if relative.name == OPAQUE_MARK:
                gone = list(parent.iterdir()) if parent.is_dir() else []
            else:
                gone = [parent / relative.name[len(WHITEOUT_PREFIX) :]]
            for path in gone:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                elif os.path.lexists(path):
                    path.unlink()
        tar.extractall(tree, members=members, filter=_replacing_filter)


def _replacing_filter(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
    """As `_root_fs_filter`, an entry replacing what a lower layer had at its path (a
    file where a link was, a link where a folder was), a folder merging into one."""
    if member.ischr() or member.isblk():
        return None
    where = os.path.join(path, member.name)
    keep = member.isdir() and os.path.isdir(where) and not os.path.islink(where)
    if os.path.lexists(where) and not keep:
        _root_fs_filter(member, path, existing_ok=True)  # checks where it is first
        if os.path.isdir(where) and not os.path.islink(where):
            shutil.rmtree(where)
        else:
            os.unlink(where)
    return _root_fs_filter(member, path)


def _root_fs_filter(
    member: tarfile.TarInfo, path: str, existing_ok: bool = False
) -> tarfile.TarInfo | None:
    """Owners, set-uid bits and absolute symbolic links kept (it is a root file system,
    unpacked by root for a sandbox, never run on the node itself), but nothing written
    outside the target: no absolute or '..' names, no hard link out of it, no path
    through a symbolic link that leads out, no file written through a link. Device nodes
    are left out (None): sandboxes and build steps mount their own /dev, and a node of
    the tenant's choosing on the node's disk opens the node's hardware to whoever
    reaches the file."""
    if member.ischr() or member.isblk():
        return None
    root = os.path.realpath(path)

    def inside(name: str) -> str:
        pure = PurePosixPath(name)
        if pure.is_absolute() or ".." in pure.parts:
            raise tarfile.OutsideDestinationError(member, name)
        where = os.path.join(root, name)
        parent = os.path.realpath(os.path.dirname(where))
        if parent != root and not parent.startswith(root + os.sep):
            raise tarfile.OutsideDestinationError(member, where)
        return where

    where = inside(member.name)
    if member.islnk():  # to a regular file of the tree: never a link, which leads anywhere
        target = inside(member.linkname)
        if os.path.islink(target) or not os.path.realpath(target).startswith(root + os.sep):
            raise tarfile.OutsideDestinationError(member, target)
    if os.path.islink(where) and not member.issym() and not existing_ok:
        raise tarfile.OutsideDestinationError(member, where)
    return member
