"""Endpoints whose code dies or cannot start, for the failure-path tests."""

import os
import time
from pathlib import Path

import ember


@ember.endpoint(retries=1)
def crashy() -> dict:
    os._exit(1)  # the replica process dies in the middle of the input


@ember.endpoint(retries=1, concurrency=4, max_replicas=1, snapshot=False)
def shared(crash: bool = False, seconds: float = 0.0) -> dict:
    """Inputs that share a replica: one that crashes it should cost only itself."""
    if crash:
        time.sleep(0.3)  # the neighbours are running by then
        os._exit(1)
    time.sleep(seconds)
    return {"slept": seconds}


@ember.endpoint(name="unloadable")
class Unloadable:
    @ember.enter(snap=True)
    def load(self) -> None:
        raise RuntimeError("weights missing")

    @ember.method
    def run(self) -> dict:
        return {}


@ember.endpoint(name="unready")
class Unready:
    @ember.enter()
    def connect(self) -> None:
        raise ConnectionError("database down")

    @ember.method
    def run(self) -> dict:
        return {}


@ember.endpoint(name="sluggish", startup_timeout=1, snapshot=False)
class Sluggish:
    @ember.enter()
    def load(self) -> None:
        time.sleep(60)  # far past its startup_timeout

    @ember.method
    def run(self) -> dict:
        return {}


@ember.endpoint(retries=0, snapshot=False)
def hog(procs_file: str, mb: int = 512, hold_seconds: float = 0.0, handshake: str = "") -> dict:
    """Joins the memory cgroup whose `cgroup.procs` file it is given (as root, in tests),
    then fills more memory than that cgroup allows: the kernel's OOM killer ends it.
    Given /dev/null, it joins nothing and holds `mb` MiB for `hold_seconds`. Given a
    `handshake` folder (a sandboxed replica sees no cgroup files), it writes its PID
    there as `pid` and waits for `moved`: the test puts it in the cgroup meanwhile."""
    if handshake:
        Path(handshake, "pid").write_text(os.environ["EMBER_REPLICA_PID"])
        deadline = time.monotonic() + 60
        while not Path(handshake, "moved").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    with open(procs_file, "w") as handle:
        handle.write("0")  # this process (its PID here is that of its own namespace)
    held = [b"\x01" * (1 << 20) for _ in range(mb)]
    time.sleep(hold_seconds)
    return {"held_mb": len(held)}


_flaky_calls: dict[str, int] = {}


@ember.endpoint(max_replicas=1, retries=ember.Retries(max_retries=2, initial_delay=0.2))
def flaky(key: str, failures: int) -> dict:
    """Raises for the first `failures` calls with `key` (counted in this replica)."""
    seen = _flaky_calls[key] = _flaky_calls.get(key, 0) + 1
    if seen <= failures:
        raise ConnectionError(f"upstream down (call {seen})")
    return {"key": key, "calls": seen}
