"""An image's file index: its layers flattened into one tree (whiteouts and opaque
folders of each layer applied to the layers below it, hard links sharing an inode) in
which every regular file names where its bytes are: a layer tar, by its sha256, and the
offset of the file's data in it. Layer tars are stored uncompressed, so a file's bytes
are one range of one tar, read lazily through the node's cache; each tar is also cut
into `CHUNK_BYTES` chunks whose SHA-256s the index holds, so that every chunk read is
checked before any of it is served.

Serialized (`to_bytes`, zstd-compressed JSON) as inodes (inode n is `inodes[n - 1]`,
the root is 1) and directory entries, which is what the file system answers from."""

from __future__ import annotations

import hashlib
import json
import stat
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Protocol

import zstandard

from ember_worker.images.oci_layers import OPAQUE_MARK, WHITEOUT_PREFIX

FORMAT = 1
CHUNK_BYTES = 1024 * 1024  # 2 MiB: 31 % more bytes for a torch import, no faster
# zstd, gzip, bzip2 and xz magic numbers: a compressed layer cannot be read by range.
_COMPRESSED = (b"\x28\xb5\x2f\xfd", b"\x1f\x8b", b"BZh", b"\xfd7zXZ")

KINDS = ("dir", "file", "link", "char", "block", "fifo")
_TYPE_BITS = {
    "dir": stat.S_IFDIR,
    "file": stat.S_IFREG,
    "link": stat.S_IFLNK,
    "char": stat.S_IFCHR,
    "block": stat.S_IFBLK,
    "fifo": stat.S_IFIFO,
}


class Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


class UnindexableImage(Exception):
    """The layers cannot be indexed (a compressed or sparse layer, a name leading out):
    the image is extracted eagerly instead."""


@dataclass
class Inode:
    kind: str
    mode: int  # permission bits, set-uid and sticky included
    uid: int = 0
    gid: int = 0
    mtime: int = 0
    size: int = 0
    target: str = ""  # a symbolic link's
    rdev: int = 0
    source: int = -1  # a regular file's layer tar (an index into `sources`)
    offset: int = 0  # where its bytes begin in that tar
    children: dict[str, Inode] = field(default_factory=dict)  # a folder's
    nlink: int = 1

    @property
    def st_mode(self) -> int:
        return _TYPE_BITS[self.kind] | self.mode


@dataclass(frozen=True)
class Source:
    """A layer tar: its sha256 (its name in the store), size and its chunks' SHA-256s."""

    sha256: str
    size: int
    chunks: tuple[bytes, ...]


@dataclass
class FileIndex:
    sources: list[Source]
    inodes: list[Inode]  # inode n at n - 1
    chunk_bytes: int = CHUNK_BYTES

    @property
    def root(self) -> Inode:
        return self.inodes[0]

    def lookup(self, path: str) -> Inode | None:
        """The inode at `path` (absolute or relative to the root), symbolic links not
        followed."""
        node: Inode | None = self.root
        for part in PurePosixPath(path).parts:
            if part == "/":
                continue
            node = node.children.get(part) if node is not None else None
        return node

    def add_mount_points(self, files: list[str], folders: list[str]) -> None:
        """Make `files` (empty) and `folders` where the image lacks them, as the sandbox
        needs them to mount over or start in (a link where a file should be is
        replaced: a mount would follow it). In memory only: the mount's view."""
        for path, kind in [(f, "file") for f in files] + [(d, "dir") for d in folders]:
            parts = _parts(path)
            if not parts:
                continue
            parent = _place(self.root, parts)
            existing = parent.children.get(parts[-1])
            if existing is not None and (existing.kind == kind or kind == "dir"):
                continue
            node = Inode(kind, 0o755 if kind == "dir" else 0o644)
            parent.children[parts[-1]] = node
        self.inodes = _number(self.root)

    def file_bytes(self) -> int:
        """The bytes of the image's files (each inode once)."""
        return sum(inode.size for inode in self.inodes if inode.kind == "file")

    def to_bytes(self) -> bytes:
        number = {id(inode): n for n, inode in enumerate(self.inodes, start=1)}
        inodes = [
            [i.kind, i.mode, i.uid, i.gid, i.mtime, i.size, i.target, i.rdev, i.source, i.offset]
            for i in self.inodes
        ]
        entries = [
            [number[id(parent)], name, number[id(child)]]
            for parent in self.inodes
            if parent.kind == "dir"
            for name, child in sorted(parent.children.items())
        ]
        data = {
            "format": FORMAT,
            "chunk_bytes": self.chunk_bytes,
            "sources": [
                {"sha256": s.sha256, "size": s.size, "chunks": b"".join(s.chunks).hex()}
                for s in self.sources
            ],
            "inodes": inodes,
            "entries": entries,
        }
        return zstandard.ZstdCompressor(level=10).compress(json.dumps(data).encode())

    @classmethod
    def from_bytes(cls, raw: bytes) -> FileIndex:
        data: dict[str, Any] = json.loads(
            zstandard.ZstdDecompressor().decompressobj().decompress(raw)
        )
        if data.get("format") != FORMAT:
            raise ValueError(f"file index format {data.get('format')!r}, not {FORMAT}")
        sources = []
        for s in data["sources"]:
            digests = bytes.fromhex(s["chunks"])
            chunks = tuple(digests[i : i + 32] for i in range(0, len(digests), 32))
            sources.append(Source(s["sha256"], int(s["size"]), chunks))
        inodes = [
            Inode(kind, mode, uid, gid, mtime, size, target, rdev, source, offset)
            for kind, mode, uid, gid, mtime, size, target, rdev, source, offset in data["inodes"]
        ]
        for parent, name, child in data["entries"]:
            inodes[parent - 1].children[name] = inodes[child - 1]
        _count_links(inodes)
        return cls(sources, inodes, int(data["chunk_bytes"]))


