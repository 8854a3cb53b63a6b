"""Issue 47: a replica's snapshot phase (imports, `enter(snap=True)`), which runs as uid 0
in its sandbox where CRIU lacks CAP_SYS_RESOURCE (root in a container, as on CI), must
leave the node as it found it.

- It changes no device node of the node's: a chmod of /dev/full inside changes nothing
  outside (the sandbox binds device nodes read-only).
- Links it plants in the trees its workspace writes (its volume copies, its working
  area) are never followed by the agent, which works on those trees as root: a node file
  they point at stays root's.
- A file it had open when it was dumped is carried in its image from its own working
  area, never from where a link swapped in after the dump (while it runs again) points.

Each test is the attacker's action through a real `ember server`, and its outcome looked
for on the node.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import Platform, replicas_ready, running_platform, wait_for
from machine_needs import need

import ember
from ember_worker.processes.sandbox_mounts import SANDBOX_HOME, WORKER_INSIDE

APP = "snapattack"
SECRET_SIZE = 48  # the node file the side-file attack reads, and the replica's decoy

SOURCE = """\
import errno
import os
import threading
import time

import ember

VICTIM = {victim!r}  # a root-owned file on the node (not in the sandbox)
SECRET_FOLDER = {secret_folder!r}  # a root-only folder on the node, holding secret.txt
VOLUME = {volume!r}  # the app's folder of volume copies, inside
HOME = {home!r}
SIZE = {size}


def attempt(action) -> str:
    try:
        action()
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return "done"


def write_null() -> None:
    with open("/dev/null", "wb") as null:
        null.write(b"x")


@ember.endpoint(name="devices", scaledown_window=120)
class Devices:
    @ember.enter(snap=True)
    def phase(self) -> None:
        self.uid = os.getuid()
        self.chmod = attempt(lambda: os.chmod("/dev/full", 0o600))

    @ember.method
    def report(self) -> dict:
        # The device nodes still work as devices.
        return {{"uid": self.uid, "chmod": self.chmod, "null": attempt(write_null)}}


@ember.endpoint(name="links", max_replicas=2, concurrency=1, scaledown_window=120)
class Links:
    @ember.enter(snap=True)
    def phase(self) -> None:
        self.uid = os.getuid()
        folder = os.path.join(HOME, "deep")
        self.planted = {{
            # The working area, which the replica hands to its user after the dump.
            "home": attempt(lambda: os.symlink(VICTIM, os.path.join(HOME, "victim"))),
            "home_folder": attempt(lambda: os.mkdir(folder)),
            "home_deep": attempt(lambda: os.symlink(VICTIM, os.path.join(folder, "victim"))),
            # The volume copies, its user's: root's again makes the agent re-own them all.
            "volume_owner": attempt(lambda: os.chown(VOLUME, 0, 0)),
            "volume": attempt(lambda: os.symlink(VICTIM, os.path.join(VOLUME, "victim"))),
            "volume_mode": attempt(lambda: os.chmod(VOLUME, 0o755)),
        }}

    @ember.method
    def report(self, seconds: float = 0.0) -> dict:
        time.sleep(seconds)
        return {{"uid": self.uid, "planted": self.planted}}


@ember.endpoint(name="sides", max_replicas=2, concurrency=1, scaledown_window=120)
class Sides:
    @ember.enter(snap=True)
    def phase(self) -> None:
        os.mkdir(os.path.join(HOME, "d"))
        # Open at the dump: carried in the image beside it (a side file).
        self.handle = open(os.path.join(HOME, "d", "secret.txt"), "w+b")
        self.handle.write(b"x" * SIZE)
        self.handle.flush()
        self.swapped = 0.0
        threading.Thread(target=self._swap_after_the_dump, daemon=True).start()

    def _swap_after_the_dump(self) -> None:
        # The dump freezes this thread too: the first long gap is its end. The agent packs
        # the side files right after, while the replica runs again: swap the folder for
        # a link to the node's folder of the same file name.
        last = time.monotonic()
        while True:
            time.sleep(0.001)
            now = time.monotonic()
            if now - last > 0.04:  # its other pauses are a few ms
                os.rename(os.path.join(HOME, "d"), os.path.join(HOME, "d-was"))
                os.symlink(SECRET_FOLDER, os.path.join(HOME, "d"))
                self.swapped = now - last
                return
            last = now

    @ember.method
    def peek(self, seconds: float = 0.0) -> dict:
        time.sleep(seconds)
        # The swapping thread may not have run since the dump ended (a loaded machine).
        deadline = time.monotonic() + 10
        while not self.swapped and time.monotonic() < deadline:
            time.sleep(0.01)
        self.handle.seek(0)
        return {{"read": self.handle.read().decode(errors="replace"), "swapped": self.swapped}}
