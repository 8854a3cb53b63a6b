"""The snapshot phase's uid 0 (where CRIU lacks CAP_SYS_RESOURCE, as on CI) holds
CAP_SETUID and CAP_SETGID so that it can become its workspace's user at its quiet point.
It must not become anyone else: a child it forks tries `setresuid`, `setuid`,
`setresgid`, `setgid` and `setgroups` to another workspace's replica uid, to its own
network uid (the owner of the user namespace behind its network namespace, which holds
CAP_NET_RAW and CAP_NET_ADMIN over it) and to 65534. Each must fail with EPERM, while
staying root (0, -1) still works, and the replica still gives up root at its quiet
point, is snapshotted and restores as its workspace's uid.

The attacker's action through a real `ember server`, its outcome as the replica saw it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import Platform, replicas_ready, running_platform, wait_for
from machine_needs import need

import ember

APP = "snapuids"
NEIGHBOUR = "neighbour"  # another workspace, whose replica uid mallory tries

NEIGHBOUR_SOURCE = """\
import os

import ember


@ember.endpoint(name="plain", snapshot=False, scaledown_window=60)
def plain() -> dict:
    return {"uid": os.getuid()}
"""

SOURCE = """\
import errno
import fcntl
import os
import struct

import ember

OTHER_WORKSPACE_UID = {other!r}
NOBODY = 65534
NS_GET_USERNS, NS_GET_OWNER_UID = 0xB701, 0xB704


def host_pid() -> int:
    return int(os.environ.get("EMBER_REPLICA_PID") or os.readlink("/proc/self"))


def network_uid() -> int:
    \"\"\"The uid owning the user namespace behind this process's network namespace.\"\"\"
    fd = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        users = fcntl.ioctl(fd, NS_GET_USERNS)
    finally:
        os.close(fd)
    try:
        return struct.unpack("I", fcntl.ioctl(users, NS_GET_OWNER_UID, b"\\0" * 4))[0]
    finally:
        os.close(users)