class _ChunkHasher:
    """A read-only stream that hashes what passes through it, chunk by chunk."""

    def __init__(self, stream: Readable, chunk_bytes: int) -> None:
        self.stream = stream
        self.chunk_bytes = chunk_bytes
        self.chunks: list[bytes] = []
        self.size = 0
        self._current = hashlib.sha256()
        self._in_current = 0
        self.whole = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size) if size >= 0 else self.stream.read()
        self._take(data)
        return data

    def _take(self, data: bytes) -> None:
        self.whole.update(data)
        self.size += len(data)
        view = memoryview(data)
        while view:
            room = self.chunk_bytes - self._in_current
            piece, view = view[:room], view[room:]
            self._current.update(piece)
            self._in_current += len(piece)
            if self._in_current == self.chunk_bytes:
                self.chunks.append(self._current.digest())
                self._current, self._in_current = hashlib.sha256(), 0

    def drain(self) -> None:
        while self.read(4 * 1024 * 1024):
            pass
        if self._in_current:
            self.chunks.append(self._current.digest())
            self._current, self._in_current = hashlib.sha256(), 0


def _parts(name: str) -> list[str]:
    pure = PurePosixPath(name.lstrip("/"))
    parts = [p for p in pure.parts if p not in (".", "")]
    if ".." in parts:
        raise UnindexableImage(f"the layer entry {name!r} leads out of the image")
    return parts


def _folder() -> Inode:
    return Inode("dir", 0o755)


def _place(root: Inode, parts: list[str]) -> Inode:
    """The folder that holds `parts`' last name, made on the way where missing (a file
    or link on the way is replaced, as an overlay's upper folder hides it)."""
    node = root
    for part in parts[:-1]:
        child = node.children.get(part)
        if child is None or child.kind != "dir":
            child = node.children[part] = _folder()
        node = child
    return node


def _kind(member: tarfile.TarInfo) -> str:
    if member.isdir():
        return "dir"
    if member.issym():
        return "link"
    if member.ischr():
        return "char"
    if member.isblk():
        return "block"
    if member.isfifo():
        return "fifo"
    if member.isreg() and not member.issparse():
        return "file"
    raise UnindexableImage(f"the layer entry {member.name!r} is of a kind the index cannot hold")


