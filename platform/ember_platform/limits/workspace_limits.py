"""Each workspace's admission limits (`limits/admission.py`): the server's defaults
(`ember server --workspace-max-queued --workspace-max-running --workspace-rate`), and
what an admin set for one workspace (`ember workspace set NAME --max-queued N ...`).

Kept in the state store, so that they outlive a restart and the process that takes the
platform over reads them; held here in memory, the store written first on each change.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from ember_platform.errors import InvalidRequest
from ember_platform.limits.admission import WorkspaceLimits
from ember_platform.security.rate_limits import RateLimit, parse_rate_limit
from ember_platform.storage.records import WorkspaceLimitsRecord
from ember_platform.storage.state_store import StateStore

LIMITS = ("max_queued", "max_running", "rate")
NO_RATE = "none"  # a workspace's rate: no limit, whatever the default
MAX_COUNT = 1_000_000_000


def rate_of(text: str | None) -> RateLimit | None:
    """A stored or given rate ("100/s", or "none"); ValueError saying what is expected."""
    if text is None or text.strip().lower() == NO_RATE:
        return None
    return parse_rate_limit(text)


class WorkspaceLimitRegistry:
    def __init__(self, store: StateStore, defaults: WorkspaceLimits) -> None:
        self._store = store
        self.defaults = defaults
        self._set: dict[str, WorkspaceLimitsRecord] = {}
        self._limits: dict[str, WorkspaceLimits] = {}  # those in force, where any is set
        for record in store.list_workspace_limits():
            self._keep(record)

    def of(self, workspace: str) -> WorkspaceLimits:
        """The limits in force for `workspace`."""
        return self._limits.get(workspace, self.defaults)

    def settings(self, workspace: str) -> WorkspaceLimitsRecord:
        """What an admin set for `workspace` (None where the default holds)."""
        return self._set.get(workspace) or WorkspaceLimitsRecord(workspace)

    def change(self, workspace: str, changes: dict[str, Any]) -> WorkspaceLimitsRecord:
        """Set the limits `changes` names ({"max_queued": 50, "rate": "10/s"}; None: back
        to the default); InvalidRequest for a name or a value that cannot be one."""
        unknown = sorted(set(changes) - set(LIMITS))
        if unknown:
            raise InvalidRequest(f"no workspace limit named {unknown[0]} (there are {LIMITS})")
        fields: dict[str, Any] = {}
        for name in ("max_queued", "max_running"):
            if name in changes:
                fields[name] = _count(name, changes[name])
        if "rate" in changes:
            fields["rate"] = _rate(changes["rate"])
        record = replace(self.settings(workspace), **fields, updated_at=time.time())
        self._store.put_workspace_limits(record)
        self._keep(record)
        return record

    def forget(self, workspace: str) -> None:
        """A workspace removed (the store dropped its row with it)."""
        self._set.pop(workspace, None)
        self._limits.pop(workspace, None)

    def _keep(self, record: WorkspaceLimitsRecord) -> None:
        self.forget(record.workspace)
        if record.empty:
            return
        self._set[record.workspace] = record
        default = self.defaults
        rate = default.rate if record.rate is None else rate_of(record.rate)
        self._limits[record.workspace] = WorkspaceLimits(
            max_queued=record.max_queued or default.max_queued,
            max_running=record.max_running or default.max_running,
            rate=rate,
        )


def _count(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
        raise InvalidRequest(f"{name} is a whole number from 1 to {MAX_COUNT}, not {value!r}")
    return value


def _rate(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f"rate is text such as 100/s or {NO_RATE}, not {value!r}")
    try:
        limit = rate_of(value)
    except ValueError as exc:
        raise InvalidRequest(f"{exc}, or {NO_RATE}") from None
    return NO_RATE if limit is None else str(limit)