def in_a_child(action) -> str:
    \"\"\"`action` run in a forked child: "done" with the ids it then held, or the errno.\"\"\"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            action()
            outcome = f"done: uid {{os.getresuid()}} gid {{os.getresgid()}}"
        except OSError as exc:
            outcome = errno.errorcode.get(exc.errno, str(exc.errno))
        except BaseException as exc:
            outcome = f"{{type(exc).__name__}}: {{exc}}"
        os.write(write, outcome.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as told:
        outcome = told.read().decode()
    os.waitpid(pid, 0)
    return outcome


def attempts(target: int) -> dict:
    return {{
        "setresuid": in_a_child(lambda: os.setresuid(target, target, target)),
        "setuid": in_a_child(lambda: os.setuid(target)),
        "setreuid": in_a_child(lambda: os.setreuid(target, target)),
        "saved_uid": in_a_child(lambda: os.setresuid(-1, -1, target)),
        "setresgid": in_a_child(lambda: os.setresgid(target, target, target)),
        "setgid": in_a_child(lambda: os.setgid(target)),
        "setgroups": in_a_child(lambda: os.setgroups([target])),
    }}


@ember.endpoint(name="uids", max_replicas=2, concurrency=1, scaledown_window=120)
class Uids:
    @ember.enter(snap=True)
    def phase(self) -> None:
        self.phase_uid = os.getuid()
        self.loaded_pid = host_pid()
        self.network_uid = network_uid()
        self.tried = {{
            "other_workspace": attempts(OTHER_WORKSPACE_UID),
            "network_uid": attempts(self.network_uid),
            "nobody": attempts(NOBODY),
        }}
        # Staying root is no change of identity.
        self.stays = {{
            "setuid_0": in_a_child(lambda: os.setuid(0)),
            "setresuid_unchanged": in_a_child(lambda: os.setresuid(-1, -1, -1)),
            "setresgid_0": in_a_child(lambda: os.setresgid(0, -1, 0)),
            "setgroups_none": in_a_child(lambda: os.setgroups([])),
        }}

    @ember.method
    def report(self, seconds: float = 0.0) -> dict:
        import time

        time.sleep(seconds)
        return {{
            "phase_uid": self.phase_uid,
            "network_uid": self.network_uid,
            "tried": self.tried,
            "stays": self.stays,
            "uid": os.getresuid(),
            "gid": os.getresgid(),
            "loaded_pid": self.loaded_pid,
            "pid": host_pid(),
        }}
"""


@dataclass
class Setup:
    platform: Platform
    record: Path  # the worker's replica-users.json: workspace -> uid
    other_uid: int  # the neighbour workspace's replica uid


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    if os.geteuid() != 0:
        need("root", "the snapshot phase runs as uid 0 only under a worker running as root")
    root = tmp_path_factory.mktemp("snapshot-uids")
    with running_platform(root / "platform") as platform:
        problem = platform.status()["workers"][0]["snapshots"].get("problem")
        if problem is not None:
            need("criu", f"the snapshot phase's attacks need snapshots: {problem}")
        record = platform.state_dir / "worker" / "replica-users.json"
        # Another workspace with a replica on the node: its uid is in the worker's record.
        platform.ember("workspace", "create", NEIGHBOUR)
        token = platform.ember(
            "token", "create", "--workspace", NEIGHBOUR, "--scope", "deploy"
        ).stdout.strip()
        neighbour_app = root / NEIGHBOUR / "app.py"
        neighbour_app.parent.mkdir()
        neighbour_app.write_text(NEIGHBOUR_SOURCE)
        deployed = platform.ember_as(token, "deploy", str(neighbour_app), "--name", "n")
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        with platform.client(token, timeout=240) as client:
            answer = client.post(f"/{NEIGHBOUR}--n--plain/", json={})
        assert answer.status_code == 200, answer.text
        other_uid = json.loads(record.read_text())[NEIGHBOUR]
        assert answer.json()["uid"] == other_uid
        app = root / "app" / "app.py"
        app.parent.mkdir()
        app.write_text(SOURCE.format(other=other_uid))
        platform.deploy(app, APP)
        yield Setup(platform, record, other_uid)


def test_the_snapshot_phase_becomes_no_other_uid_and_still_snapshots(setup: Setup) -> None:
    platform = setup.platform
    uids = ember.Endpoint.lookup(APP, "uids", config=platform.config())
    first = uids.report.call()
    # Its workspace's uid, as the worker recorded it (and it serves as: below).
    recorded = json.loads(setup.record.read_text())
    own = next(uid for name, uid in recorded.items() if name != NEIGHBOUR)
    assert own != setup.other_uid, recorded
    tried = first["tried"]
    assert first["network_uid"] not in (0, own, setup.other_uid), first["network_uid"]
    became = {
        f"{target} ({call})": outcome
        for target, outcomes in tried.items()
        for call, outcome in outcomes.items()
        if outcome != "EPERM"
    }
    assert not became, (
        f"the snapshot phase (uid {first['phase_uid']}) changed to ids not its own: {became} "
        f"(another workspace's uid {setup.other_uid}, its network uid {first['network_uid']})"
    )
    if first["phase_uid"] == 0:  # staying root is allowed (an unprivileged phase may not)
        assert all(v.startswith("done") for v in first["stays"].values()), first["stays"]
    # The legitimate drop at its quiet point still works: it serves as its workspace's user.
    assert first["uid"] == [own] * 3 and first["gid"] == [own] * 3, first
    # Snapshotted, and a replica restored from it serves as that user too.
    wait_for(lambda: platform.endpoint_status(f"{APP}--uids")["snapshots"], 120)
    with replicas_ready(platform, uids, 2), ThreadPoolExecutor(max_workers=2) as pool:
        seen = list(pool.map(lambda _: uids.report.call(seconds=1.5), range(2)))
    restored = [answer for answer in seen if answer["pid"] != first["pid"]]
    assert restored, f"no second replica served: {seen}"
    for answer in restored:
        assert answer["loaded_pid"] == first["loaded_pid"], "booted cold, not restored"
        assert answer["uid"] == [own] * 3 and answer["gid"] == [own] * 3, answer
        assert answer["tried"] == tried
