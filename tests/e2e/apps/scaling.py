"""Endpoints for the end-to-end tests of autoscaling, retries and draining."""

import atexit
import os
import threading
import time
from pathlib import Path

import ember


def host_pid() -> int:
    """This process's PID as the host sees it (replicas are PID 1 of their namespace)."""
    return int(os.environ.get("EMBER_REPLICA_PID") or os.readlink("/proc/self"))


_running = 0
_lock = threading.Lock()


def _note_exit_slowly(path: str) -> None:
    time.sleep(0.5)  # a process that takes its time to exit
    Path(path).write_text(f"{host_pid()} ran its atexit handlers")


@ember.endpoint(max_replicas=3, concurrency=2, scaledown_window=1.0)
def work(i: int, exit_note: str | None = None) -> dict:
    global _running
    if exit_note is not None:
        atexit.register(_note_exit_slowly, exit_note)
    with _lock:
        _running += 1
        at_once = _running
    time.sleep(0.3)
    with _lock:
        _running -= 1
    return {"i": i, "pid": host_pid(), "at_once": at_once}


@ember.endpoint(max_replicas=1, concurrency=1)
def single(seconds: float = 1.0) -> dict:
    time.sleep(seconds)
    return {"slept": seconds}


@ember.endpoint(retries=2, scaledown_window=60)
def victim(pid_file: str, seconds: float = 2.0) -> dict:
    Path(pid_file).write_text(str(host_pid()))
    time.sleep(seconds)
    return {"pid": host_pid()}


@ember.endpoint(scaledown_window=60)
def slow(seconds: float = 2.0) -> dict:
    time.sleep(seconds)
    return {"slept": seconds}


@ember.endpoint(max_replicas=3, concurrency=1, buffer_replicas=1, scaledown_window=2.0)
def buffered(seconds: float = 0.0) -> dict:
    time.sleep(seconds)
    return {"pid": host_pid()}


_burst = 0


@ember.endpoint(max_replicas=3, concurrency=4, target_concurrency=1, scaledown_window=30)
def bursty(seconds: float = 1.5) -> dict:
    global _burst
    with _lock:
        _burst += 1
        at_once = _burst
    time.sleep(seconds)
    with _lock:
        _burst -= 1
    return {"pid": host_pid(), "at_once": at_once}


@ember.endpoint(max_replicas=1, max_queue=2, queue_timeout=0.5, scaledown_window=30)
def shedding(seconds: float = 0.0) -> dict:
    time.sleep(seconds)
    return {"pid": host_pid()}


@ember.endpoint(max_replicas=1, max_inputs=2, scaledown_window=30)
def fresh() -> dict:
    """Two inputs per process (max_inputs=2), then a new one."""
    return {"pid": host_pid()}


_served = 0


@ember.endpoint(max_replicas=1, scaledown_window=30)
def ordered(seconds: float = 0.0) -> int:
    """The how-manieth call this replica runs (one at a time)."""
    global _served
    time.sleep(seconds)
    _served += 1
    return _served


@ember.endpoint(max_replicas=1, concurrency=4, scaledown_window=30)
class Tenants:
    """One small model per tenant, two kept per replica (@ember.multiplexed)."""

    @ember.enter()
    def start(self) -> None:
        self.loads: list[str] = []

    @ember.multiplexed(max_models=2)
    def model(self, tenant: str) -> dict:
        time.sleep(0.3)  # loading takes a while: concurrent calls share one load
        self.loads.append(tenant)
        return {"tenant": tenant, "scale": len(tenant)}

    @ember.method
    def predict(self, x: int) -> dict:
        model = self.model()  # the call's affinity key names the tenant
        return {
            "tenant": model["tenant"],
            "y": x * model["scale"],
            "key": ember.current_affinity_key(),
            "loads": list(self.loads),
        }
