"""seccomp_filter.py's allowlist: no call it refuses is in a group it allows, the calls
allowed only with some arguments are in no group, and a name libseccomp does not know
(a call newer than it) is left out rather than failing the filter's build, and with a
snapshot phase's ids the calls that change ids take no other uid or gid."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from machine_needs import need

from ember_worker.processes import seccomp_filter


def test_no_refused_call_is_in_the_allowlist() -> None:
    allowed = seccomp_filter.ALLOWED
    assert len(set(allowed)) == len(allowed)
    assert set(allowed) & set(seccomp_filter.REFUSED) == set()
    # Allowed by their arguments only, below the groups.
    assert {"personality", "socket", "clone", "clone3"} & set(allowed) == set()
    assert {*seccomp_filter.SET_IDS, "setgroups"} & set(allowed) == set()


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


# As the snapshot phase's uid 0: CAP_SETUID and CAP_SETGID held, so only the filter stops
# a change of ids. Each call made raw in a forked child (a change that held is undone
# with it); the kernel reads the low 32 bits of each argument.
SET_IDS_CHILD = """
import ctypes, errno, json, os
from ember_worker.processes import seccomp_filter
OWN, OTHER = 200123, 228514
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.syscall.argtypes = [ctypes.c_long] * 4
libc.prctl(38, 1, 0, 0, 0)
seccomp_filter.install((OWN, OWN))
NR = {name: seccomp_filter.resolve(seccomp_filter.load_library(), name)
      for name in (*seccomp_filter.SET_IDS, "setgroups")}
def tried(name, *args):
    pid = os.fork()
    if pid == 0:
        # setfsuid and setfsgid answer the old id (0 here): -1 only where refused.
        result = libc.syscall(NR[name], *args, *[0] * (3 - len(args)))
        os._exit(ctypes.get_errno() if result == -1 else 0)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return "ok" if code == 0 else errno.errorcode.get(code, str(code))
M1, HIGH = -1, 1 << 32
GROUPS = (ctypes.c_uint * 1)(OTHER)
seen = {
    "setresuid own": tried("setresuid", OWN, OWN, OWN),
    "setresuid root, unchanged, own": tried("setresuid", 0, M1, OWN),
    "setresuid unchanged as 32 bits": tried("setresuid", 0xFFFFFFFF, 0xFFFFFFFF, 0),
    "setresuid own with high bits": tried("setresuid", HIGH | OWN, M1, M1),
    "setresgid own": tried("setresgid", OWN, OWN, OWN),
    "setreuid own": tried("setreuid", OWN, M1),
    "setregid root": tried("setregid", 0, 0),
    "setuid root": tried("setuid", 0),
    "setuid own": tried("setuid", OWN),
    "setgid own": tried("setgid", OWN),
    "setfsuid own": tried("setfsuid", OWN),
    "setfsgid unchanged": tried("setfsgid", M1),
    "setgroups none": tried("setgroups", 0, 0),
    "setresuid other": tried("setresuid", OTHER, OTHER, OTHER),
    "setresuid other saved": tried("setresuid", M1, M1, OTHER),
    "setresuid nobody": tried("setresuid", 65534, 65534, 65534),
    "setresuid other with high bits": tried("setresuid", HIGH | OTHER, 0, 0),
    "setresgid other": tried("setresgid", 0, OTHER, 0),
    "setreuid other": tried("setreuid", M1, OTHER),
    "setregid other": tried("setregid", OTHER, M1),
    "setuid other": tried("setuid", OTHER),
    "setuid unchanged": tried("setuid", M1),
    "setgid other": tried("setgid", OTHER),
    "setfsuid other": tried("setfsuid", OTHER),
    "setfsgid other": tried("setfsgid", OTHER),
    "setgroups one": tried("setgroups", 1, ctypes.addressof(GROUPS)),
}
print(json.dumps(seen))
"""


def test_with_its_ids_the_filter_lets_root_become_only_its_user() -> None:
    if os.geteuid() != 0:
        need("root", "only uid 0 holding CAP_SETUID could change to another uid")
    done = subprocess.run(
        [sys.executable, "-c", SET_IDS_CHILD],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    allowed = {name for name, outcome in seen.items() if outcome == "ok"}
    assert allowed == {
        "setresuid own",
        "setresuid root, unchanged, own",
        "setresuid unchanged as 32 bits",
        "setresuid own with high bits",  # the kernel reads OWN: the same ask
        "setresgid own",
        "setreuid own",
        "setregid root",
        "setuid root",
        "setuid own",
        "setgid own",
        "setfsuid own",
        "setfsgid unchanged",
        "setgroups none",
    }, seen
    refused = {name: outcome for name, outcome in seen.items() if name not in allowed}
    assert set(refused.values()) == {"EPERM"}, refused
