"""Small images made by a test: OCI layer tars (uncompressed, as the builder stores
them) in a folder named by their sha256, the way the lazy file system finds them
through a `file://` store."""

from __future__ import annotations

import hashlib
import io
import tarfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class E:
    """One tar entry: kind f file, d folder, l symbolic link, h hard link, c char
    device; `data` a file's bytes, `link` a link's target."""

    kind: str
    name: str
    data: bytes = b""
    mode: int = 0o644
    link: str = ""
    uid: int = 0
    gid: int = 0


def layer_tar(folder: Path, entries: list[E]) -> str:
    """The entries as a layer tar in `folder`, named by its sha256 (returned)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in entries:
            info = tarfile.TarInfo(entry.name)
            info.mode, info.uid, info.gid, info.mtime = entry.mode, entry.uid, entry.gid, 1700000000
            if entry.kind == "d":
                info.type = tarfile.DIRTYPE
            elif entry.kind in ("l", "h"):
                info.type = tarfile.SYMTYPE if entry.kind == "l" else tarfile.LNKTYPE
                info.linkname = entry.link
            elif entry.kind == "c":
                info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
            else:
                info.size = len(entry.data)
            tar.addfile(info, io.BytesIO(entry.data) if entry.kind == "f" else None)
    raw = buffer.getvalue()
    sha256 = hashlib.sha256(raw).hexdigest()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / sha256).write_bytes(raw)
    return sha256
