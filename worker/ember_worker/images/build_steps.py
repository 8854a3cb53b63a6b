"""One build command run on an image's layers so far, in a sandbox of its own: new mount,
UTS, IPC and PID namespaces, the overlay of the layers as its root (`pivot_root`, the
node's root detached), root of a user namespace mapped to an unprivileged range of the
node's uids (`BUILD_UIDS`), no_new_privs and the replicas' seccomp filter, a cgroup of
its own (memory, pids.max, the link-local egress rule that holds for replicas' groups)
and a timeout (build_step_init.py does the part inside the namespaces). Its file
changes land in the overlay's upper folder, the new layer.

Its network is a namespace of its own, made as a replica's (networks/namespaces.py,
of the builds' network uid) and gone with the step: its own loopback, none of the node's
listeners or abstract sockets in sight, egress through pasta (apt and pip download),
but to the node's own addresses and link-local ones. From its loopback only the node's
proxies there are forwarded (the step is given the node's proxy settings). A node
without pasta fails every step, saying what to install.

The layers below are unpacked shifted by the range's first uid (oci_layers.py), so that
root in the step owns them; the upper folder's owners are shifted back when it is packed.

Nothing here runs on the control plane: the builder is the worker agent's."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ember_worker.networks.namespaces import build_network, loopback_ports
from ember_worker.processes import tenant_files
from ember_worker.processes.cgroups import joined
from ember_worker.processes.process_env import ROOT_ENV, node_proxies, system_tool

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PROXY_URLS = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")  # not no_proxy
TAIL_LINES = 20  # of a failed command's output, in its error
STEP_INIT = Path(__file__).with_name("build_step_init.py")
DEFAULT_STEP_TIMEOUT = 30 * 60.0  # seconds; `--build-step-timeout`
EXIT_TIMED_OUT = 124  # as coreutils' `timeout` says it


@dataclass(frozen=True)
class BuildUids:
    """The node's uids that root and the other users of a build step are: uid N inside is
    `first` + N outside, for N below `count`. Not the replicas' range, nor an account's."""

    first: int = 300_000
    count: int = 65_536

    def outside(self, uid: int) -> int:
        return self.first + uid

    def inside(self, uid: int) -> int:
        """The image's owner for the node's `uid` (one outside the range is kept)."""
        return uid - self.first if self.first <= uid < self.first + self.count else uid


BUILD_UIDS = BuildUids()


@dataclass(frozen=True)
class StepLimits:
    """What every step of this node's builds runs within: its timeout, and a cgroup made
    for it (`cgroup(name)`: the `cgroup.procs` files to join and what removes them;
    None where the node has no cgroups)."""

    timeout: float = DEFAULT_STEP_TIMEOUT
    cgroup: Callable[[str], tuple[list[Path], Callable[[], None]]] | None = None


@dataclass
class CommandResult:
    returncode: int
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    timed_out: bool = False


def overlay_options(lowers: Sequence[Path], upper: Path, work: Path) -> str:
    """Top layer first, as overlayfs wants; no redirects or metacopy, whose extended
    attributes an OCI layer cannot carry."""
    lower = ":".join(str(path) for path in lowers)
    return f"lowerdir={lower},upperdir={upper},workdir={work},redirect_dir=off,metacopy=off"


def run_in_layers(
    lowers: Sequence[Path],
    upper: Path,
    scratch: Path,
    command: str,
    env: dict[str, str],
    workdir: str,
    on_line: Callable[[str], None],
    limits: StepLimits | None = None,
) -> CommandResult:
    """`sh -c command` in a sandbox on `lowers` (top first, unpacked shifted by
    BUILD_UIDS) with `upper` taking its changes, in `workdir` (made when missing) with
    `env`; each line of its output (stdout and stderr together) goes to `on_line` as it
    comes. Past the limits' timeout its processes are killed (`timed_out`). OSError when
    its network could not be made (it never runs in the node's)."""
    limits = limits or StepLimits()
    work, mountpoint, proc = scratch / "work", scratch / "root", scratch / "proc"
    for folder in (upper, work, mountpoint, proc):
        folder.mkdir(parents=True, exist_ok=True)
    os.chown(upper, BUILD_UIDS.first, BUILD_UIDS.first)  # the root folder is root's inside
    resolv_made = (
        not any((layer / "etc" / "resolv.conf").exists() for layer in lowers)
        and not (upper / "etc" / "resolv.conf").exists()
    )
    # The node's proxy settings, as its own downloads use them (the image's env wins).
    proxies = node_proxies()
    variables = {"PATH": PATH, "HOME": "/root", "DEBIAN_FRONTEND": "noninteractive"}
    variables.update({**proxies, **env})
    plan, where = scratch / "step.json", shlex.quote(workdir)
    plan.write_text(
        json.dumps(
            {
                "overlay": overlay_options(lowers, upper, work),
                "root": str(mountpoint),
                "proc": str(proc),
                "resolv": resolv_made,
                "base": BUILD_UIDS.first,
                "count": BUILD_UIDS.count,
                "script": f"mkdir -p {where} && cd {where} && {command}",
                "env": variables,
            }
        )
    )
    plan.chmod(0o600)
    # Where pasta is missing this raises, saying what to install: never the node's network.
    network = build_network(
        loopback_ports([proxies[name] for name in PROXY_URLS if name in proxies])
    )
    # nsenter joins it (fixed words), then the rest: the holder is our child, not waited
    # for until the step has ended, so its pid names it all along.
    argv = [system_tool("nsenter"), f"--net=/proc/{network.holder.pid}/ns/net", "--"]
    argv += [system_tool("unshare"), "--mount", "--uts", "--ipc", "--pid", "--fork"]
    argv += ["--kill-child", "--propagation", "private", "--"]
    argv += [sys.executable, "-I", "-S", str(STEP_INIT), str(plan)]
    procs: list[Path] = []
    release: Callable[[], None] = _nothing
    try:
        if limits.cgroup is not None:
            procs, release = limits.cgroup(scratch.name)
        return _run(joined(argv, procs), on_line, limits.timeout)
    finally:
        network.close()  # the step's processes are gone: its namespace goes with the holder
        release()
        if resolv_made:
            # The node's resolv.conf was bound over an empty file made for it: not the image's.
            _remove_made_resolv(upper)


def _remove_made_resolv(upper: Path) -> None:
    """`etc/resolv.conf` out of the step's upper folder, where the step may have made
    `etc` a link to any node folder: nothing on the way is followed."""
    with contextlib.suppress(OSError):
        etc = tenant_files.open_beneath(upper, "etc", os.O_RDONLY | os.O_DIRECTORY)
        try:
            if stat.S_ISREG(os.stat("resolv.conf", dir_fd=etc, follow_symlinks=False).st_mode):
                os.unlink("resolv.conf", dir_fd=etc)
        finally:
            os.close(etc)


def _run(argv: list[str], on_line: Callable[[str], None], timeout: float) -> CommandResult:
    result = CommandResult(returncode=-1)
    with subprocess.Popen(
        argv,
        env=ROOT_ENV,  # the node's tools with the agent's fixed environment, never the step's
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
        start_new_session=True,  # its own process group: killed as one at the timeout
    ) as process:

        def past_timeout() -> None:
            result.timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # unshare's --kill-child ends the rest

        timer = threading.Timer(timeout, past_timeout)
        timer.daemon = True
        timer.start()
        try:
            assert process.stdout is not None  # piped above
            for line in process.stdout:
                line = line.rstrip("\n")
                result.tail.append(line)
                on_line(line)
            result.returncode = process.wait()
        finally:
            timer.cancel()
    if result.timed_out:
        result.returncode = EXIT_TIMED_OUT
    return result


def _nothing() -> None:
    return None
