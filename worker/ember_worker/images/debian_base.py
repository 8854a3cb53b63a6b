"""The first layer of `Image.debian_slim()`: a minimal Debian (mmdebstrap's "minbase"
variant) with Debian's python3, from the Debian mirror the node's own apt sources name,
written by mmdebstrap straight as a layer tar, rootless: mmdebstrap runs as the node's
build account (`BASE_ACCOUNT`) in its unshare mode, so the packages' maintainer scripts
are root of a user namespace mapped to that account's subordinate uids, never the node's
root. pip is not in it: the first
`pip_install` step installs Debian's python3-pip in its own layer (it and the byte
compiling of its modules took most of a base build's time, for images that may never
use it)."""

from __future__ import annotations

import os
import pwd
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
# The account mmdebstrap runs as; infra/install.sh makes it and its subordinate uids.
BASE_ACCOUNT = "ember-build"
SUBUID = Path("/etc/subuid")
SUBGID = Path("/etc/subgid")


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


def subordinate_ids(account: str, table: Path) -> tuple[int, int] | None:
    """The first (first, count) range `table` (/etc/subuid's format) gives `account`."""
    if not table.exists():
        return None
    for line in table.read_text(errors="replace").splitlines():
        name, _, rest = line.partition(":")
        first, _, count = rest.partition(":")
        if name == account and first.isdigit() and count.isdigit():
            return int(first), int(count)
    return None


def base_account(account: str = BASE_ACCOUNT) -> pwd.struct_passwd:
    """The build account, checked: it exists and owns 65536 subordinate uids and gids
    (a minbase's users are below that). Raises BaseImageError saying what to set up."""
    fix = (
        f"debian_slim bases are built rootless as the account {account!r} with 65536 "
        "subordinate uids and gids: run infra/install.sh as root on this node (or "
        f"useradd --system --create-home --home-dir /var/lib/{account} {account}, then "
        f"usermod --add-subuids N-M --add-subgids N-M {account})"
    )
    try:
        entry = pwd.getpwnam(account)
    except KeyError:
        raise BaseImageError(f"this node has no account {account!r}; {fix}", []) from None
    if entry.pw_uid == 0:
        raise BaseImageError(f"the account {account!r} is root; {fix}", [])
    for table in (SUBUID, SUBGID):
        ids = subordinate_ids(account, table)
        if ids is None or ids[1] < 65_536:
            raise BaseImageError(f"{table} gives {account!r} no 65536 ids; {fix}", [])
    if not os.path.isdir(entry.pw_dir) or os.stat(entry.pw_dir).st_uid != entry.pw_uid:
        raise BaseImageError(f"{account!r} has no home folder of its own; {fix}", [])
    if shutil.which("newuidmap") is None or shutil.which("newgidmap") is None:
        raise BaseImageError(
            "newuidmap and newgidmap are missing (apt-get install uidmap, or "
            f"infra/install.sh); {fix}",
            [],
        )
    return entry


def make_base(
    suite: str,
    archive: Path,
    on_line: Callable[[str], None],
    mirror: str | None = None,
) -> None:
    """mmdebstrap's tar of `suite` at `archive`, made as the build account; its output
    goes line by line to `on_line`. A failure raises BaseImageError with its last lines."""
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
    account = base_account()
    on_line(f"mmdebstrap as {account.pw_name}, in its unshare mode (no root)")
    argv = [
        program,
        "--variant=minbase",
        f"--include={','.join(PACKAGES)}",
        "--mode=unshare",
        "--format=tar",
        # A layer is written once and checked by its hash: dpkg's fsync after every file
        # only slows the build (several times over on a busy disk).
        "--dpkgopt=force-unsafe-io",
        # No package lists or caches in the layer: each apt_install step fetches its own.
        '--aptopt=Acquire::Languages "none"',
        '--customize-hook=rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin',
        suite,
        "-",  # the tar on stdout: the agent writes the file, the account reaches none
        mirror,
    ]
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    with (
        open(archive, "wb") as sink,
        subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            cwd=account.pw_dir,
            user=account.pw_uid,
            group=account.pw_gid,
            extra_groups=[],
            # A fixed environment and the node's proxies: nothing else of the agent's.
            # Its root tree is made in its own home (mkdtemp there).
            env={
                **ROOT_ENV,
                **node_proxies(),
                "HOME": account.pw_dir,
                "TMPDIR": account.pw_dir,
                "LC_ALL": "C.UTF-8",
            },
        ) as process,
    ):
        for line in process.stderr or ():
            line = line.rstrip("\n")
            tail.append(line)
            on_line(line)
        code = process.wait()
    if code != 0:
        raise BaseImageError(f"mmdebstrap {suite} exited with {code}", list(tail))
