"""The lazy image file system's answers to the kernel (pyfuse3 operations): the tree
from the file index, loaded once, and file contents from `ImageContents` on first read.

It is read-only and never changes, so the kernel may keep everything it is told:
attributes, names and missing names for a long time (`TIMEOUT`), and file pages in its
page cache across opens (`keep_cache`), so a second replica of the node reads the
image from memory. Blocking reads run on trio's worker threads; one already in this
process's memory is answered on the loop."""

from __future__ import annotations

import errno
import logging
import os
from typing import cast

import pyfuse3
import trio

from ember_worker.images.lazy.file_index import FileIndex, Inode
from ember_worker.images.lazy.image_contents import CorruptChunk, ImageContents

log = logging.getLogger("ember.worker.images")

TIMEOUT = 3600.0  # seconds the kernel may keep attributes and names: they never change
BLOCK = 4096


class ImageFs(pyfuse3.Operations):
    def __init__(self, index: FileIndex, contents: ImageContents) -> None:
        super().__init__()
        self.index = index
        self.contents = contents
        self._inodes = index.inodes
        self._number = {id(inode): n for n, inode in enumerate(self._inodes, start=1)}
        # A folder's entries in order, for readdir (computed when first listed).
        self._listings: dict[int, list[tuple[bytes, int]]] = {}
        self._limiter = trio.CapacityLimiter(16)

    # -- names and attributes -------------------------------------------------------------

    def _inode(self, number: int) -> Inode:
        if not 0 < number <= len(self._inodes):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._inodes[number - 1]

    def attributes(self, number: int) -> pyfuse3.EntryAttributes:
        inode = self._inode(number)
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = cast(pyfuse3.InodeT, number)
        entry.generation = 0
        entry.entry_timeout = TIMEOUT
        entry.attr_timeout = TIMEOUT
        entry.st_mode = cast(pyfuse3.ModeT, inode.st_mode)
        entry.st_nlink = inode.nlink
        entry.st_uid = inode.uid
        entry.st_gid = inode.gid
        entry.st_rdev = inode.rdev
        entry.st_size = len(inode.target.encode()) if inode.kind == "link" else inode.size
        entry.st_blksize = BLOCK
        entry.st_blocks = (entry.st_size + 511) // 512
        entry.st_atime_ns = entry.st_mtime_ns = entry.st_ctime_ns = inode.mtime * 10**9
        return entry

    async def lookup(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        parent = self._inode(parent_inode)
        if parent.kind != "dir":
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        text = os.fsdecode(name)
        if text == ".":
            return self.attributes(parent_inode)
        if text == "..":
            return self.attributes(pyfuse3.ROOT_INODE)  # only asked for with NFS exports
        child = parent.children.get(text)
        if child is None:
            # A missing name, kept by the kernel as long as the rest: an import probes
            # many paths that are not there.
            missing = pyfuse3.EntryAttributes()
            missing.st_ino = cast(pyfuse3.InodeT, 0)
            missing.entry_timeout = TIMEOUT
            return missing
        return self.attributes(self._number[id(child)])

    async def getattr(
        self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self.attributes(inode)

    async def readlink(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> bytes:
        node = self._inode(inode)
        if node.kind != "link":
            raise pyfuse3.FUSEError(errno.EINVAL)
        return os.fsencode(node.target)

    async def opendir(
        self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.FileHandleT:
        if self._inode(inode).kind != "dir":
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return cast(pyfuse3.FileHandleT, inode)

    async def readdir(
        self, fh: pyfuse3.FileHandleT, start_id: int, token: pyfuse3.ReaddirToken
    ) -> None:
        listing = self._listings.get(fh)
        if listing is None:
            node = self._inode(fh)
            listing = self._listings[fh] = [
                (os.fsencode(name), self._number[id(child)])
                for name, child in sorted(node.children.items())
            ]
        for position in range(start_id, len(listing)):
            name, number = listing[position]
            if not pyfuse3.readdir_reply(
                token, cast(pyfuse3.FileNameT, name), self.attributes(number), position + 1
            ):
                return

    async def releasedir(self, fh: pyfuse3.FileHandleT) -> None:
        return None

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = BLOCK
        data.f_blocks = self.index.file_bytes() // BLOCK
        data.f_bfree = data.f_bavail = 0
        data.f_files = len(self._inodes)
        data.f_ffree = data.f_favail = 0
        data.f_namemax = 255
        return data

    async def getxattr(
        self, inode: pyfuse3.InodeT, name: pyfuse3.XAttrNameT, ctx: pyfuse3.RequestContext
    ) -> bytes:
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    async def listxattr(
        self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext
    ) -> list[pyfuse3.XAttrNameT]:
        return []

    # -- contents -------------------------------------------------------------------------

    async def open(
        self, inode: pyfuse3.InodeT, flags: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.FileInfo:
        node = self._inode(inode)
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise pyfuse3.FUSEError(errno.EROFS)
        if node.kind != "file":
            raise pyfuse3.FUSEError(errno.EINVAL)
        # The kernel's pages of this file stay valid across opens: it never changes.
        return pyfuse3.FileInfo(fh=cast(pyfuse3.FileHandleT, inode), keep_cache=True)

    async def read(self, fh: pyfuse3.FileHandleT, off: int, size: int) -> bytes:
        node = self._inode(fh)
        if off >= node.size or size <= 0:
            return b""
        start = node.offset + off
        end = node.offset + min(node.size, off + size)
        held = self.contents.cached(node.source, start, end)
        if held is not None:
            return held
        try:
            return await trio.to_thread.run_sync(
                self.contents.read, node.source, start, end, limiter=self._limiter
            )
        except CorruptChunk:
            raise pyfuse3.FUSEError(errno.EIO) from None
        except Exception:
            log.exception("reading inode %d at %d failed", fh, off)
            raise pyfuse3.FUSEError(errno.EIO) from None

    async def release(self, fh: pyfuse3.FileHandleT) -> None:
        return None
