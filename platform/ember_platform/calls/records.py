"""Async calls' records in the state store, held in memory while the store cannot take them.

A full disk must delay a spawned call's result, not lose it: a record the store refuses
is kept (the newest per call), served from memory, and written again on every `retry()`
(each controller tick) until the store takes it. Only a new call is refused outright
(`accept`), so that nothing is promised that could not be kept across a restart.
"""

from __future__ import annotations

import dataclasses
import logging

from ember.wire.labels import MAIN_WORKSPACE, split_app_key, split_label
from ember_platform.storage.records import CallRecord
from ember_platform.storage.state_store import StateStore, StoreWriteError

log = logging.getLogger("ember.calls")


class CallRecords:
    def __init__(self, store: StateStore) -> None:
        self.store = store
        self._held: dict[str, CallRecord] = {}

    @property
    def held(self) -> int:
        """How many records wait in memory for the store."""
        return len(self._held)

    def accept(self, record: CallRecord) -> None:
        """A new call's first record: StoreWriteError if the store cannot take it, and
        then the call must be refused."""
        self.store.put_call(record)

    def put(self, record: CallRecord) -> None:
        """A later state of a call: stored, or held until the store takes it."""
        self._held.pop(record.id, None)  # the newest state replaces an older held one
        if self._held:
            # Order matters only per call, but a store that just refused another record
            # will refuse this one too: wait for the next retry rather than fail twice.
            self._hold(record, None)
            return
        try:
            self.store.put_call(record)
        except StoreWriteError as error:
            self._hold(record, error)

    def webhook_ended(self, record: CallRecord, state: str) -> None:
        """A webhook was delivered, or given up on: kept in the call's record (unless the
        record has gone meanwhile), so that a restart does not send it again."""
        if self.get(record.id) is not None:
            self.put(dataclasses.replace(record, webhook_state=state))

    def get(self, call_id: str) -> CallRecord | None:
        held = self._held.get(call_id)
        return held if held is not None else self.store.get_call(call_id)

    def recent(
        self,
        app: str | None,
        label: str | None,
        limit: int,
        workspace: str | None = MAIN_WORKSPACE,
    ) -> list[CallRecord]:
        """The newest calls (of an endpoint, an app, or every app of `workspace`; None:
        of every workspace), newest first, held states included."""
        records = {r.id: r for r in self.store.recent_calls(app, label, limit, workspace)}
        for record in self._held.values():
            parts = split_label(record.label)
            if parts is None or (label is not None and record.label != label):
                continue
            if app is not None and parts[0] != app:
                continue
            if app is None and workspace is not None and split_app_key(parts[0])[0] != workspace:
                continue
            records[record.id] = record
        return sorted(records.values(), key=lambda r: r.created_at, reverse=True)[:limit]

    def retry(self) -> int:
        """Write the held records; returns how many are still held."""
        if not self._held:
            return 0
        stored = 0
        for call_id, record in list(self._held.items()):
            try:
                self.store.put_call(record)
            except StoreWriteError:
                return len(self._held)
            del self._held[call_id]
            stored += 1
        log.warning("the state store takes writes again: stored %d held call records", stored)
        return 0

    def _hold(self, record: CallRecord, error: StoreWriteError | None) -> None:
        if error is not None and not self._held:
            log.warning(
                "%s; async call records are held in memory until it takes writes again "
                "(they are lost if the server stops first)",
                error,
            )
        self._held[record.id] = record
