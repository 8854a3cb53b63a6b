"""Which versions of which weights objects a replica has read, and whether they are still
current: how a replica restored from a snapshot finds that weights it loaded before the
snapshot were rewritten at the same URL since.

Every object `open_weights` reads is noted with its version tag (ETag, Last-Modified, or
size and mtime). The list is in the snapshot's memory and, at the dump, in the image's
metadata. After a restore the replica asks each origin for the object's version again,
in parallel, before it serves: a changed one means the image holds stale weights, and
the agent boots the replica cold instead and drops the image, so that the next snapshot
holds the new ones.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass

import msgspec

from ember.wire import messages as wire
from ember_worker.weights.origins.by_scheme import open_origin
from ember_worker.weights.origins.origin import ObjectVersion

CHECK_CONCURRENCY = 16


@dataclass(frozen=True)
class ReadObject:
    url: str
    s3_endpoint_url: str | None
    tag: str  # its version when it was read


_read: dict[tuple[str, str | None], ReadObject] = {}
_lock = threading.Lock()


def note_read(url: str, s3_endpoint_url: str | None, version: ObjectVersion) -> None:
    """Remember the version of an object this process reads (the latest, if read twice)."""
    with _lock:
        _read[(url, s3_endpoint_url)] = ReadObject(url, s3_endpoint_url, version.tag)


def read_objects() -> list[ReadObject]:
    with _lock:
        return list(_read.values())


def as_dicts(objects: Sequence[ReadObject]) -> list[dict[str, str | None]]:
    return [asdict(o) for o in objects]


@dataclass(frozen=True)
class Freshness:
    changed: list[dict[str, str]]  # url, was, now
    unchecked: list[dict[str, str]]  # url, error: origins that did not answer in time

    def to_report(self, seconds: float, checked: int) -> wire.WeightsChecked:
        """What the replica tells its agent on its status pipe."""
        return msgspec.convert(
            {
                "changed": self.changed,
                "unchecked": self.unchecked,
                "checked": checked,
                "seconds": round(seconds, 4),
            },
            wire.WeightsChecked,
        )


def current_version(obj: ReadObject) -> ObjectVersion:
    """What the object's origin says its version is now."""
    return open_origin(obj.url, s3_endpoint_url=obj.s3_endpoint_url).stat()


def check(
    objects: Sequence[ReadObject],
    timeout: float,
    stat: Callable[[ReadObject], ObjectVersion] = current_version,
) -> Freshness:
    """Ask for every object's version at once; which changed, and which could not be
    asked within `timeout` seconds (a failing origin is not taken for a change: a cold
    boot could not read it either)."""
    changed: list[dict[str, str]] = []
    unchecked: list[dict[str, str]] = []
    if not objects:
        return Freshness(changed, unchecked)
    pool = ThreadPoolExecutor(min(CHECK_CONCURRENCY, len(objects)), "ember-weights-check")
    try:
        futures = {pool.submit(stat, obj): obj for obj in objects}
        done, late = wait(futures, timeout=timeout)
        for future in done:
            obj = futures[future]
            error = future.exception()
            if error is not None:
                unchecked.append({"url": obj.url, "error": f"{type(error).__name__}: {error}"})
            elif (tag := future.result().tag) != obj.tag:
                changed.append({"url": obj.url, "was": obj.tag, "now": tag})
        for future in late:
            unchecked.append({"url": futures[future].url, "error": f"no answer in {timeout:g} s"})
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    order = {obj.url: i for i, obj in enumerate(objects)}
    changed.sort(key=lambda c: order[c["url"]])
    unchecked.sort(key=lambda c: order[c["url"]])
    return Freshness(changed, unchecked)
