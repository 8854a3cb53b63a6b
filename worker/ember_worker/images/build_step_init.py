"""Run one image build step in a sandbox of its own, as root of a user namespace that
maps to an unprivileged range of the node's uids:

    python -I -S build_step_init.py PLAN

Started by the agent as root, PID 1 of new mount, UTS, IPC and PID namespaces (`unshare
--mount --uts --ipc --pid --fork --kill-child`, in the step's cgroup). Here, still the
node's root: the overlay of the image's layers is mounted (nosuid, nodev: a device node
a registry layer carries opens nothing), `pivot_root` into it and the node's root
detached, so that no chroot escape finds the node's files; then a tmpfs `/tmp`, a tmpfs
`/dev` holding the node's harmless device nodes (the layers' own are never unpacked),
and the node's CA bundle and resolv.conf, read-only; `/proc`
of the step's PID namespace with the kernel's settings read-only. Then the step's
process moves into a new user namespace whose uid and gid 0..COUNT-1 are the node's
BASE..BASE+COUNT-1 (written from outside, by this process), takes no_new_privs and the
replicas' seccomp filter, and execs `/bin/sh -c SCRIPT` with the step's environment.
Root in there owns the layers (unpacked shifted by BASE) and nothing of the node's.

PLAN is a JSON file the agent wrote: overlay options, the mount point, whether to bind
resolv.conf over an empty file made for it, the CA bundle, the uid range, the script and
its environment (the tenant's, used for the exec alone). The standard library only, and
Ember's own modules imported before the root changes.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from typing import Any

CLONE_NEWUSER = 0x10000000
# The new mount API (the same numbers on x86_64 and aarch64).
SYS_OPEN_TREE, SYS_MOVE_MOUNT = 428, 429
AT_FDCWD = -100
OPEN_TREE_FLAGS = 1 | os.O_CLOEXEC  # OPEN_TREE_CLONE
MOVE_EMPTY = 0x4  # MOVE_MOUNT_F_EMPTY_PATH
PR_SET_NO_NEW_PRIVS = 38
PR_SET_PDEATHSIG = 1
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
HOSTNAME = b"build"
EXIT_CANNOT_START = 126


def _with_package() -> None:
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path.insert(0, os.path.dirname(os.path.dirname(here)))


def _prepare_root(plan: dict[str, Any], libc: ctypes.CDLL) -> int:
    """The step's root mounted and entered (as the node's root, in our mount namespace);
    a descriptor of a /proc of our PID namespace, mounted first outside that root (the
    image may have no /proc): where the child's ids are mapped from.

    Every path inside the image is the tenant's (a layer's `/tmp` or `/etc` may be a link
    to any node path), so none is named before `pivot_root`: what the node lends (device
    nodes, its CA bundle and resolv.conf) is cloned first as detached mounts
    (`open_tree`), then moved onto paths resolved inside the new root, links and all."""
    from ember_worker.processes import mount_namespace as ns
    from ember_worker.processes.sandbox_mounts import DEV_LINKS

    root = str(plan["root"])
    ns._mount(libc, None, "/", None, ns.MS_REC | ns.MS_PRIVATE)
    ns._mount(libc, "proc", str(plan["proc"]), "proc", ns.PROC_FLAGS)
    proc = os.open(str(plan["proc"]), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    ns._mount(libc, "overlay", root, "overlay", ns.MS_NOSUID | ns.MS_NODEV, str(plan["overlay"]))
    lent = [(f"/dev/{name}", f"/dev/{name}", True) for name in DEVICES]
    # The node's CA bundle over the image's (a node behind a TLS-inspecting proxy trusts
    # its CA; the step's pip and apt must too), and its resolv.conf: neither in the layer.
    lent.append((CA_BUNDLE, CA_BUNDLE, False))
    if plan["resolv"]:
        lent.append(("/etc/resolv.conf", "/etc/resolv.conf", False))
    clones = [
        (_clone(libc, source), target, device)
        for source, target, device in lent
        if os.path.isfile(source) or (device and os.path.exists(source))
    ]
    ns._call(libc.sethostname(HOSTNAME, len(HOSTNAME)), "sethostname")
    os.chdir(root)
    # pivot_root(".", "."): the node's root ends up on top, then goes: nothing of it
    # is left to escape to, nor to be reached by a link from here on.
    ns._call(libc.syscall(ns._pivot_root_number(), b".", b"."), "pivot_root")
    ns._call(libc.umount2(b".", ns.MNT_DETACH), "detaching the node's root")
    os.chdir("/")
    if os.path.isdir("/tmp"):
        ns._mount(libc, "tmpfs", "/tmp", "tmpfs", ns.MS_NOSUID | ns.MS_NODEV, "mode=1777")
    if os.path.isdir("/dev"):
        _device_folder(libc, DEV_LINKS)
    for clone, target, device in clones:
        if target == "/etc/resolv.conf":  # made for it (the agent removes it after)
            os.makedirs("/etc", exist_ok=True)
            if not os.path.lexists(target):
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
        if os.path.isfile(target) or (device and os.path.exists(target)):
            _attach(libc, clone, target, device)
        os.close(clone)
    if os.path.isdir("/proc"):
        ns._mount(libc, "proc", "/proc", "proc", ns.PROC_FLAGS)
        for name in ns.PROC_READ_ONLY:  # the kernel's settings, as for replicas
            path = "/proc/" + name
            if os.path.exists(path):
                ns._mount(libc, path, path, None, ns.MS_BIND)
                flags = ns.MS_REMOUNT | ns.MS_BIND | ns.MS_RDONLY | ns.PROC_FLAGS
                ns._mount(libc, None, path, None, flags)
    return proc


def _device_folder(libc: ctypes.CDLL, links: dict[str, str]) -> None:
    """A tmpfs over the image's /dev (nothing of it lands in the layer): empty files
    where the node's device nodes are mounted, /dev/shm, and the usual `links`."""
    from ember_worker.processes import mount_namespace as ns

    flags = ns.MS_NOSUID | ns.MS_NODEV | ns.MS_NOEXEC
    ns._mount(libc, "tmpfs", "/dev", "tmpfs", flags, "mode=755,size=64m")
    for name in DEVICES:
        os.close(os.open(f"/dev/{name}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    os.mkdir("/dev/shm", 0o1777)
    os.chmod("/dev/shm", 0o1777)
    os.mkdir("/dev/pts", 0o755)
    for name, target in links.items():
        os.symlink(target, f"/dev/{name}")


def _clone(libc: ctypes.CDLL, source: str) -> int:
    """A detached bind mount of the node's `source` (a descriptor)."""
    fd = int(libc.syscall(SYS_OPEN_TREE, AT_FDCWD, source.encode(), OPEN_TREE_FLAGS))
    if fd < 0:
        raise OSError(ctypes.get_errno(), f"open_tree {source}")
    return fd


def _attach(libc: ctypes.CDLL, clone: int, target: str, device: bool) -> None:
    """The detached mount `clone` onto `target` (resolved in the new root), read-only,
    nosuid, and nodev unless it is a device node."""
    from ember_worker.processes import mount_namespace as ns

    moved = libc.syscall(SYS_MOVE_MOUNT, clone, b"", AT_FDCWD, target.encode(), MOVE_EMPTY)
    ns._call(int(moved), f"move_mount onto {target}")
    flags = ns.MS_REMOUNT | ns.MS_BIND | ns.MS_RDONLY | ns.MS_NOSUID
    ns._mount(libc, None, target, None, flags | (0 if device else ns.MS_NODEV))


def _map_ids(proc: int, pid: int, base: int, count: int) -> None:
    """The child's user namespace: its 0..count-1 are the node's base..base+count-1."""
    for name in ("uid_map", "gid_map"):
        ids = os.open(f"{pid}/{name}", os.O_WRONLY | os.O_CLOEXEC, dir_fd=proc)
        try:
            os.write(ids, f"0 {base} {count}\n".encode())
        finally:
            os.close(ids)


def _step(plan: dict[str, Any], libc: ctypes.CDLL, told: int, go: int) -> None:
    """The child: into a user namespace, mapped by the parent; then root there only."""
    from ember_worker.processes import seccomp_filter

    if libc.unshare(CLONE_NEWUSER) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")
    os.write(told, b"u")
    os.close(told)
    if os.read(go, 1) != b"m":
        raise OSError("the user namespace's ids were not mapped")
    os.close(go)
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "no_new_privs")
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    seccomp_filter.install()
    env = {str(k): str(v) for k, v in plan["env"].items()}
    os.execve("/bin/sh", ["/bin/sh", "-c", str(plan["script"])], env)


def main(args: list[str]) -> int:
    if len(args) != 1:
        print("usage: build_step_init.py PLAN", file=sys.stderr)
        return 2
    with open(args[0]) as source:
        plan: dict[str, Any] = json.load(source)
    _with_package()
    # Loaded before the root changes: the node's modules are not in the image.
    from ember_worker.processes import seccomp_filter
    from ember_worker.processes.sandbox_exec import waited_as_a_shell_says

    libc = ctypes.CDLL(None, use_errno=True)
    try:
        problem = seccomp_filter.available()
        if problem is not None:
            raise OSError(problem)
        proc = _prepare_root(plan, libc)
    except OSError as exc:
        print(f"ember build step: cannot build its sandbox: {exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    told_r, told_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(told_r)
        os.close(go_w)
        try:
            _step(plan, libc, told_w, go_r)
        except OSError as exc:
            print(f"ember build step: cannot start the step: {exc}", file=sys.stderr)
        os._exit(EXIT_CANNOT_START)
    os.close(told_w)
    os.close(go_r)
    if os.read(told_r, 1) == b"u":
        try:
            _map_ids(proc, pid, int(plan["base"]), int(plan["count"]))
            os.write(go_w, b"m")
        except OSError as exc:
            print(f"ember build step: cannot map its user namespace: {exc}", file=sys.stderr)
    os.close(go_w)
    os.close(told_r)
    return waited_as_a_shell_says(pid)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
