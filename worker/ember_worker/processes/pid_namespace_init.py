"""Run a command as PID 1 of a new PID namespace and end as it ended.

    python -I -S pid_namespace_init.py [--user UID:GID] [--sandbox PLAN]
        [--root-until-snapshot] [--env-fd FD] [--net-ns FD] [--umask OCTAL]
        COMMAND [ARG ...]

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

It runs as root with the agent's fixed environment (process_env.ROOT_ENV); the
replica's own (its endpoint's env= and secrets: the tenant's) is in the memory file
--env-fd, read by the child only once it has given up root and entered its sandbox, and
used for the exec alone. No variable of the tenant's (`LD_PRELOAD`, `PYTHONPATH`) ever
reaches a root process, and the command is named by absolute path (never found on the
tenant's PATH).

With --net-ns, it first joins the network namespace open as FD (the replica's own,
networks/namespaces.py), before anything else.

With --sandbox, the replica first moves into mount, IPC and UTS namespaces of its own
and into the plan's root (sandbox_mounts.py, PLAN a JSON file the agent wrote), and
runs under the seccomp filter (seccomp_filter.py) from its exec on. With
--root-until-snapshot it keeps uid 0 and gid 0 but no capability other than CAP_SETUID,
CAP_SETGID, CAP_SETPCAP and CAP_CHOWN, which it needs to give up root (and hand its
working area to its user) at its quiet point, after
the dump (boot.py): CRIU, where it lacks CAP_SYS_RESOURCE (a container's root), cannot
read the rlimits of a process of another uid, so it dumps such a one only. Its seccomp
filter then lets the calls that change ids take only 0, -1 or the --user ids: CAP_SETUID
makes it no other uid of the node's (another workspace's, its network's owner).
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys

CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
CAP_CHOWN, CAP_SETGID, CAP_SETUID, CAP_SETPCAP = 0, 6, 7, 8
# What a replica keeps until its snapshot is taken: enough to become its user afterwards,
# and to give its user the working area it wrote in as root.
SNAPSHOT_PHASE_CAPS = (1 << CAP_CHOWN) | (1 << CAP_SETGID) | (1 << CAP_SETUID) | (1 << CAP_SETPCAP)
REPLICA_UMASK = 0o077  # what the replica creates is its own (its working area, its copies)
EXIT_CANNOT_START = 126  # as shells answer for a command that could not run
REPLICA_PID_ENV = "EMBER_REPLICA_PID"  # the replica's PID as the node sees it


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


def limit_root(libc: ctypes.CDLL) -> None:
    """Stay uid 0 and gid 0 with no supplementary groups, no_new_privs and no capability
    but SNAPSHOT_PHASE_CAPS in any set (OSError if that did not hold)."""
    os.setgroups([])
    os.setresgid(0, 0, 0)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    with open("/proc/sys/kernel/cap_last_cap") as last:
        last_cap = int(last.read())
    for cap in range(last_cap + 1):
        if not SNAPSHOT_PHASE_CAPS & (1 << cap):
            _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"dropping capability {cap}")
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "ambient caps")
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    kept = (_CapData * 2)(_CapData(SNAPSHOT_PHASE_CAPS, SNAPSHOT_PHASE_CAPS, 0))
    _check(libc.capset(ctypes.byref(header), kept), "limiting capabilities")
    os.umask(REPLICA_UMASK)
    fields = _status_fields()
    for name in ("CapPrm", "CapEff", "CapBnd"):
        if int(fields.get(name, "1"), 16) & ~SNAPSHOT_PHASE_CAPS:
            raise OSError(f"{name} is {fields.get(name)}")
    if int(fields.get("CapInh", "1"), 16) or int(fields.get("CapAmb", "1"), 16):
        raise OSError("inheritable or ambient capabilities remain")
    if fields.get("NoNewPrivs") != "1" or os.getgroups():
        raise OSError("no_new_privs is not set, or supplementary groups remain")


class Options:
    """The leading options (a plain class: dataclasses take long to import)."""

    def __init__(self) -> None:
        self.user: tuple[int, int] | None = None  # --user UID:GID
        self.sandbox: str | None = None  # --sandbox PLAN
        self.root_until_snapshot = False
        self.env_fd: int | None = None  # --env-fd FD: the replica's environment
        self.net_ns: int | None = None  # --net-ns FD: its network namespace
        self.umask = REPLICA_UMASK  # --umask OCTAL: files others read (a built environment)
        self.command: list[str] = []


def _options(args: list[str]) -> Options:
    """The leading options, and the command after them (ValueError if malformed)."""
    options = Options()
    while args and args[0].startswith("--"):
        if args[0] == "--root-until-snapshot":
            options.root_until_snapshot, args = True, args[1:]
        elif args[0] == "--user" and len(args) >= 2:
            uid, _, gid = args[1].partition(":")
            options.user, args = (int(uid), int(gid)), args[2:]
        elif args[0] == "--sandbox" and len(args) >= 2:
            options.sandbox, args = args[1], args[2:]
        elif args[0] == "--env-fd" and len(args) >= 2:
            options.env_fd, args = int(args[1]), args[2:]
        elif args[0] == "--net-ns" and len(args) >= 2:
            options.net_ns, args = int(args[1]), args[2:]
        elif args[0] == "--umask" and len(args) >= 2:
            options.umask, args = int(args[1], 8), args[2:]
        else:
            raise ValueError(args[0])
    options.command = args
    return options


def _with_package() -> None:
    """Ember's modules importable (run by path with -I: the package's folder is not on
    sys.path yet); before the root changes: an image's root has them elsewhere."""
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path.insert(0, os.path.dirname(os.path.dirname(here)))