"""


@dataclass
class Setup:
    platform: Platform
    worker_dir: Path
    victim: Path  # root's, 0644, in a 0755 folder: what a planted link points at
    secret: Path  # root's, 0600, in a 0700 folder: what the side-file swap reads
    secret_text: str


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    if os.geteuid() != 0:
        need("root", "the snapshot phase runs as uid 0 only under a worker running as root")
    # Outside pytest's temporary root, whose modes a pytest session starting meanwhile
    # changes (replica_user's tests say why).
    root = Path(tempfile.mkdtemp(prefix="ember-snap-attack-"))
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, root, True)
        node = root / "node"
        node.mkdir(mode=0o755)
        os.chmod(node, 0o755)
        victim = node / "victim"
        victim.write_text("the node's own file\n")
        os.chown(victim, 0, 0)
        os.chmod(victim, 0o644)
        secrets_dir = node / "secrets"
        secrets_dir.mkdir(mode=0o700)
        secret_text = ("node secret " + os.urandom(18).hex())[:SECRET_SIZE].ljust(SECRET_SIZE, "!")
        secret = secrets_dir / "secret.txt"
        secret.write_text(secret_text)
        os.chmod(secret, 0o600)
        platform = cleanup.enter_context(running_platform(root / "platform"))
        problem = platform.status()["workers"][0]["snapshots"].get("problem")
        if problem is not None:  # every attack here is on the snapshot phase
            need("criu", f"the snapshot phase's attacks need snapshots: {problem}")
        app = root / "app" / "app.py"
        app.parent.mkdir()
        app.write_text(
            SOURCE.format(
                victim=str(victim),
                secret_folder=str(secrets_dir),
                volume=f"{WORKER_INSIDE}/volumes/{APP}",
                home=SANDBOX_HOME,
                size=SECRET_SIZE,
            )
        )
        platform.deploy(app, APP)
        yield Setup(platform, root / "platform" / "state" / "worker", victim, secret, secret_text)


def _snapshots(platform: Platform, endpoint: str) -> list[dict]:
    return platform.endpoint_status(f"{APP}--{endpoint}")["snapshots"]


def test_the_snapshot_phase_cannot_chmod_the_nodes_device_nodes(setup: Setup) -> None:
    before = os.stat("/dev/full")
    try:
        devices = ember.Endpoint.lookup(APP, "devices", config=setup.platform.config())
        seen = devices.report.call()
        wait_for(lambda: _snapshots(setup.platform, "devices"), 120)
        after = os.stat("/dev/full")
        assert (after.st_mode, after.st_uid, after.st_gid) == (
            before.st_mode,
            before.st_uid,
            before.st_gid,
        ), f"the node's /dev/full changed: {oct(before.st_mode)} -> {oct(after.st_mode)}"
        assert seen["chmod"] != "done", seen
        assert seen["null"] == "done", seen  # still a device it writes to
    finally:
        now = os.stat("/dev/full")
        if (now.st_mode, now.st_uid, now.st_gid) != (before.st_mode, before.st_uid, before.st_gid):
            os.chown("/dev/full", before.st_uid, before.st_gid)
            os.chmod("/dev/full", before.st_mode & 0o7777)


def test_links_planted_in_the_snapshot_phase_are_never_followed_by_the_agent(setup: Setup) -> None:
    platform = setup.platform
    try:
        links = ember.Endpoint.lookup(APP, "links", config=platform.config())
        first = links.report.call()
        wait_for(lambda: _snapshots(platform, "links"), 120)
        # Another replica of the app (restored): the agent prepares its working area and
        # its app's volume copies again, as root.
        with replicas_ready(platform, links, 2):
            pass
        wait_for(lambda: platform.endpoint_status(f"{APP}--links")["replicas"], 60)
        owner = os.stat(setup.victim)
        assert (owner.st_uid, owner.st_gid) == (0, 0), (
            f"the node's {setup.victim} was handed to uid {owner.st_uid}: {first}"
        )
        assert os.stat(setup.victim).st_mode & 0o7777 == 0o644
        # The volume copies' folder is its user's again, links and all, not followed.
        volume = setup.worker_dir / "volumes" / APP
        if first["uid"] == 0 and first["planted"]["volume"] == "done":
            assert os.lstat(volume / "victim").st_uid != 0
    finally:
        os.chown(setup.victim, 0, 0)
        os.chmod(setup.victim, 0o644)


def test_a_side_file_swapped_for_a_link_after_the_dump_is_not_read_from_the_node(
    setup: Setup,
) -> None:
    platform = setup.platform
    sides = ember.Endpoint.lookup(APP, "sides", config=platform.config())
    first = sides.peek.call()
    assert setup.secret_text not in first["read"]
    # Else the attack was never tried (a dump quicker than the pause it waits for).
    assert first["swapped"], "the replica saw no pause for its dump before its first call"
    wait_for(lambda: _snapshots(platform, "sides"), 120)
    # What the node's images carry: never the node's file.
    for archive in (setup.worker_dir / "snapshots").rglob("side-files.tar"):
        with tarfile.open(archive) as tar:
            for member in tar:
                source = tar.extractfile(member)
                data = source.read().decode(errors="replace") if source else ""
                assert setup.secret_text not in data, (
                    f"{archive} carries the node's {setup.secret} as {member.name} "
                    f"(swapped {first['swapped']:.3f} s after a pause)"
                )
    # A replica restored from it reads its own file, never the node's.
    with replicas_ready(platform, sides, 2), ThreadPoolExecutor(max_workers=2) as pool:
        seen = list(pool.map(lambda _: sides.peek.call(seconds=1.5), range(2)))
    for answer in seen:
        assert setup.secret_text not in answer["read"], answer
