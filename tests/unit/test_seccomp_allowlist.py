"""seccomp_filter.py's allowlist: no call it refuses is in a group it allows, the calls
allowed only with some arguments are in no group, and a name libseccomp does not know
(a call newer than it) is left out rather than failing the filter's build."""

from __future__ import annotations

import json
import subprocess
import sys

from ember_worker.processes import seccomp_filter


def test_no_refused_call_is_in_the_allowlist() -> None:
    allowed = seccomp_filter.ALLOWED
    assert len(set(allowed)) == len(allowed)
    assert set(allowed) & set(seccomp_filter.REFUSED) == set()
    # Allowed by their arguments only, below the groups.
    assert {"personality", "socket", "clone", "clone3"} & set(allowed) == set()


CHILD = """
import ctypes, errno, json, os
from ember_worker.processes import seccomp_filter
lib = seccomp_filter.load_library()
names = {
    "unknown": seccomp_filter.resolve(lib, "no_such_call_in_any_kernel"),
    "read": seccomp_filter.resolve(lib, "read"),
}
seccomp_filter.ALLOWED = (*seccomp_filter.ALLOWED, "no_such_call_in_any_kernel")
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(38, 1, 0, 0, 0)  # no_new_privs, as the init script sets it
seccomp_filter.install()
def errno_of(result):
    return "ok" if result >= 0 else errno.errorcode[ctypes.get_errno()]
libc.syscall.restype = ctypes.c_long
print(json.dumps({
    "names": names,
    "getpid": os.getpid() > 0,
    "personality ADDR_NO_RANDOMIZE": errno_of(libc.personality(0x0040000)),
    "personality query": errno_of(libc.personality(-1)),  # C code asks with -1
    "socket AF_VSOCK": errno_of(libc.socket(40, 1, 0)),
    "socket AF_INET": errno_of(libc.socket(2, 1, 0)),
    "io_uring_setup": errno_of(libc.syscall(425, 1, 0)),
    "no such call": errno_of(libc.syscall(1000)),
}))
"""


def test_a_name_libseccomp_does_not_know_is_left_out() -> None:
    assert seccomp_filter.available() is None
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["names"]["unknown"] is None and seen["names"]["read"] is not None
    assert seen == {
        "names": seen["names"],
        "getpid": True,
        "personality ADDR_NO_RANDOMIZE": "EPERM",
        "personality query": "ok",
        "socket AF_VSOCK": "EPERM",
        "socket AF_INET": "ok",
        "io_uring_setup": "EPERM",
        "no such call": "EPERM",
    }
