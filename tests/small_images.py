"""Small images made by a test: OCI layer tars (uncompressed, as the builder stores
them) in a folder named by their sha256, the way the lazy file system finds them
through a `file://` store."""

from __future__ import annotations

import glob
import hashlib
import io
import os
import subprocess
import sys
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


# Of the stdlib, what no replica imports (and most of its size).
STDLIB_LEFT_OUT = ("test", "idlelib", "tkinter", "ensurepip", "lib2to3", "pydoc_data", "turtledemo")


def _libraries(objects: list[str]) -> set[str]:
    """The node's shared libraries (under /lib, /lib64) that `objects` load."""
    found: set[str] = set()
    listed = subprocess.run(["ldd", *objects], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        line = line.strip()
        path = line.split("=>")[1].split("(")[0].strip() if "=>" in line else line.split(" ")[0]
        if path.startswith(("/lib/", "/lib64/", "/usr/lib/")) and not line.endswith(":"):
            found.add(path)
    return found


def host_python_layer(folder: Path) -> str:
    """A layer of this node's Debian python3.11, its stdlib (less tests and the like) and
    the shared libraries it and the worker's compiled packages load, with Debian's
    merged-/usr links: enough for a replica to run on (Ember's runtime is mounted in).
    Returns its sha256 (the tar is in `folder`)."""
    machine = f"{os.uname().machine}-linux-gnu"
    objects = ["/usr/bin/python3.11", *glob.glob("/usr/lib/python3.11/lib-dynload/*.so")]
    for site in (p for p in sys.path if p.endswith(("site-packages", "dist-packages"))):
        for pattern in ("*/*.so", "*/*/*.so", "*.so"):
            objects += [
                path
                for path in glob.glob(os.path.join(site, pattern))
                if not path.startswith((os.path.join(site, "torch"), os.path.join(site, "nvidia")))
            ]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
            link = tarfile.TarInfo(name)
            link.type, link.linkname = tarfile.SYMTYPE, target
            tar.addfile(link)
        for name in ("etc", "srv", "usr/lib64", f"usr/lib/{machine}"):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        tar.add("/usr/bin/python3.11", "usr/bin/python3.11")

        def stdlib(member: tarfile.TarInfo) -> tarfile.TarInfo | None:
            parts = member.name.split("/")
            if len(parts) > 3 and parts[3] in STDLIB_LEFT_OUT:
                return None
            return member

        tar.add("/usr/lib/python3.11", "usr/lib/python3.11", filter=stdlib)
        for library in sorted(_libraries(objects)):
            where = "usr/lib64" if library.startswith("/lib64/") else f"usr/lib/{machine}"
            tar.add(os.path.realpath(library), f"{where}/{os.path.basename(library)}")
    raw = buffer.getvalue()
    sha256 = hashlib.sha256(raw).hexdigest()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / sha256).write_bytes(raw)
    return sha256
