"""`ember snapshot`: which endpoints an argument names, and how rows read."""

from __future__ import annotations

import time

import pytest

from ember.cli.ops.snapshot import KEY_PREFIX, _failure, _row, _selector, _without_snapshot


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (None, (None, None)),
        ("app", ("app", None)),
        ("app--model", ("app", "model")),
        ("app/model", ("app", "model")),
    ],
)
def test_an_app_or_one_of_its_endpoints(target: str | None, expected: tuple) -> None:
    assert _selector(target) == expected


def test_only_hex_of_six_characters_or_more_may_be_a_key() -> None:
    assert KEY_PREFIX.match("3f2a9c") and KEY_PREFIX.match("a" * 32)
    assert not KEY_PREFIX.match("3f2a9") and not KEY_PREFIX.match("chat-model")


def test_a_stored_image_row() -> None:
    now = time.time()
    row = _row(
        {
            "label": "app--model",
            "key": "0123456789abcdef" * 2,
            "state": "ready",
            "version": 3,
            "size": 274_000_000,
            "raw_size": 1_080_000_000,
            "dump_seconds": 1.234,
            "created_at": now - 7200,
            "restores": 12,
            "last_restored_at": now - 90,
            "last_restore_seconds": 0.3141,
            "nodes": ["node-a", "node-b"],
        }
    )
    assert row == [
        "app--model",
        "0123456789ab",
        "ready",
        "v3",
        "274 MB",
        "1080 MB",
        "1.23 s",
        "2h ago",
        "12",
        "1m ago in 0.31 s",
        "node-a, node-b",
    ]
    taking = _row({"label": "app--model", "key": "ab" * 16, "state": "taking", "nodes": []})
    assert taking[2:] == ["taking", "-", "-", "-", "-", "-", "-", "-", "-"]


def test_why_an_endpoint_has_no_image() -> None:
    endpoint = {"label": "app--model", "snapshot": False, "note": None}
    assert (
        _without_snapshot(endpoint) == "app--model: snapshot=False: its replicas always boot cold"
    )
    endpoint.update(snapshot=True, note="snapshots are off on worker a: no CRIU")
    assert _without_snapshot(endpoint).endswith("boot cold: snapshots are off on worker a: no CRIU")
    endpoint["note"] = None
    assert "none yet" in _without_snapshot(endpoint)
    now = time.time()
    failed = {
        "label": "app--model",
        "key": "ab" * 16,
        "failed_at": now - 120,
        "retry_at": now + 480,
        "reason": "CRIU dump timed out after 180 s",
    }
    assert _failure(failed, now) == (
        "app--model: the snapshot abababababab failed 2m ago, next try in 8 min "
        "(`ember snapshot rm app--model` tries at once): CRIU dump timed out after 180 s"
    )
