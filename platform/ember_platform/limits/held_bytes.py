"""Bytes of calls' bodies, results and stream events the control plane holds at once,
per workspace and in all, within budgets (`ember server --workspace-held-mb`,
`--max-held-mb`).

A workspace past its budget, or past an even share of the platform's while the platform
is past its own, takes no more: its new calls wait for room before their bodies are
read (503 with Retry-After if none comes soon), and its replicas' channels are read no
further until its callers take what is held (the results wait in the replicas). Others'
calls go on. Accepted calls are never dropped for it: they wait.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from ember.wire.labels import MAIN_WORKSPACE, SEPARATOR

MIB = 1024 * 1024
DEFAULT_WORKSPACE_MIB = 256
DEFAULT_PLATFORM_MIB = 1024


@dataclass(frozen=True)
class ByteBudgets:
    workspace: int = DEFAULT_WORKSPACE_MIB * MIB  # bytes one workspace may hold
    platform: int = DEFAULT_PLATFORM_MIB * MIB  # bytes all of them may hold together


def over_budget(held_by: int, held: int, holders: int, budgets: ByteBudgets) -> bool:
    """Whether a workspace holding `held_by` bytes may take no more, while `holders`
    workspaces hold `held` bytes in all: past its own budget, or, when the platform is
    past its, past an even share of it (so one workspace never stops the others)."""
    if held_by >= budgets.workspace:
        return True
    return held >= budgets.platform and held_by >= budgets.platform // max(1, holders)


def workspace_of(label: str) -> str:
    """The workspace of a deployed endpoint's label (an input's: checked when it came).
    Only split, not checked again: a call asks it four times."""
    parts = label.split(SEPARATOR)
    return parts[0] if len(parts) == 3 else MAIN_WORKSPACE


@dataclass
class HeldBytes:
    budgets: ByteBudgets = field(default_factory=ByteBudgets)
    held: int = field(default=0, init=False)
    _by_workspace: dict[str, int] = field(default_factory=dict, init=False)
    _waiters: list[asyncio.Future[None]] = field(default_factory=list, init=False)

    def of(self, workspace: str) -> int:
        return self._by_workspace.get(workspace, 0)

    def by_workspace(self) -> dict[str, int]:
        return dict(self._by_workspace)

    def full(self, workspace: str) -> bool:
        return over_budget(self.of(workspace), self.held, len(self._by_workspace), self.budgets)

    def hold(self, workspace: str, size: int) -> None:
        """Count `size` bytes more as held (they are in memory already)."""
        if size > 0:
            self._by_workspace[workspace] = self.of(workspace) + size
            self.held += size

    def release(self, workspace: str, size: int) -> None:
        if size <= 0:
            return
        left = self.of(workspace) - size
        if left > 0:
            self._by_workspace[workspace] = left
        else:
            self._by_workspace.pop(workspace, None)
        self.held -= size
        if not self._waiters:
            return
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def room(self, workspace: str, timeout: float | None = None) -> bool:
        """Wait until the workspace may take more (True), or `timeout` seconds (False)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self.full(workspace):
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return False
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, left)
            except TimeoutError:
                with contextlib.suppress(ValueError):  # unless a release took it meanwhile
                    self._waiters.remove(waiter)
                return False
        return True
