"""Replicas run unprivileged: each workspace's as a uid of its own, with no groups, no
capabilities and no_new_privs, in a private working area; the platform's state, other
apps' bundles and other replicas' processes are out of their reach; pids.max holds a
fork bomb inside its replica; a replica restored from a snapshot serves as the same uid."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import EMBER, Platform, replicas_ready, running_platform, wait_for
from machine_needs import need, snapshots_on

import ember
from ember.calling.tlsclient import client_context
from ember_worker.processes.sandbox_mounts import SANDBOX_HOME

APP = """\
import errno
import os
import tempfile
import time

import ember

STATUS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs")


def _whoami() -> dict:
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    home = os.environ["HOME"]
    return {
        "uid": os.getuid(),
        "gid": os.getgid(),
        "euid": os.geteuid(),
        "groups": os.getgroups(),
        "status": {key: fields[key] for key in STATUS},
        "home": home,
        "home_owner": os.stat(home).st_uid,
        "home_mode": os.stat(home).st_mode & 0o777,
        "home_ino": os.stat(home).st_ino,  # which working area (inside a sandbox: one path)
        "tmpdir": tempfile.gettempdir(),
        # As the node sees it (in its sandbox it is 1).
        "pid": int(os.environ.get("EMBER_REPLICA_PID") or os.readlink("/proc/self")),
        "cgroup": open("/proc/self/cgroup").read(),
    }


def _outcome(action) -> str:
    try:
        action()
    except PermissionError:
        return "denied"
    except FileNotFoundError:  # not in its mount namespace
        return "absent"
    except OSError as exc:
        if exc.errno == errno.EROFS:
            return "read-only"
        return f"{type(exc).__name__}: {exc}"
    return "done"


def _read(path: str) -> None:
    with open(path, "rb") as f:
        f.read(64)


def _write(path: str) -> None:
    with open(path, "ab") as f:
        f.write(b"x")


@ember.endpoint(snapshot=False, scaledown_window=120)
def whoami() -> dict:
    return _whoami()


@ember.endpoint(snapshot=False, scaledown_window=120)
def attempt(reads: list[str], lists: list[str], writes: list[str]) -> dict:
    mine = os.path.join(os.environ["HOME"], "mine.txt")
    scratch = tempfile.NamedTemporaryFile(delete=False)  # in its TMPDIR
    scratch.close()
    return {
        "read": {path: _outcome(lambda p=path: _read(p)) for path in reads},
        "list": {path: _outcome(lambda p=path: os.listdir(p)) for path in lists},
        "write": {path: _outcome(lambda p=path: _write(p)) for path in writes},
        "own": _outcome(lambda: _write(mine)),
        "scratch": scratch.name,
    }


@ember.endpoint(name="bomb", snapshot=False, scaledown_window=120)
def fork_bomb() -> dict:
    children, failure = [], None
    while len(children) < 100_000:
        try:
            pid = os.fork()
        except OSError as exc:
            failure = errno.errorcode.get(exc.errno, str(exc.errno))
            break
        if pid == 0:
            time.sleep(120)
            os._exit(0)
        children.append(pid)
    for pid in children:
        os.kill(pid, 9)
    for pid in children:
        os.waitpid(pid, 0)
    return {"forked": len(children), "failure": failure}


@ember.endpoint(name="snapped", max_replicas=2, concurrency=1, scaledown_window=120)
class Snapped:
    @ember.enter(snap=True)
    def load(self) -> None:
        self.loaded = os.urandom(8).hex()  # a restored replica has the same

    @ember.method
    def whoami(self, seconds: float = 0.0) -> dict:
        time.sleep(seconds)
        return {**_whoami(), "loaded": self.loaded}
"""

REPLICA_UIDS = range(200_000, 200_000 + 65_536)  # the worker's default --replica-uids
PIDS_MAX = 512  # the platform's --replica-pids-max (4096 by default: 8x the forks to wait)
NO_CAPABILITIES = "0000000000000000"
# Out of a replica's reach: refused, not in its mount namespace, or on a read-only mount.
OUT_OF_REACH = {"denied", "absent", "read-only"}


def replica_pids(uid: int) -> list[int]:
    """The node's PIDs of processes running as `uid` (a replica sees only its own)."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError):
            uids = next(ln for ln in status.read_text().splitlines() if ln.startswith("Uid:"))
            if int(uids.split()[1]) == uid:
                found.append(int(status.parent.name))
    return found


