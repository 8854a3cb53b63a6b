"""`@ember.batched` through the platform: concurrent calls share one call of the
function, and each caller gets what a call of its own would have given."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import Platform

import ember

APP = "batching"


def test_concurrent_calls_are_batched_with_the_same_results(
    platform: Platform, apps_dir: Path
) -> None:
    platform.deploy(apps_dir / "batching.py", APP)
    double = ember.Endpoint.lookup(APP, "double", config=platform.config())
    alone = double.call(x=21)
    assert alone == {"y": 42, "batch": 1}
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda v: double.call(x=v), range(16)))
    assert [r["y"] for r in results] == [2 * v for v in range(16)]
    assert max(r["batch"] for r in results) > 1  # calls shared a batch
    assert all(r["batch"] <= 8 for r in results)

    lengths = ember.Endpoint.lookup(APP, "lengths", config=platform.config())
    words = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff"]
    with ThreadPoolExecutor(max_workers=6) as pool:
        measured = list(pool.map(lambda w: lengths.measure.call(text=w, plus=1), words))
    assert [m["n"] for m in measured] == [len(w) + 1 for w in words]
    assert max(m["batch"] for m in measured) > 1
    assert lengths.measure.call(text="xyz") == {"n": 3, "batch": 1}  # the default applies
