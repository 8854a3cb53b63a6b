"""Run a command as PID 1 of a new PID namespace and end as it ended.

    python -I -S pid_namespace_init.py COMMAND [ARG ...]

The agent starts cold replicas through this script, run by path with the standard
library alone (no site packages: it starts in milliseconds). It stays outside the
namespace as the replica's parent and leaves with the replica's exit status: the same
exit code, or killed by the same signal, so that the agent can tell a crash or the OOM
killer from a clean exit. (util-linux's `unshare --pid --fork`, which did this before,
reports a child killed by a signal as exit code 0, or 1 for SIGKILL, in Debian 12's
version.) If this process is killed, the kernel kills the replica too.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys

CLONE_NEWPID = 0x20000000
PR_SET_PDEATHSIG = 1
EXIT_CANNOT_START = 126  # as shells answer for a command that could not run


def main(command: list[str]) -> int:
    if not command:
        print("usage: pid_namespace_init.py COMMAND [ARG ...]", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWPID) != 0:
        error = os.strerror(ctypes.get_errno())
        print(f"pid_namespace_init: unshare(CLONE_NEWPID) failed: {error}", file=sys.stderr)
        return EXIT_CANNOT_START
    pid = os.fork()  # the first child is PID 1 of the new namespace
    if pid == 0:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # outlives no parent (kept by exec)
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
