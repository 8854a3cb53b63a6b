"""Issue 47, item 4: a replica's system calls are an allowlist, not a list of refusals.

A tenant holding a deploy token of its own workspace deploys an endpoint that tries, with
ctypes, calls Docker's default profile refuses to a container without added capabilities
and a deny list lets through:

- `personality(ADDR_NO_RANDOMIZE)`: turns address space randomisation off for what the
  replica execs next (Docker allows only the Linux, 32-bit and UNAME26 personalities);
- `socket(AF_VSOCK)` and `socket(AF_ALG)`: the host-guest sockets and the kernel's crypto
  API, families that load kernel modules and reach code few containers need; and
  AF_VSOCK again with bits above the 32 the kernel reads (an `int`): a filter comparing all
  64 bits with "greater than 40" lets it through;
- `process_madvise` and `set_mempolicy_home_node`: recent calls Docker grants only with
  CAP_SYS_PTRACE and CAP_SYS_NICE;
- a system call number this kernel does not have: what a future kernel adds is refused
  until someone lists it.

Each must answer EPERM, in the replica and in an `ember replica exec` command (both run
under the filter), while what every program needs still works (an inet socket, asking
the personality) and clone3 still answers ENOSYS (glibc then falls back to clone).
"""

from __future__ import annotations

import json
import os
import platform as machine
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Platform, running_platform
from machine_needs import need

from ember_worker.processes import seccomp_filter

# The calls tried by number (ctypes' syscall()): numbers of each architecture.
NUMBERS = {
    "x86_64": {"socket": 41, "process_madvise": 440, "set_mempolicy_home_node": 450},
    "aarch64": {"socket": 198, "process_madvise": 440, "set_mempolicy_home_node": 450},
}

# Run in the replica (as a function of the app) and in a `replica exec` command.
PROBE = """
import ctypes
import errno
import os

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def outcome(result: int) -> str:
    return "ok" if result >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")


def sock(family: int, kind: int = 1) -> str:
    fd = libc.socket(family, kind, 0)
    seen = outcome(fd)
    if fd >= 0:
        os.close(fd)
    return seen


def raw(number: int, *args: int) -> str:
    result = libc.syscall(ctypes.c_long(number), *(ctypes.c_long(a) for a in args))
    if result >= 0 and number == NUMBERS["socket"]:
        os.close(result)
    return outcome(result)


def persona(value: int) -> str:
    seen = outcome(libc.personality(ctypes.c_ulong(value)))
    libc.personality(ctypes.c_ulong(0))  # as it was (PER_LINUX), had it worked
    return seen


def probe() -> dict:
    return {
        "attacks": {
            "personality ADDR_NO_RANDOMIZE": persona(0x0040000),
            "socket AF_VSOCK": sock(40),
            "socket AF_ALG": sock(38, 5),  # SOCK_SEQPACKET, as AF_ALG wants
            "socket AF_VSOCK, high bits": raw(NUMBERS["socket"], (1 << 32) | 40, 1, 0),
            "process_madvise": raw(NUMBERS["process_madvise"], -1, 0, 0, 0, 0),
            "set_mempolicy_home_node": raw(NUMBERS["set_mempolicy_home_node"], 0, 0, 0, 0),
            "no such call": raw(1000),
        },
        "needed": {
            "socket AF_INET": sock(2),
            "socket AF_UNIX": sock(1),
            "personality query": outcome(libc.personality(ctypes.c_ulong(0xFFFFFFFF))),
            "clone3": raw(435, 0, 0),
        },
    }
"""

APP = """\
import sys

import ember

NUMBERS = {numbers!r}
{probe}

@ember.endpoint(scaledown_window=300, snapshot=False)
def syscalls() -> dict:
    return {{**probe(), "python": sys.executable}}
"""

ATTACKS = {
    "personality ADDR_NO_RANDOMIZE",
    "socket AF_VSOCK",
    "socket AF_ALG",
    "socket AF_VSOCK, high bits",
    "process_madvise",
    "set_mempolicy_home_node",
    "no such call",
}
NEEDED = {"socket AF_INET": "ok", "socket AF_UNIX": "ok", "personality query": "ok"}


def _sandbox_problem() -> str | None:
    if os.geteuid() != 0:
        return "the sandbox is built by a worker running as root"
    if machine.machine() not in NUMBERS:
        return f"no system call numbers here for {machine.machine()}"
    return seccomp_filter.available()


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    problem = _sandbox_problem()
    if problem is not None:
        need("sandbox", f"replicas cannot be sandboxed here: {problem}")
    with running_platform(tmp_path_factory.mktemp("platform")) as running:
        yield running


def _call(platform: Platform, token: str, label: str) -> Any:
    with platform.client(token, timeout=240) as client:
        answer = client.post(f"/{label}/", json={})
    assert answer.status_code == 200, answer.text
    return answer.json()


def _refused(seen: dict[str, Any], where: str) -> None:
    allowed = {name: got for name, got in seen["attacks"].items() if got != "EPERM"}
    assert set(seen["attacks"]) == ATTACKS
    assert allowed == {}, f"calls outside the allowlist not refused {where}: {allowed}"
    assert seen["needed"] == {**NEEDED, "clone3": "ENOSYS"}, seen["needed"]


def test_calls_outside_the_allowlist_answer_eperm(platform: Platform, tmp_path: Path) -> None:
    platform.ember("workspace", "create", "mallory")
    created = platform.ember("token", "create", "--workspace", "mallory", "--scope", "deploy")
    token = created.stdout.strip()
    numbers = NUMBERS[machine.machine()]
    app = tmp_path / "probe" / "app.py"
    app.parent.mkdir()
    app.write_text(APP.format(numbers=numbers, probe=PROBE))
    deployed = platform.ember_as(token, "deploy", str(app), "--name", "probe")
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr

    seen = _call(platform, token, "mallory--probe--syscalls")
    _refused(seen, "in the replica")

    listed = json.loads(platform.ember_as(token, "replica", "ls", "probe", "--json").stdout)
    replica = next(row["id"] for row in listed if row["label"].endswith("--syscalls"))
    code = f"import json\nNUMBERS = {numbers!r}\n{PROBE}\nprint(json.dumps(probe()))"
    ran = platform.ember_as(token, "replica", "exec", replica, "--", seen["python"], "-c", code)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    _refused(json.loads(ran.stdout.strip().splitlines()[-1]), "in a replica exec command")