@dataclass
class Setup:
    platform: Platform
    other_token: str  # a deploy token of workspace "other"

    def call(self, label: str, body: dict[str, Any], *, other: bool = False) -> Any:
        token = self.other_token if other else self.platform.token
        with httpx.Client(
            base_url=self.platform.url,
            verify=client_context(self.platform.ca),
            headers={"Authorization": f"Bearer {token}"},
            timeout=180,
        ) as client:
            answer = client.post(f"/{label}/", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()


def cli(platform: Platform, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**platform.env, "EMBER_TOKEN": token, "EMBER_SERVER_URL": platform.url}
    env["EMBER_CA_CERT"] = platform.ca
    env.pop("EMBER_WORKSPACE", None)
    return subprocess.run([*EMBER, *args], env=env, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    if os.geteuid() != 0:
        need("root", "replicas run as unprivileged users only under a worker running as root")
    # Not under pytest's own temporary root: a pytest session that starts meanwhile takes
    # its group and other bits away (a chmod), and with them the ACL entries that let
    # replicas' users pass through it (the worker grants them again when one starts).
    root = Path(tempfile.mkdtemp(prefix="ember-replica-user-"))
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, root, True)
        pids = ("--replica-pids-max", str(PIDS_MAX))
        platform = cleanup.enter_context(running_platform(root / "platform", extra=pids))
        ours = root / "ours" / "app.py"
        ours.parent.mkdir()
        ours.write_text(APP + "# main's\n")
        platform.deploy(ours, "probe")
        platform.ember("workspace", "create", "other")
        made = platform.ember("token", "create", "--workspace", "other", "--scope", "deploy")
        other_token = made.stdout.strip()
        theirs = root / "theirs" / "app.py"  # another bundle: another digest, folder
        theirs.parent.mkdir()
        theirs.write_text(APP + "# other's\n")
        deployed = cli(platform, other_token, "deploy", str(theirs), "--name", "probe")
        assert deployed.returncode == 0, deployed.stderr
        yield Setup(platform, other_token)


def test_a_replica_runs_as_its_workspaces_user_without_privileges(setup: Setup) -> None:
    main = setup.call("probe--whoami", {})
    other = setup.call("other--probe--whoami", {}, other=True)
    for seen in (main, other):
        assert seen["uid"] in REPLICA_UIDS
        assert seen["uid"] == seen["euid"] == seen["gid"]
        assert seen["groups"] == []
        assert seen["status"] == {
            "CapInh": NO_CAPABILITIES,
            "CapPrm": NO_CAPABILITIES,
            "CapEff": NO_CAPABILITIES,
            "CapBnd": NO_CAPABILITIES,
            "CapAmb": NO_CAPABILITIES,
            "NoNewPrivs": "1",
        }
        # Its own working area: HOME and TMPDIR, its uid's, mode 0700.
        assert seen["home_owner"] == seen["uid"] and seen["home_mode"] == 0o700
        assert seen["tmpdir"] == os.path.join(seen["home"], "tmp")
    assert main["uid"] != other["uid"]  # a uid per workspace
    # Recorded by the worker (root's alone), so the workspace keeps it across restarts.
    record = setup.platform.state_dir / "worker" / "replica-users.json"
    assert record.stat().st_mode & 0o777 == 0o600
    assert f'"main": {main["uid"]}' in record.read_text()
    assert f'"other": {other["uid"]}' in record.read_text()


def _bundle_of(platform: Platform, text: str) -> Path:
    """The extracted bundle folder whose app.py holds `text`."""
    for folder in (platform.state_dir / "worker" / "bundles").glob("sha256-*"):
        if folder.is_dir() and text in (folder / "app.py").read_text():
            return folder
    raise AssertionError(f"no bundle holds {text!r}")


def _local_worker_pid(platform: Platform) -> int:
    assert platform.process is not None
    for task in Path(f"/proc/{platform.process.pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if "ember_worker" in Path(f"/proc/{child}/cmdline").read_text():
                return int(child)
    raise AssertionError("the local worker is not a child of the server")


def test_the_platforms_state_other_bundles_and_processes_are_out_of_reach(setup: Setup) -> None:
    platform = setup.platform
    assert platform.process is not None
    state = platform.state_dir
    other = setup.call("other--probe--whoami", {}, other=True)
    worker = _local_worker_pid(platform)
    environ = Path(f"/proc/{worker}/environ").read_text()
    token = environ.split("EMBER_WORKER_TOKEN=")[1].split("\0")[0]
    assert token and token not in Path(f"/proc/{worker}/cmdline").read_text()  # not in ps
    theirs = _bundle_of(platform, "# other's")
    # Its working area as the node names it (inside its sandbox: /home/replica).
    areas = (state / "worker" / "replicas").iterdir()
    other_home = str(next(p for p in areas if p.stat().st_uid == other["uid"]))
    ours = _bundle_of(platform, "# main's")
    reads = [
        str(state / "admin-token"),
        str(state / "state.db"),
        str(state / "ca-key.pem"),
        str(state / "server-key.pem"),
        str(state / "webhook-secret"),
        platform.env["EMBER_CONFIG"],  # the client config ember server wrote: its admin token
        str(theirs / "app.py"),  # another workspace's app
        str(ours) + ".files.json",
        str(state / "worker" / "replica-users.json"),
        f"/proc/{replica_pids(other['uid'])[0]}/environ",  # another workspace's replica
        f"/proc/{replica_pids(other['uid'])[0]}/mem",
        f"/proc/{worker}/environ",  # the worker, its token inside
        f"/proc/{platform.process.pid}/environ",  # the control plane
        os.path.join(other_home, "tmp"),
        "/etc/shadow",
    ]
    lists = [
        str(state),
        str(state / "blobs"),
        str(state / "logs"),
        str(state / "worker"),
        str(state / "worker" / "bundles"),
        str(state / "worker" / "snapshots"),
        str(theirs),
        other_home,
    ]
    writes = [
        str(state / "admin-token"),
        str(ours / "app.py"),  # its own bundle: read-only
        str(state / "worker" / "bundles" / "planted.py"),
        "/etc/ember-planted",
    ]
    seen = setup.call("probe--attempt", {"reads": reads, "lists": lists, "writes": writes})
    for kind in ("read", "list", "write"):
        assert set(seen[kind].values()) <= OUT_OF_REACH, seen[kind]
    assert seen["own"] == "done"  # its working area is its own
    # Its TMPDIR is in its working area, at the path its sandbox gives it.
    assert Path(seen["scratch"]).parent == Path(SANDBOX_HOME) / "tmp"
    assert (theirs / "app.py").exists() and not Path("/etc/ember-planted").exists()


def _pids_max_file(cgroup_lines: str) -> Path | None:
    """The pids.max of the cgroup these /proc/<pid>/cgroup lines name, if there is one."""
    mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    for line in cgroup_lines.splitlines():
        _, controllers, path = line.split(":", 2)
        for mount in mounts:
            v1 = mount[2] == "cgroup" and "pids" in controllers.split(",")
            v1 = v1 and "pids" in mount[3].split(",")
            v2 = mount[2] == "cgroup2" and controllers == ""
            candidate = Path(mount[1]) / path.lstrip("/") / "pids.max"
            if (v1 or v2) and candidate.exists():
                return candidate
    return None


def test_a_fork_bomb_stays_inside_its_replica(setup: Setup) -> None:
    where = _pids_max_file(setup.call("probe--whoami", {})["cgroup"])
    if where is None:
        need("cgroups", "the replica's cgroup has no pids.max: no pids controller here")
        return
    assert where.read_text().strip() == str(PIDS_MAX)
    bombed = setup.call("probe--bomb", {})
    assert bombed["failure"] == "EAGAIN"
    assert 100 < bombed["forked"] < PIDS_MAX
    # The replica, the platform and the other workspace go on serving.
    assert setup.call("probe--whoami", {})["uid"] in REPLICA_UIDS
    assert setup.call("other--probe--whoami", {}, other=True)["uid"] in REPLICA_UIDS


def test_a_replica_restored_from_a_snapshot_serves_as_its_workspaces_user(setup: Setup) -> None:
    platform = setup.platform
    if not snapshots_on(platform.status()["workers"][0]["snapshots"].get("problem")):
        return
    main_uid = setup.call("probe--whoami", {})["uid"]
    snapped = ember.Endpoint.lookup("probe", "snapped", config=platform.config())
    first = snapped.whoami.call()
    assert first["uid"] == main_uid and first["status"]["CapEff"] == NO_CAPABILITIES
    wait_for(lambda: platform.endpoint_status("probe--snapped")["snapshots"], 60)
    # A second replica, restored, is ready before two calls at once: one is its.
    with replicas_ready(platform, snapped, 2), ThreadPoolExecutor(max_workers=2) as pool:
        seen = list(pool.map(lambda _: snapped.whoami.call(seconds=1.5), range(2)))
    restored = [one for one in seen if one["home_ino"] != first["home_ino"]]
    assert restored, "no second replica answered"
    for one in restored:
        assert one["loaded"] == first["loaded"]  # state from the snapshot: a restore
        assert one["uid"] == main_uid and one["gid"] == main_uid and one["groups"] == []
        assert one["status"]["CapEff"] == NO_CAPABILITIES
        assert one["status"]["CapPrm"] == NO_CAPABILITIES
        assert one["status"]["NoNewPrivs"] == "1"
        assert one["home_ino"] != first["home_ino"]  # its own working area, not the image's
        assert one["home_owner"] == main_uid
