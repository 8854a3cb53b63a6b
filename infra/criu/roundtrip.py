"""Prove that CRIU and pycriu can snapshot and restore a process on this machine.

    .venv/bin/python roundtrip.py /usr/local/sbin/criu

Starts a small process tree (a shell that prints `tick` to a pipe and sleeps in a child
`sleep`) as the init of its own PID namespace and session, dumps it through pycriu in
swrk mode with leave_running, decodes every image with pycriu, restores it while the
original still runs (the restored tree gets a new PID namespace) with its stdout
connected to a new pipe through inherit_fd, reads a `tick` from the restored copy, and
kills both. Exit 0 and one summary line on stdout when all of it worked; otherwise exit
1 with the failed step and CRIU's log on stderr.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

import pycriu

PR_SET_CHILD_SUBREAPER = 36
SCRIPT = "while :; do echo tick; sleep 0.1; done"


class StepFailed(Exception):
    def __init__(self, step: str, message: str, log: str | None = None):
        super().__init__(f"{step}: {message}")
        self.log = log


def read_tick(fd: int, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    data = b""
    while b"tick" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data


def children_of(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def criu_call(binary: str, images_fd: int, log_name: str) -> pycriu.criu:
    c = pycriu.criu()
    c.use_binary(binary)
    # CRIU 4.1.1 needs images_dir_fd: with opts.images_dir (a path) its RPC setup calls
    # readlink() on the path, which fails on a plain directory ("Bad options").
    c.opts.images_dir_fd = images_fd
    c.opts.log_level = 4
    c.opts.log_file = log_name
    return c


def tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


def roundtrip(binary: str, images: str) -> str:
    images_fd = os.open(images, os.O_DIRECTORY)
    read_end, write_end = os.pipe()
    # No --kill-child: a parent-death signal is dumped with the task, and the restored
    # copy would get it as soon as its parent (CRIU) exits.
    original = subprocess.Popen(
        ["unshare", "--pid", "--fork", "setsid", "sh", "-c", SCRIPT],
        stdin=subprocess.DEVNULL,
        stdout=write_end,
        stderr=subprocess.DEVNULL,
    )
    os.close(write_end)
    restored_pid = None
    try:
        if b"tick" not in read_tick(read_end, 10):
            raise StepFailed("start", "the test process printed nothing")
        target = None
        for _ in range(100):
            kids = children_of(original.pid)
            if kids:
                target = kids[0]
                break
            time.sleep(0.05)
        if target is None:
            raise StepFailed("start", "unshare started no child")
        pipe_key = f"pipe:[{os.fstat(read_end).st_ino}]"

        c = criu_call(binary, images_fd, "dump.log")
        c.opts.pid = target
        c.opts.leave_running = True
        c.opts.shell_job = False
        started = time.monotonic()
        try:
            c.dump()
        except pycriu.CRIUException as e:
            raise StepFailed("dump", str(e), tail(os.path.join(images, "dump.log"))) from e
        dump_s = time.monotonic() - started

        decoded = {}
        for name in sorted(os.listdir(images)):
            if not name.endswith(".img") or name.startswith("pages-"):
                continue  # pages-*.img hold raw memory, not protobuf records
            try:
                with open(os.path.join(images, name), "rb") as f:
                    decoded[name] = pycriu.images.load(f)
            except Exception as e:
                raise StepFailed("decode images", f"{name}: {type(e).__name__}: {e}") from e
        pids = sorted(e["pid"] for e in decoded.get("pstree.img", {}).get("entries", []))
        if len(pids) < 2:
            raise StepFailed("decode images", f"pstree.img holds {pids}, expected sh and sleep")

        new_read, new_write = os.pipe()
        os.set_inheritable(new_write, True)  # CRIU swrk is forked from us and needs the fd
        c = criu_call(binary, images_fd, "restore.log")
        c.opts.rst_sibling = True  # the restored tree becomes our child
        inherit = c.opts.inherit_fd.add()
        inherit.key = pipe_key
        inherit.fd = new_write
        started = time.monotonic()
        try:
            restored_pid = c.restore().pid
        except pycriu.CRIUException as e:
            raise StepFailed("restore", str(e), tail(os.path.join(images, "restore.log"))) from e
        restore_s = time.monotonic() - started
        os.close(new_write)

        if b"tick" not in read_tick(new_read, 10):
            raise StepFailed(
                "run after restore",
                f"restored pid {restored_pid} printed nothing",
                tail(os.path.join(images, "restore.log")),
            )
        if b"tick" not in read_tick(read_end, 5):
            raise StepFailed("leave_running", "the original stopped after the dump")
        os.close(new_read)
        return (
            f"dump {dump_s * 1000:.0f} ms ({len(decoded)} images decoded), "
            f"restore {restore_s * 1000:.0f} ms "
            f"(pid {target} -> restored as pid {restored_pid}, both killed)"
        )
    finally:
        for pid in (restored_pid, original.pid, *children_of(original.pid)):
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        os.close(images_fd)
        os.close(read_end)


def reap_all() -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.02)


def main() -> int:
    binary = sys.argv[1]
    # Orphans of the test (the sleep child, the restored tree) come to us and are reaped
    # here, so no zombie keeps their PIDs taken.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    signal.alarm(60)
    with tempfile.TemporaryDirectory(prefix="ember-criu-check-") as images:
        try:
            print(roundtrip(binary, images))
            return 0
        except StepFailed as e:
            print(f"round trip failed at {e}", file=sys.stderr)
            if e.log:
                print(f"--- CRIU log (last lines) ---\n{e.log}", file=sys.stderr)
            return 1
        finally:
            reap_all()


if __name__ == "__main__":
    sys.exit(main())
