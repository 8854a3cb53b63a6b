"""Replicas of an endpoint with `image=`: the image's root file system as theirs, and
Ember's runtime brought into it.

The sandbox (sandboxes.py) bind-mounts each top-level entry of the image's root (the
node's copy of it, image_roots.py) read-only at `/<entry>`, and its top-level links as
links: the image is the replica's system, /usr, /etc and all, the node's none of it
(but its resolv.conf and hosts, mounted over the image's). The replica runs the image's
own `python3.X` of the worker's version. Ember's runtime (its packages, and the worker's
site-packages with their compiled dependencies) is mounted read-only under
`/ember/runtime`: Ember's packages first on the path (PYTHONPATH), the worker's
site-packages last (after the image's own: a package the image installs wins over the
worker's copy). The image's env applies under the endpoint's own variables, and the
replica starts in the image's working folder. A replica holding GPUs also gets the
host's driver libraries and nvidia-smi under `/ember/driver` (gpu_driver_files.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import ember
import ember_worker
from ember_worker.agent.replicas.gpu_driver_files import DriverFiles
from ember_worker.identity import WORKDIR_ENV
from ember_worker.images.image_roots import ImageConfig

RUNTIME_INSIDE = "/ember/runtime"
PACKAGES_INSIDE = RUNTIME_INSIDE + "/packages"  # ember, ember_worker
CA_INSIDE = "/ember/ca.pem"
# Top-level entries of an image the sandbox does not take from it: its own /proc, /dev,
# /tmp, /home (the working area), /ember (the runtime and the worker's folders), no /sys.
RESERVED = frozenset({"proc", "dev", "tmp", "home", "ember", "sys"})
# Of the node's /etc copy (sandboxes.py), mounted over the image's (image_roots.py made
# the mount points): names and addresses as the node resolves them.
ETC_FROM_NODE = ("resolv.conf", "hosts")
# The node's Python's variables, not the image's.
NODE_PYTHON_ENV = frozenset({"PYTHONHOME", "PYTHONPATH", "VIRTUAL_ENV", "PYTHONSTARTUP"})
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class ImageRun:
    """What a replica of an image runs on: the image's root on the node and its config,
    its interpreter (the path inside), the runtime folders of the worker (host, inside)."""

    root: Path
    config: ImageConfig
    python: str
    runtime: list[tuple[str, str]] = field(default_factory=list)
    entries: list[tuple[str, str]] = field(default_factory=list)  # (host, "/name")
    links: dict[str, str] = field(default_factory=dict)  # name -> where it points
    driver: DriverFiles | None = None  # the host's GPU driver files (a GPU replica's)

    @property
    def site_dirs(self) -> list[str]:
        return [inside for _, inside in self.runtime if not inside.startswith(PACKAGES_INSIDE)]

    def boot(self) -> list[str]:
        """The interpreter's arguments that start the replica: the worker's site-packages
        added after the image's (with their .pth files), then the replica's boot module
        run as `-m` runs it."""
        code = (
            "import runpy, site\n"
            f"for folder in {self.site_dirs!r}:\n"
            "    site.addsitedir(folder)\n"
            "runpy.run_module('ember_worker.replica.boot', run_name='__main__', alter_sys=True)\n"
        )
        return ["-P", "-c", code]

    def env(self, base: dict[str, str], own: dict[str, str]) -> dict[str, str]:
        """The replica's variables: `base` (the agent's: the node's and Ember's) less
        what names the node's Python, the image's over them, the endpoint's `own` over
        those, then what Ember's runtime needs to import inside."""
        env = {k: v for k, v in base.items() if k not in NODE_PYTHON_ENV}
        env.update({"PATH": DEFAULT_PATH, **self.config.env, **own})
        env["PYTHONPATH"] = PACKAGES_INSIDE
        env[WORKDIR_ENV] = self.config.workdir
        return self.driver.env(env) if self.driver is not None else env


def runtime_folders() -> list[tuple[str, str]]:
    """(host folder, path inside) of what replicas import Ember from: its packages, and
    the worker's site-packages (its dependencies, built for the worker's Python)."""
    folders = [
        (os.path.realpath(Path(str(package.__file__)).parent), f"{PACKAGES_INSIDE}/{name}")
        for name, package in (("ember", ember), ("ember_worker", ember_worker))
    ]
    sites = [
        os.path.realpath(p)
        for p in sys.path
        if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)
    ]
    for index, site in enumerate(dict.fromkeys(sites)):
        folders.append((site, f"{RUNTIME_INSIDE}/site{index}"))
    return folders


def image_run(root: Path, config: ImageConfig, python: str) -> ImageRun:
    """The replica's view of an image whose root is `root` on this node."""
    entries: list[tuple[str, str]] = []
    links: dict[str, str] = {}
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name in RESERVED:
            continue
        if entry.is_symlink():
            links[entry.name] = os.readlink(entry.path)
        elif entry.is_dir() or entry.is_file():
            entries.append((entry.path, "/" + entry.name))
    return ImageRun(root, config, python, runtime_folders(), entries, links)
