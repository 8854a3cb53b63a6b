"""One build command run as root in a chroot of an image's layers so far, in mount and
PID namespaces of its own (`unshare`): the overlay, /proc, a few device nodes and the
node's resolv.conf are mounted there only, and vanish with the command. Its file
changes land in the overlay's upper folder, the new layer.

Nothing here runs on the control plane: the builder is the worker agent's."""

from __future__ import annotations

import os
import shlex
import subprocess
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ember_worker.processes.process_env import NODE_PROXIES, ROOT_ENV, system_tool

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TAIL_LINES = 20  # of a failed command's output, in its error

# Runs as PID 1 of the new PID namespace, in the new mount namespace: $1 the overlay's
# options, $2 the mount point, $3 whether resolv.conf was made for this step; then the
# command to run (env, then chroot into the mount point). The devices a build may open
# are the node's own, bound one by one over those the image has (never all of /dev). A
# build reaches the network as the node does: with its resolv.conf, and with its CA
# bundle over the image's (a node behind a TLS-inspecting proxy trusts its CA; pip
# and apt in the build must too). Neither is part of the layer.
MOUNT_THEN_CHROOT = r"""
set -e
root="$2"
mount -t overlay overlay -o "$1" "$root"
[ ! -d "$root/proc" ] || mount -t proc proc "$root/proc"
[ ! -d "$root/tmp" ] || mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"
for device in null zero full random urandom tty; do
    [ ! -e "$root/dev/$device" ] || mount --bind "/dev/$device" "$root/dev/$device"
done
bundle=/etc/ssl/certs/ca-certificates.crt
if [ -f "$bundle" ] && [ -f "$root$bundle" ] && [ ! -L "$root$bundle" ]; then
    mount --bind "$bundle" "$root$bundle"
fi
if [ -e /etc/resolv.conf ]; then
    [ -e "$root/etc/resolv.conf" ] || { mkdir -p "$root/etc"; : > "$root/etc/resolv.conf"; }
    mount --bind /etc/resolv.conf "$root/etc/resolv.conf"
fi
shift 3
exec "$@"
"""


@dataclass
class CommandResult:
    returncode: int
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))


def overlay_options(lowers: Sequence[Path], upper: Path, work: Path) -> str:
    """Top layer first, as overlayfs wants; no redirects or metacopy, whose extended
    attributes an OCI layer cannot carry."""
    lower = ":".join(str(path) for path in lowers)
    return f"lowerdir={lower},upperdir={upper},workdir={work},redirect_dir=off,metacopy=off"


def _environment_script(variables: dict[str, str]) -> str:
    """Shell lines that leave exactly `variables` exported (the shell starts with
    ROOT_ENV's); a name that is not a shell variable's fails the step, saying so."""
    lines = [f"unset {name}" for name in ROOT_ENV if name not in variables]
    lines += [
        f"export {shlex.quote(f'{key}={value}')} || exit 2" for key, value in variables.items()
    ]
    return "\n".join(lines)


def run_in_layers(
    lowers: Sequence[Path],
    upper: Path,
    scratch: Path,
    command: str,
    env: dict[str, str],
    workdir: str,
    on_line: Callable[[str], None],
) -> CommandResult:
    """`sh -c command` as root in the chroot of `lowers` (top first) with `upper` taking
    its changes, in `workdir` (made when missing) with `env`; each line of its output
    (stdout and stderr together) goes to `on_line` as it comes."""
    work, mountpoint = scratch / "work", scratch / "root"
    for folder in (upper, work, mountpoint):
        folder.mkdir(parents=True, exist_ok=True)
    resolv_made = (
        not any((layer / "etc" / "resolv.conf").exists() for layer in lowers)
        and not (upper / "etc" / "resolv.conf").exists()
    )
    # The node's proxy settings, as its own downloads use them (the image's env wins).
    proxies = {name: os.environ[name] for name in NODE_PROXIES if name in os.environ}
    variables = {
        "PATH": PATH,
        "HOME": "/root",
        "DEBIAN_FRONTEND": "noninteractive",
        **proxies,
        **env,
    }
    script = f"mkdir -p {shlex.quote(workdir)} && cd {shlex.quote(workdir)} && {command}"
    argv = [
        system_tool("unshare"),
        "--mount",
        "--pid",
        "--fork",
        "--propagation",
        "private",
        "--",
        "/bin/sh",
        "-c",
        MOUNT_THEN_CHROOT,
        "ember-image-step",
        overlay_options(lowers, upper, work),
        str(mountpoint),
        "1" if resolv_made else "0",
        # The node's chroot (an image may have only a shell), run with the agent's fixed
        # environment: the step's variables (the image's, the tenant's) are set by the
        # image's shell inside, never in a process of the node's.
        system_tool("chroot"),
        str(mountpoint),
        "/bin/sh",
        "-c",
        f"{_environment_script(variables)}\n{script}",
    ]
    result = CommandResult(returncode=-1)
    with subprocess.Popen(
        argv,
        env=ROOT_ENV,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
    ) as process:
        assert process.stdout is not None  # piped above
        for line in process.stdout:
            line = line.rstrip("\n")
            result.tail.append(line)
            on_line(line)
        result.returncode = process.wait()
    if resolv_made:
        # The node's resolv.conf was bound over an empty file made for it: not the image's.
        (upper / "etc" / "resolv.conf").unlink(missing_ok=True)
    return result
