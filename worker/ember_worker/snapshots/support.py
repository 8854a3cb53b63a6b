"""Whether this node can take and restore snapshots: which CRIU it runs (4.1 or newer,
with pycriu), whether `criu check` passes and the kernel allows lazy restores, and the
key of what a restore depends on besides the image (`environment_key`)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIN_CRIU = (4, 1)
CRIU_CANDIDATES = ("/usr/local/sbin/criu", "/usr/sbin/criu")
CRIU_BINARY_ENV = "EMBER_CRIU_BINARY"  # a CRIU kept elsewhere (bench/gpu_checks.sh's kit)


@dataclass(frozen=True)
class SnapshotSupport:
    problem: str | None  # why this node cannot snapshot, or None
    criu_binary: str | None
    criu_version: str | None
    env_key: str  # what must match between the node that dumped and the one restoring
    lazy_pages: bool = False  # the kernel lets CRIU restore memory lazily (userfaultfd)

    def hello(self) -> dict[str, Any]:
        return {
            "problem": self.problem,
            "criu": self.criu_version,
            "env_key": self.env_key,
            "lazy_pages": self.lazy_pages,
        }


def _criu_binary() -> str | None:
    """$EMBER_CRIU_BINARY when set, else ours (infra/criu.sh), Debian's, then PATH's."""
    chosen = os.environ.get(CRIU_BINARY_ENV)
    if chosen:
        return chosen if os.access(chosen, os.X_OK) else None
    for candidate in CRIU_CANDIDATES:
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("criu")


def _criu_version(binary: str) -> str | None:
    result = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    for line in result.stdout.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return None


def _cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    return platform.machine()


def _gpu_identity() -> str:
    """GPU model and driver, from nvidia-smi when present; CUDA itself is never imported."""
    if shutil.which("nvidia-smi") is None:
        return "none"
    result = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    )
    return result.stdout.strip() or "unknown"


def environment_key(criu_version: str | None) -> str:
    """A digest of what a restore depends on besides the bundle: interpreter, libraries,
    CRIU, kernel, CPU features and GPU (model and driver)."""
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    parts = {
        "python": sys.version,
        "executable": sys.executable,
        "torch": torch_version,
        "criu": criu_version,
        "kernel": platform.release(),
        "cpu": _cpu_flags(),
        "gpu": _gpu_identity(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def detect_support(pid_namespace_problem: str | None) -> SnapshotSupport:
    binary = _criu_binary()
    version = _criu_version(binary) if binary else None
    problem = None
    if pid_namespace_problem:
        problem = f"replicas cannot have their own PID namespace ({pid_namespace_problem})"
    elif binary is None and os.environ.get(CRIU_BINARY_ENV):
        problem = f"{CRIU_BINARY_ENV}={os.environ[CRIU_BINARY_ENV]} is not an executable file"
    elif binary is None:
        problem = "CRIU is not installed (infra/install.sh installs it, as root)"
    elif version is None or tuple(int(p) for p in version.split(".")[:2]) < MIN_CRIU:
        problem = f"CRIU {version} is too old; 4.1 or newer is needed"
    else:
        try:
            import pycriu  # noqa: F401
        except ImportError:
            problem = "pycriu is not installed in this environment (infra/install.sh)"
    if problem is None and binary is not None:
        check = subprocess.run([binary, "check"], capture_output=True, text=True, check=False)
        if check.returncode != 0:
            lines = (check.stderr or check.stdout).strip().splitlines()
            problem = "`criu check` fails: " + (lines[-1] if lines else "no output")
    lazy = False
    if problem is None and binary is not None:
        # Lazy restores need userfaultfd with fork/remap events (the restored process
        # may start threads and move memory while its pages are still arriving).
        feature = [binary, "check", "--feature", "uffd-noncoop"]
        lazy = subprocess.run(feature, capture_output=True, check=False).returncode == 0
    return SnapshotSupport(problem, binary, version, environment_key(version), lazy)


def restores_lazily(requested: bool, support: SnapshotSupport, meta: dict[str, Any]) -> bool:
    """Whether a restore from an image with `meta` is lazy: asked for, allowed by this
    node's kernel, and the image holds no GPU state. The driver copies that back to the
    device at once after the restore, which through userfaultfd would be page by page,
    for no gain, and it has never been tried."""
    return requested and support.lazy_pages and not meta.get("cuda")
