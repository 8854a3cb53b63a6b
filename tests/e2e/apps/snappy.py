"""Endpoints for the snapshot tests: state built in enter(snap=True) and random numbers."""

import hashlib
import mmap
import os
import random
import tempfile
import time
from pathlib import Path

import ember


def host_pid() -> int:
    """This process's PID as the host sees it (replicas are PID 1 of their namespace)."""
    return int(os.environ.get("EMBER_REPLICA_PID") or os.readlink("/proc/self"))


@ember.endpoint(name="stateful", max_replicas=3, concurrency=1, scaledown_window=60)
class Stateful:
    @ember.enter(snap=True)
    def load(self) -> None:
        self.loaded_pid = host_pid()
        self.loaded_at = time.time()
        self.table = [i * i for i in range(200_000)]  # state a restore must bring back
        print("stateful: loaded")

    @ember.enter()
    def ready(self) -> None:
        self.ready_pid = host_pid()

    @ember.method
    def info(self, seconds: float = 0.0) -> dict:
        time.sleep(seconds)
        return {
            "loaded_pid": self.loaded_pid,
            "ready_pid": self.ready_pid,
            "pid": host_pid(),
            "loaded_at": self.loaded_at,
            "table": sum(self.table[:1000]),
            "random": random.random(),
        }


@ember.endpoint(snapshot=False, scaledown_window=60)
def plain() -> dict:
    return {"pid": host_pid()}


@ember.endpoint(name="mapper", max_replicas=2, concurrency=1, scaledown_window=60)
class Mapper:
    """Maps a file it wrote in enter(snap=True), as torch.compile's kernels are mapped from
    a cache under /tmp: a node without that file needs it from the snapshot."""

    @ember.enter(snap=True)
    def load(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="ember-test-kernels-")) / "kernel.bin"
        self.path.write_bytes(b"kernel!" * 1000)
        with self.path.open("rb") as handle:
            self.mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self.loaded_pid = host_pid()

    @ember.method
    def info(self, seconds: float = 0.0) -> dict:
        time.sleep(seconds)
        return {
            "path": str(self.path),
            "head": self.mapped[:7].decode(),
            "pid": host_pid(),
            "loaded_pid": self.loaded_pid,
        }


@ember.endpoint(name="ballast", max_replicas=2, concurrency=1, scaledown_window=60)
class Ballast:
    """Half a GiB in its snapshot: a lazy restore takes a while to bring it all in."""

    @ember.enter(snap=True)
    def load(self) -> None:
        self.ballast = bytearray(b"\x01") * (512 << 20)

    @ember.method
    def info(self, seconds: float = 0.0) -> dict:
        time.sleep(seconds)
        return {"pid": host_pid(), "ballast": len(self.ballast)}


@ember.endpoint(
    name="capped",
    memory=64,
    memory_limit=256,
    cpu_limit=0.5,
    max_replicas=2,
    scaledown_window=60,
)
class Capped:
    """Limited to 256 MiB, 48 of them filled in enter(snap=True), and half a CPU."""

    @ember.enter(snap=True)
    def load(self) -> None:
        self.state = bytearray(b"\x02") * (48 << 20)

    @ember.method
    def info(self, seconds: float = 0.0, fill_mb: int = 0, burn: float = 0.0) -> dict:
        held = [b"\x01" * (1 << 20) for _ in range(fill_mb)]
        time.sleep(seconds)
        began, cpu_began = time.monotonic(), time.process_time()
        while time.monotonic() - began < burn:  # as busy as one thread can be
            pass
        burnt = time.process_time() - cpu_began
        return {
            "pid": host_pid(),  # the test reads its cgroups on the node (no /sys inside)
            "state": len(self.state) + len(held),
            "cpu_share": burnt / burn if burn else None,  # of the wall time it spun
        }


def huge_page_kb() -> int:
    """This process's anonymous memory in transparent huge pages, in KiB."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@ember.endpoint(name="weighty", max_replicas=2, concurrency=1, scaledown_window=60)
class Weighty:
    """64 MiB of dense state, as weights are: what `--huge-pages` restores into 2 MiB pages."""

    @ember.enter(snap=True)
    def load(self) -> None:
        self.weights = random.Random(7).randbytes(64 << 20)
        self.loaded_pid = host_pid()

    @ember.method
    def memory(self, seconds: float = 0.0) -> dict:
        time.sleep(seconds)
        return {
            "pid": host_pid(),
            "loaded_pid": self.loaded_pid,
            "digest": hashlib.sha256(self.weights).hexdigest(),
            "huge_kb": huge_page_kb(),
        }
