"""The host's NVIDIA driver files that a GPU replica on an image gets, whatever its image
(as the NVIDIA container toolkit does): the driver's user-space libraries (libcuda.so*,
libcudadebugger.so*, libnvidia-*.so*) and nvidia-smi, bind-mounted read-only under
`/ember/driver/` inside, found by the loader's path through LD_LIBRARY_PATH (after the
image's own) and on PATH. The GPUs' device nodes are the sandbox's, as for any replica
(replica_access.gpu_device_nodes). CUDA runtimes (libcudart, cuBLAS...) are not the
driver's: they come from the image.

The image's own folders are read-only mounts of the image, so the libraries cannot go
where the toolkit puts them (beside the image's system libraries): they get a folder of
their own. `driver_files` is pure over what the node has: `ldconfig -p`'s output and
the listings of driver folders (tests pass folders of files named like the driver's);
`node_driver_files` reads this node's.
"""

from __future__ import annotations

import fnmatch
import os
import platform
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

DRIVER_INSIDE = "/ember/driver"
LIB_INSIDE = DRIVER_INSIDE + "/lib"
BIN_INSIDE = DRIVER_INSIDE + "/bin"
# The driver's, not a CUDA toolkit's (libcudart.so*, libcublas.so*... are the image's).
LIBRARY_PATTERNS = ("libcuda.so*", "libcudadebugger.so*", "libnvidia-*.so*")
BINARIES = ("nvidia-smi",)
# Where drivers put their libraries when the loader's cache does not name them
# (NVIDIA's .run installer on some systems, Kubernetes' device plugins, Debian's packages).
DRIVER_FOLDERS = (
    "/usr/lib64/nvidia",
    "/usr/local/nvidia/lib64",
    "/usr/lib/x86_64-linux-gnu/nvidia/current",
    "/usr/lib/aarch64-linux-gnu/nvidia/current",
)
BIN_FOLDERS = ("/usr/bin", "/usr/local/bin", "/usr/local/nvidia/bin", "/bin")
# How `ldconfig -p` tags a library of this machine's architecture (a 32-bit library on a
# 64-bit machine is tagged "(libc6)" alone).
ARCH_TAGS = {"x86_64": "x86-64", "aarch64": "AArch64", "ppc64le": "64bit"}


@dataclass(frozen=True)
class DriverFiles:
    """(host path, path inside) of each library and binary; empty where none was found."""

    libraries: list[tuple[str, str]] = field(default_factory=list)
    binaries: list[tuple[str, str]] = field(default_factory=list)

    @property
    def mounts(self) -> list[tuple[str, str]]:
        return [*self.libraries, *self.binaries]

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with the driver's folders last on LD_LIBRARY_PATH and PATH (an image's
        own, cuda-compat's for instance, come first)."""
        if not self.mounts:
            return env
        out = dict(env)
        if self.libraries:
            out["LD_LIBRARY_PATH"] = _append(env.get("LD_LIBRARY_PATH", ""), LIB_INSIDE)
        if self.binaries:
            out["PATH"] = _append(env.get("PATH", ""), BIN_INSIDE)
        return out


def _append(path: str, folder: str) -> str:
    parts = [p for p in path.split(":") if p]
    return ":".join([*parts, folder] if folder not in parts else parts)


def is_driver_library(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in LIBRARY_PATTERNS)


def parse_ldconfig(output: str, arch_tag: str | None) -> list[tuple[str, str]]:
    """(name, path) of each library `ldconfig -p` lists for this architecture
    (`arch_tag`; None: any)."""
    found = []
    for line in output.splitlines():
        name, sep, path = line.strip().partition(" => ")
        if not sep or " (" not in name:
            continue
        name, _, tags = name.partition(" (")
        tag_list = [t.strip() for t in tags.rstrip(")").split(",")]
        if arch_tag is not None and arch_tag not in tag_list:
            continue
        found.append((name.strip(), path.strip()))
    return found


def driver_files(
    ldconfig: str,
    folders: Mapping[str, Sequence[str]],
    binaries: Mapping[str, str],
    *,
    arch_tag: str | None,
) -> DriverFiles:
    """The driver's files a GPU replica on an image gets, from `ldconfig` (`ldconfig -p`'s
    output), `folders` (a driver folder -> the names in it, read where the loader's
    cache names no driver library) and `binaries` (name -> host path). Each library is
    mounted under the names the node knows it by (libcuda.so.1, and libcuda.so where the
    node has that link), from the file they lead to; the first of a name wins."""
    named: dict[str, str] = {}
    for name, path in parse_ldconfig(ldconfig, arch_tag):
        if is_driver_library(name) and name not in named:
            named[name] = path
    if not named:
        for folder, names in folders.items():
            for name in sorted(names):
                if is_driver_library(name) and name not in named:
                    named[name] = os.path.join(folder, name)
    libraries = [
        (os.path.realpath(path), f"{LIB_INSIDE}/{name}")
        for name, path in sorted(named.items())
        if os.path.isfile(path)  # a dangling link is no library
    ]
    bins = [
        (os.path.realpath(path), f"{BIN_INSIDE}/{name}")
        for name, path in sorted(binaries.items())
        if os.path.isfile(path)
    ]
    return DriverFiles(libraries, bins)


def node_driver_files() -> DriverFiles:
    """This node's driver files (blocking: runs `ldconfig -p`, lists a few folders)."""
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        output = subprocess.run(
            [ldconfig, "-p"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        output = ""
    folders = {f: os.listdir(f) for f in DRIVER_FOLDERS if os.path.isdir(f)}
    binaries = {}
    for name in BINARIES:
        path = shutil.which(name, path=os.pathsep.join(BIN_FOLDERS))
        if path is not None:
            binaries[name] = path
    return driver_files(output, folders, binaries, arch_tag=ARCH_TAGS.get(platform.machine()))
