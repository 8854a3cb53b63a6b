"""Run a command as PID 1 of a new PID namespace and end as it ended.

    python -I -S pid_namespace_init.py [--user UID:GID] COMMAND [ARG ...]

The agent starts cold replicas through this script, run by path with the standard
library alone (no site packages: it starts in milliseconds). It stays outside the
namespace as the replica's parent and leaves with the replica's exit status: the same
exit code, or killed by the same signal, so that the agent can tell a crash or the OOM
killer from a clean exit. (util-linux's `unshare --pid --fork`, which did this before,
reports a child killed by a signal as exit code 0, or 1 for SIGKILL, in Debian 12's
version.) If this process is killed, the kernel kills the replica too.

With --user, the replica gives up root here, between the fork and the exec: no
supplementary groups, the gid and uid given, no_new_privs, and no capabilities (the
bounding set emptied while it still may, then the rest lost with the uid). Here and not
in the replica's own code, because the replica's interpreter runs code of the app's
before Ember's (its environment's `.pth` files, `sitecustomize`, the packages its
requirements installed): nothing the app brings ever runs as root. The checks read
/proc/self/status back, and any step that fails ends the start (exit 126): a replica
never runs with more than it should.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys

CLONE_NEWPID = 0x20000000
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
REPLICA_UMASK = 0o077  # what the replica creates is its own (its working area, its copies)
EXIT_CANNOT_START = 126  # as shells answer for a command that could not run


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _check(result: int, what: str) -> None:
    if result != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def _status_fields() -> dict[str, str]:
    with open("/proc/self/status") as status:
        return dict(line.rstrip("\n").split(":\t", 1) for line in status if ":\t" in line)


def become(uid: int, gid: int, libc: ctypes.CDLL) -> None:
    """Give up root for good: this process (and what it execs) runs as uid:gid with no
    supplementary groups, no capabilities in any set and no_new_privs (OSError if any of
    it did not hold)."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    with open("/proc/sys/kernel/cap_last_cap") as last:
        last_cap = int(last.read())
    for cap in range(last_cap + 1):  # needs CAP_SETPCAP: before the uid goes
        _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"dropping capability {cap}")
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "ambient caps")
    # Leaving uid 0 clears the effective and permitted sets; the inheritable one stays.
    os.setresuid(uid, uid, uid)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    empty = (_CapData * 2)()
    _check(libc.capset(ctypes.byref(header), empty), "clearing the inheritable set")
    os.umask(REPLICA_UMASK)
    fields = _status_fields()
    held = {k: fields.get(k, "") for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
    if any(int(value or "1", 16) for value in held.values()):
        raise OSError(f"capabilities remain: {held}")
    if fields.get("NoNewPrivs") != "1" or os.getgroups():
        raise OSError("no_new_privs is not set, or supplementary groups remain")
    if {os.getuid(), os.geteuid(), *os.getresuid()} != {uid} or set(os.getresgid()) != {gid}:
        raise OSError(f"still runs as {os.getresuid()}/{os.getresgid()}")


def _user_option(args: list[str]) -> tuple[tuple[int, int] | None, list[str]]:
    """(uid, gid) of a leading `--user UID:GID`, and the command after it."""
    if len(args) >= 2 and args[0] == "--user":
        uid, _, gid = args[1].partition(":")
        return (int(uid), int(gid)), args[2:]
    return None, args


def main(args: list[str]) -> int:
    try:
        user, command = _user_option(args)
    except ValueError:
        user, command = None, []
    if not command:
        print("usage: pid_namespace_init.py [--user UID:GID] COMMAND [ARG ...]", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWPID) != 0:
        error = os.strerror(ctypes.get_errno())
        print(f"pid_namespace_init: unshare(CLONE_NEWPID) failed: {error}", file=sys.stderr)
        return EXIT_CANNOT_START
    pid = os.fork()  # the first child is PID 1 of the new namespace
    if pid == 0:
        try:
            if user is not None:
                become(*user, libc)
        except OSError as exc:
            print(f"pid_namespace_init: cannot give up root: {exc}", file=sys.stderr)
            os._exit(EXIT_CANNOT_START)
        # After the uid change, which clears it; kept by exec: it outlives no parent.
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        try:
            os.execvp(command[0], command)
        except OSError as exc:
            print(f"pid_namespace_init: cannot run {command[0]}: {exc}", file=sys.stderr)
            os._exit(EXIT_CANNOT_START)
    # Signals meant for the replica go to it directly; this process only waits.
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        killed_by = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the replica's crash, not ours
        if killed_by not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(killed_by, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {killed_by})
        os.kill(os.getpid(), killed_by)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
