"""What the replica asks of the weights modules (ember_worker.weights), and only if the
user's code loaded them: none of this imports them, so an endpoint that reads no weights
pays nothing. Connections are dropped before a snapshot's quiet point and after a
restore, mapped weights made whole for a snapshot, what was read listed for the image's
metadata and checked against the origins after a restore, and totals counted for the
heartbeats."""

from __future__ import annotations

import sys
import time
from typing import Any

from ember.wire import messages as wire


def drop_weights_connections() -> None:
    """Close the connections of weights readers, if any were opened: before the quiet
    point, and after a restore (whatever the image held is dead)."""
    opener = sys.modules.get("ember_worker.weights.opener")
    if opener is not None:
        opener.drop_connections()


def follow_weights_cache_dir() -> None:
    """After a restore: weights readers opened before the snapshot write into this
    node's cache, not the snapshot node's (opener.follow_cache_dir)."""
    opener = sys.modules.get("ember_worker.weights.opener")
    if opener is not None:
        opener.follow_cache_dir()


def complete_mapped_weights() -> None:
    """Make whole on this node's disk every weights object a tensor still maps, if
    weights were opened at all (opener.complete_mapped_objects)."""
    opener = sys.modules.get("ember_worker.weights.opener")
    if opener is not None:
        opener.complete_mapped_objects()


def weights_read() -> list[wire.ReadWeights]:
    """The weights objects this process has read and their versions (versions.py), for
    the image's metadata."""
    module = sys.modules.get("ember_worker.weights.versions")
    if module is None:
        return []
    return [wire.ReadWeights(**read) for read in module.as_dicts(module.read_objects())]


def check_weights_versions(timeout: float) -> wire.WeightsChecked | None:
    """After a restore: whether the weights read before the snapshot are still current
    at their origins (a `weights_checked` event for the agent); None if none were read."""
    module = sys.modules.get("ember_worker.weights.versions")
    objects = module.read_objects() if module is not None else []
    if module is None or not objects:
        return None
    started = time.monotonic()
    freshness = module.check(objects, timeout)
    report: wire.WeightsChecked = freshness.to_report(time.monotonic() - started, len(objects))
    return report


def weights_read_totals() -> dict[str, Any] | None:
    """The running totals of what weights this process read, once it has read any, else
    None (a heartbeat's `weights`)."""
    module = sys.modules.get("ember_worker.weights.totals")
    if module is None:
        return None
    counts: dict[str, Any] = module.totals.snapshot()
    return counts if counts["chunks"] else None


def reset_weights_totals() -> None:
    """After a restore: the reads in the image were the original replica's, counted there."""
    module = sys.modules.get("ember_worker.weights.totals")
    if module is not None:
        module.totals.reset()
