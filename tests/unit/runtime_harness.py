"""A replica runtime for one endpoint function, driven without a process or a network:
tests call its `_dispatch` with frames and read what it sends from their own channel."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import ember
from ember_worker.identity import ReplicaSpec
from ember_worker.replica.channel import ReplicaChannel
from ember_worker.replica.serving import ReplicaRuntime


def runtime_for(func: Callable[..., Any], channel: Any, concurrency: int = 1) -> ReplicaRuntime:
    """`func` as an endpoint, sending its frames to `channel` (anything with `send`)."""
    spec = ReplicaSpec(
        bundle_dir=Path("."),
        entry="app.py",
        attribute=func.__name__,
        concurrency=concurrency,
        label=f"app--{func.__name__}",
        control_fd=-1,
        status_fd=-1,
    )
    return ReplicaRuntime(spec, ember.endpoint()(func), ReplicaChannel(channel))
