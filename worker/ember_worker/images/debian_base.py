"""The first layer of `Image.debian_slim()`: a minimal Debian (mmdebstrap's "minbase"
variant) with Debian's python3, from the Debian mirror the node's own apt sources name,
written by mmdebstrap straight as a layer tar. pip is not in it: the first
`pip_install` step installs Debian's python3-pip in its own layer (it and the byte
compiling of its modules took most of a base build's time, for images that may never
use it)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import deque
from collections.abc import Callable
from pathlib import Path

from ember_worker.processes.process_env import ROOT_ENV, node_proxies

SOURCES = Path("/etc/apt/sources.list")
SOURCES_DIR = Path("/etc/apt/sources.list.d")
# ca-certificates: pip and apt over https inside the image.
PACKAGES = ("python3", "ca-certificates")
TAIL_LINES = 20


class BaseImageError(Exception):
    def __init__(self, message: str, tail: list[str]) -> None:
        super().__init__(message)
        self.tail = tail


def node_mirror(sources: Path = SOURCES, sources_dir: Path = SOURCES_DIR) -> str | None:
    """The first Debian archive (not its security one) the node's apt sources name, in
    either format (one-line or deb822); None when they name none."""
    texts = []
    if sources.exists():
        texts.append(sources.read_text(errors="replace"))
    if sources_dir.is_dir():
        texts.extend(
            p.read_text(errors="replace") for p in sorted(sources_dir.glob("*")) if p.is_file()
        )
    for text in texts:
        for uri in _uris(text):
            if uri.startswith(("http://", "https://")) and "security" not in uri:
                return uri.rstrip("/")
    return None


def _uris(text: str) -> list[str]:
    found: list[str] = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        one_line = re.match(r"deb\s+(?:\[[^\]]*\]\s+)?(\S+)", line)
        if one_line:
            found.append(one_line.group(1))
        elif line.lower().startswith("uris:"):
            found.extend(line.split(":", 1)[1].split())
    return found


def make_base(
    suite: str,
    archive: Path,
    scratch: Path,
    on_line: Callable[[str], None],
    mirror: str | None = None,
) -> None:
    """mmdebstrap's tar of `suite` at `archive`; its output goes line by line to
    `on_line`. A failure raises BaseImageError with its last lines."""
    program = shutil.which("mmdebstrap")
    if program is None:
        raise BaseImageError(
            "mmdebstrap is not installed on this node: debian_slim images need it "
            "(apt-get install mmdebstrap, or infra/install.sh)",
            [],
        )
    mirror = mirror or node_mirror()
    if mirror is None:
        # No built-in default: a node builds from the archive its operator chose.
        raise BaseImageError(
            f"this node's apt sources ({SOURCES}, {SOURCES_DIR}) name no Debian mirror: "
            "debian_slim images are built from the one they name; add one there",
            [],
        )
    scratch.mkdir(parents=True, exist_ok=True)
    argv = [
        program,
        "--variant=minbase",
        f"--include={','.join(PACKAGES)}",
        "--mode=root",
        "--format=tar",
        # A layer is written once and checked by its hash: dpkg's fsync after every file
        # only slows the build (several times over on a busy disk).
        "--dpkgopt=force-unsafe-io",
        # No package lists or caches in the layer: each apt_install step fetches its own.
        '--aptopt=Acquire::Languages "none"',
        '--customize-hook=rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin',
        suite,
        str(archive),
        mirror,
    ]
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    with subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        cwd=scratch,
        # Root's fixed environment and the node's proxies: nothing else of the agent's.
        env={**ROOT_ENV, **node_proxies(), "TMPDIR": str(scratch), "LC_ALL": "C.UTF-8"},
    ) as process:
        for line in process.stdout or ():
            line = line.rstrip("\n")
            tail.append(line)
            on_line(line)
        code = process.wait()
    if code != 0:
        raise BaseImageError(f"mmdebstrap {suite} exited with {code}", list(tail))