def _apply(root: Inode, members: list[tarfile.TarInfo], source: int) -> None:
    """One layer's entries onto the tree of the layers below: whiteouts first (they
    delete only what is below), then the entries in order."""
    for member in members:
        parts = _parts(member.name)
        if not parts or not parts[-1].startswith(WHITEOUT_PREFIX):
            continue
        parent = _walk(root, parts[:-1])
        if parent is None or parent.kind != "dir":
            continue
        if parts[-1] == OPAQUE_MARK:
            parent.children.clear()
        else:
            parent.children.pop(parts[-1][len(WHITEOUT_PREFIX) :], None)
    for member in members:
        parts = _parts(member.name)
        if parts and parts[-1].startswith(WHITEOUT_PREFIX):
            continue
        attributes = {
            "mode": member.mode & 0o7777,
            "uid": member.uid,
            "gid": member.gid,
            "mtime": int(member.mtime),
        }
        if not parts:  # the root folder itself
            for key, value in attributes.items():
                setattr(root, key, value)
            continue
        parent = _place(root, parts)
        name = parts[-1]
        if member.islnk():
            target = _walk(root, _parts(member.linkname))
            if target is None or target.kind == "dir":
                raise UnindexableImage(f"the hard link {member.name!r} names no file")
            parent.children[name] = target
            continue
        kind = _kind(member)
        existing = parent.children.get(name)
        if kind == "dir" and existing is not None and existing.kind == "dir":
            for key, value in attributes.items():
                setattr(existing, key, value)
            continue
        node = Inode(
            kind,
            attributes["mode"],
            attributes["uid"],
            attributes["gid"],
            attributes["mtime"],
        )
        if kind == "file":
            node.size, node.source, node.offset = member.size, source, member.offset_data
        elif kind == "link":
            node.target = member.linkname
        elif kind in ("char", "block"):
            node.rdev = (member.devmajor << 8) | member.devminor
        parent.children[name] = node


def _walk(root: Inode, parts: list[str]) -> Inode | None:
    node: Inode | None = root
    for part in parts:
        node = node.children.get(part) if node is not None else None
    return node


def index_layers(
    layers: Iterable[tuple[str, Readable]], chunk_bytes: int = CHUNK_BYTES
) -> FileIndex:
    """The file index of an image's layer tars, lowest first: (sha256, a stream of the
    tar) each, read once from start to end (each checked against its sha256)."""
    root = _folder()
    sources: list[Source] = []
    for position, (sha256, stream) in enumerate(layers):
        hasher = _ChunkHasher(stream, chunk_bytes)
        head = hasher.read(512)
        if head.startswith(_COMPRESSED):
            raise UnindexableImage(
                f"layer tar {sha256[:12]} is compressed: it cannot be read by range"
            )
        rest = _Prefixed(head, hasher)
        try:
            with tarfile.open(fileobj=rest, mode="r|") as tar:  # type: ignore[call-overload]
                members = list(tar)
        except tarfile.TarError as error:
            raise UnindexableImage(f"layer tar {sha256[:12]}: {error}") from None
        hasher.drain()
        if hasher.whole.hexdigest() != sha256:
            raise UnindexableImage(f"layer tar {sha256[:12]} arrived with another sha256")
        _apply(root, members, position)
        sources.append(Source(sha256, hasher.size, tuple(hasher.chunks)))
    return FileIndex(sources, _number(root), chunk_bytes)


class _Prefixed:
    """`head` then the rest of `stream`: the bytes read to look for compression."""

    def __init__(self, head: bytes, stream: _ChunkHasher) -> None:
        self.head = head
        self.stream = stream

    def read(self, size: int = -1) -> bytes:
        if self.head:
            if size < 0:
                data, self.head = self.head + self.stream.read(), b""
                return data
            data, self.head = self.head[:size], self.head[size:]
            if len(data) < size:
                data += self.stream.read(size - len(data))
            return data
        return self.stream.read(size)


def _number(root: Inode) -> list[Inode]:
    """Every inode once, breadth first from the root (hard links share one)."""
    order: list[Inode] = [root]
    seen = {id(root)}
    at = 0
    while at < len(order):
        node = order[at]
        at += 1
        for _, child in sorted(node.children.items()):
            if id(child) not in seen:
                seen.add(id(child))
                order.append(child)
    _count_links(order)
    return order


def _count_links(inodes: list[Inode]) -> None:
    """A folder's link count is 2 and one per subfolder; a file's, its names."""
    names: dict[int, int] = {}
    for node in inodes:
        for child in node.children.values():
            names[id(child)] = names.get(id(child), 0) + 1
    for node in inodes:
        if node.kind == "dir":
            node.nlink = 2 + sum(c.kind == "dir" for c in node.children.values())
        else:
            node.nlink = names.get(id(node), 1)
