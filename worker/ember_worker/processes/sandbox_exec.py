"""Run a command inside a running replica's sandbox, as the replica runs (`ember replica
exec`):

    python -I -S sandbox_exec.py --pid PID --user UID:GID [--sandbox --cwd DIR]
        --env-fd FD -- COMMAND [ARG ...]

Started by the agent as root, already in the replica's cgroups (cgroups.joined), it
enters the namespaces of the replica's process PID (with --sandbox: IPC, UTS, PID and
mount, so it sees the replica's root, files and processes and nothing of the node's),
then forks: the child (in the replica's PID namespace) gives up root exactly as the
replica did (pid_namespace_init.become: its workspace's uid and gid, no groups, no
capabilities, no_new_privs), installs the same seccomp filter, and execs the command.
This process waits outside and ends as the command ended, signal included. Nothing of
the command ever runs as root, or with more than the replica has.

It runs as root with the agent's fixed environment (process_env.ROOT_ENV); the
command's own, the replica's (the tenant's variables), is in the memory file --env-fd,
read by the child once it is the replica's user: the command is looked up on that PATH
then, inside the sandbox, and nothing of it reaches this process.

Without --sandbox (a worker run with --no-sandbox) only the uid changes. The standard
library only, as for pid_namespace_init.py: its start is the command's.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import sys
import termios
from collections.abc import Sequence

# Its network first (its own, or the node's where it has none); the mount namespace last:
# it moves our root.
NAMESPACES = ("net", "ipc", "uts", "pid", "mnt")
EXIT_CANNOT_RUN = 126
EXIT_NOT_FOUND = 127
PR_SET_PDEATHSIG = 1


def command_prefix(pid: int, uid: int, gid: int, cwd: str | None) -> list[str]:
    """What runs a command inside the sandbox of the replica whose process is `pid` (cwd
    None: a replica without a sandbox, only its uid), less the command's own part:
    `[*prefix, "--env-fd", FD, "--", *command]` (`with_command`)."""
    prefix = [sys.executable, "-I", "-S", os.path.realpath(__file__)]
    prefix += ["--pid", str(pid), "--user", f"{uid}:{gid}"]
    if cwd is not None:
        prefix += ["--sandbox", "--cwd", cwd]
    return prefix


def with_command(prefix: Sequence[str], env_fd: int, command: Sequence[str]) -> list[str]:
    """`prefix` running `command` with the environment in the memory file `env_fd`."""
    # After "--", the caller's words: never an option of ours.
    return [*prefix, "--env-fd", str(env_fd), "--", *command]


def _enter(pid: int, libc: ctypes.CDLL) -> None:
    """Into the namespaces of process `pid` (its descriptors opened first: once in its
    mount namespace, /proc is its PID namespace's)."""
    fds = [os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC) for name in NAMESPACES]
    try:
        for name, fd in zip(NAMESPACES, fds, strict=True):
            if libc.setns(fd, 0) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"setns into its {name} namespace: {os.strerror(errno)}")
    finally:
        for fd in fds:
            os.close(fd)


def main(args: list[str]) -> int:
    pid, user, cwd, sandboxed = 0, (0, 0), "/", False
    env_fd: int | None = None
    while args:
        if args[0] == "--":
            args = args[1:]
            break
        if args[0] == "--sandbox":
            sandboxed, args = True, args[1:]
        elif args[0] in ("--pid", "--user", "--cwd", "--env-fd") and len(args) >= 2:
            if args[0] == "--pid":
                pid = int(args[1])
            elif args[0] == "--env-fd":
                env_fd = int(args[1])
            elif args[0] == "--user":
                uid, _, gid = args[1].partition(":")
                user = (int(uid), int(gid))
            else:
                cwd = args[1]
            args = args[2:]
        else:
            args = []  # no "--" before the command: refused
    if not args or pid <= 0 or user[0] <= 0 or env_fd is None:
        print(
            "usage: sandbox_exec.py --pid PID --user UID:GID [--sandbox --cwd DIR] "
            "--env-fd FD -- COMMAND",
            file=sys.stderr,
        )
        return 2
    # Run by path with -I: the package's folder is not on sys.path yet. Imported before
    # entering: the sandbox shows no more of the node's Python than the replica's own.
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path.insert(0, os.path.dirname(os.path.dirname(here)))
    import warnings  # noqa: F401  (os.execvp imports it: not from the replica's view)

    from ember_worker.processes import seccomp_filter
    from ember_worker.processes.pid_namespace_init import become
    from ember_worker.processes.process_env import read_env_file

    libc = ctypes.CDLL(None, use_errno=True)
    try:
        if sandboxed:
            problem = seccomp_filter.available()  # libseccomp loaded from the node's /usr
            if problem is not None:
                raise OSError(problem)
            _enter(pid, libc)
            os.chdir(cwd)
    except OSError as exc:
        print(f"ember replica exec: cannot enter the replica's sandbox: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    child = os.fork()  # in the replica's PID namespace (setns applies to children)
    if child == 0:
        try:
            if sandboxed and os.isatty(0):
                # A terminal's session and process group must be of the replica's PID
                # namespace: a shell's job control finds no other (ESRCH, and it exits 2).
                # Root still: it takes the terminal over from this process's session.
                os.setsid()
                fcntl.ioctl(0, termios.TIOCSCTTY, 1)
            become(*user, libc)
            if sandboxed:
                seccomp_filter.install()
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            # The command's variables, only now that it runs as the replica's user.
            env = read_env_file(env_fd)
        except (OSError, ValueError) as exc:
            print(f"ember replica exec: cannot become the replica's user: {exc}", file=sys.stderr)
            os._exit(EXIT_CANNOT_RUN)
        try:
            os.execvpe(args[0], args, env)
        except OSError as exc:
            print(f"ember replica exec: cannot run {args[0]}: {exc.strerror}", file=sys.stderr)
            os._exit(EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_CANNOT_RUN)
    os.close(env_fd)  # the child's to read
    # Ctrl+C typed at a terminal reaches the command (the same process group); this
    # process only waits for it.
    for name in ("SIGINT", "SIGQUIT", "SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    return waited_as_a_shell_says(child)


def waited_as_a_shell_says(pid: int) -> int:
    """Wait for the child `pid`: its exit code, or 128 + N where signal N ended it."""
    _, status = os.waitpid(pid, 0)  # retried on EINTR by Python itself
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
