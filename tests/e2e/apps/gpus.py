"""Endpoints that report the GPUs they are shown (CUDA_VISIBLE_DEVICES), for a worker
that declares GPUs it does not have: nothing here touches CUDA."""

import os
import time

import ember


def shown() -> dict:
    # The PID as the node sees it (a replica is PID 1 of its own namespace).
    return {
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "pid": (os.environ.get("EMBER_REPLICA_PID") or os.readlink("/proc/self")),
    }


@ember.endpoint(gpu="H100", max_replicas=2, concurrency=1, snapshot=False, scaledown_window=1)
def one_gpu(seconds: float = 0.0) -> dict:
    time.sleep(seconds)
    return shown()


@ember.endpoint(gpu="H100", max_replicas=2, concurrency=1, scaledown_window=30)
def restored_gpu(seconds: float = 0.0) -> dict:
    time.sleep(seconds)
    return shown()


@ember.endpoint(snapshot=False)
def no_gpu() -> dict:
    return shown()


@ember.endpoint(gpu=["A100", "H100"], snapshot=False, scaledown_window=1)
def either_gpu() -> dict:
    """A100 preferred, H100 taken where there is none."""
    return shown()


@ember.endpoint(gpu="H100:2", snapshot=False, scaledown_window=600)
def both_gpus() -> dict:
    """Idle for ten minutes before it scales down, holding both of the node's GPUs."""
    return shown()
