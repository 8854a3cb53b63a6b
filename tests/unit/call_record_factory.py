"""A spawned call's record for unit tests of what the platform does with ended calls
(webhook payloads and deliveries): one that succeeded, changed as a test asks."""

from __future__ import annotations

from ember_platform.storage.records import CallRecord, CallStatus


def ended_call(**changes: object) -> CallRecord:
    record = CallRecord(
        "c-1",
        "app--echo",
        "__call__",
        b"{}",
        CallStatus.SUCCEEDED,
        1,
        10.0,
        12.5,
        200,
        b'{"text": "hi"}',
        "application/json",
        None,
        "https://h/x",
        "pending",
    )
    for key, value in changes.items():
        setattr(record, key, value)
    return record