def _enter_sandbox(plan_path: str) -> None:
    """Into the plan's namespaces and root (as root, before the user changes)."""
    from ember_worker.processes import mount_namespace, seccomp_filter

    # Loaded before the root changes: an image's root has neither Ember's modules at
    # their node paths nor, maybe, libseccomp.
    seccomp_filter.load_library()
    mount_namespace.enter(mount_namespace.read_plan(plan_path))


def _filter_system_calls(options: Options) -> None:
    from ember_worker.processes import seccomp_filter

    ids = None
    if options.root_until_snapshot:  # CAP_SETUID and CAP_SETGID: root's ids or its user's
        ids = options.user or (0, 0)
    seccomp_filter.install(ids)


def _drop(options: Options, libc: ctypes.CDLL) -> None:
    if options.sandbox is not None:
        _enter_sandbox(options.sandbox)
    if options.root_until_snapshot:
        limit_root(libc)
    elif options.user is not None:
        become(*options.user, libc)
    if options.sandbox is not None:
        _filter_system_calls(options)  # last: it refuses mount and the like


def main(args: list[str]) -> int:
    try:
        options = _options(args)
    except ValueError:
        options = Options()
    command = options.command
    if not command or not os.path.isabs(command[0]):
        print(
            "usage: pid_namespace_init.py [--user UID:GID] [--sandbox PLAN] "
            "[--root-until-snapshot] [--env-fd FD] [--net-ns FD] /ABSOLUTE/COMMAND [ARG ...]",
            file=sys.stderr,
        )
        return 2
    _with_package()
    from ember_worker.processes.process_env import ROOT_ENV, read_env_file

    libc = ctypes.CDLL(None, use_errno=True)
    if options.net_ns is not None:
        if libc.setns(options.net_ns, CLONE_NEWNET) != 0:
            error = os.strerror(ctypes.get_errno())
            print(f"pid_namespace_init: cannot join its network: {error}", file=sys.stderr)
            return EXIT_CANNOT_START
        os.close(options.net_ns)
    if libc.unshare(CLONE_NEWPID) != 0:
        error = os.strerror(ctypes.get_errno())
        print(f"pid_namespace_init: unshare(CLONE_NEWPID) failed: {error}", file=sys.stderr)
        return EXIT_CANNOT_START
    told_r, told_w = os.pipe()
    pid = os.fork()  # the first child is PID 1 of the new namespace
    if pid == 0:
        os.close(told_w)
        with os.fdopen(told_r) as told:  # in its namespace it is 1: the node's number
            node_pid = told.read()
        try:
            _drop(options, libc)
            os.umask(options.umask)
            # The tenant's variables, only now: unprivileged, inside its sandbox.
            env = dict(ROOT_ENV)  # a fixed base, without --env-fd
            if options.env_fd is not None:
                env = read_env_file(options.env_fd)
        except (OSError, ValueError) as exc:
            print(f"pid_namespace_init: cannot sandbox the replica: {exc}", file=sys.stderr)
            os._exit(EXIT_CANNOT_START)
        env[REPLICA_PID_ENV] = node_pid
        # After the uid change, which clears it; kept by exec: it outlives no parent.
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        try:
            os.execve(command[0], command, env)
        except OSError as exc:
            print(f"pid_namespace_init: cannot run {command[0]}: {exc}", file=sys.stderr)
            os._exit(EXIT_CANNOT_START)
    os.close(told_r)
    if options.env_fd is not None:  # the child's to read
        os.close(options.env_fd)
    os.write(told_w, str(pid).encode())
    os.close(told_w)
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
