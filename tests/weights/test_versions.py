"""Whether weights read before a snapshot are still current (weights/versions.py)."""

from __future__ import annotations

import threading

from ember_worker.weights import versions
from ember_worker.weights.origins.origin import ObjectVersion
from ember_worker.weights.versions import ReadObject, check, note_read, read_objects


def test_each_object_is_noted_once_with_its_latest_version(monkeypatch):
    monkeypatch.setattr(versions, "_read", {})
    note_read("s3://b/a.safetensors", None, ObjectVersion(10, '"etag-1"'))
    note_read("s3://b/a.safetensors", None, ObjectVersion(10, '"etag-2"'))  # read again
    note_read("s3://b/a.safetensors", "http://127.0.0.1:9000", ObjectVersion(10, "x"))
    assert read_objects() == [
        ReadObject("s3://b/a.safetensors", None, '"etag-2"'),
        ReadObject("s3://b/a.safetensors", "http://127.0.0.1:9000", "x"),
    ]


def test_changed_and_unanswered_objects_are_told_apart():
    objects = [
        ReadObject("s3://b/same", None, "v1"),
        ReadObject("s3://b/changed", None, "v1"),
        ReadObject("s3://b/failing", None, "v1"),
    ]
    now = {"s3://b/same": "v1", "s3://b/changed": "v2"}

    def stat(obj: ReadObject) -> ObjectVersion:
        if obj.url not in now:
            raise ConnectionError("refused")
        return ObjectVersion(1, now[obj.url])

    freshness = check(objects, timeout=5, stat=stat)
    assert freshness.changed == [{"url": "s3://b/changed", "was": "v1", "now": "v2"}]
    assert freshness.unchecked == [{"url": "s3://b/failing", "error": "ConnectionError: refused"}]


def test_the_objects_are_asked_at_once_and_a_slow_origin_is_not_waited_for():
    release = threading.Event()
    # The three that answer meet at a barrier: asked one after the other, they could not.
    together = threading.Barrier(3, timeout=30)
    objects = [ReadObject(f"s3://b/{i}", None, "v") for i in range(4)]

    def stat(obj: ReadObject) -> ObjectVersion:
        if obj.url == "s3://b/3":
            release.wait(30)  # an origin that does not answer
        else:
            together.wait()
        return ObjectVersion(1, "v")

    try:
        freshness = check(objects, timeout=1.0, stat=stat)
        answered_before_release = not release.is_set()
    finally:
        release.set()
    assert answered_before_release  # the check did not wait for the slow origin
    assert freshness.changed == []
    assert freshness.unchecked == [{"url": "s3://b/3", "error": "no answer in 1 s"}]


def test_nothing_read_means_nothing_to_check():
    freshness = check([], timeout=1, stat=lambda obj: ObjectVersion(0, ""))
    assert freshness.changed == [] and freshness.unchecked == []
