"""This process's view of the apps' leases (`peers/app_leases.py`), kept by a thread of
its own: which apps it owns now, and where every other owned app's owner serves.

As with the platform lease (`peers/leadership.py`), a slow database delays rounds, never
the event loop, and a timer at the last round's `valid_until` makes this process own
nothing the moment its renewals stop getting through, before any other may take over."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

from ember_platform.peers.app_leases import AppLeases, AppRound
from ember_platform.peers.lease_connection import LeaseUnavailable

log = logging.getLogger("ember.server")


class AppOwnership:
    def __init__(self, leases: AppLeases, interval: float) -> None:
        self.leases = leases
        self.interval = interval
        self.owned: dict[str, int] = {}  # app -> its lease's term, while this process owns it
        self.owners: dict[str, str] = {}  # app -> where its owner serves
        self.members = 0  # live processes, as last read
        self.answered = asyncio.Event()  # the first round's answer (or failure) is in
        self.problem: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def owner_of(self, app: str) -> str | None:
        return self.owners.get(app)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._keep, name="ember-app-leases", daemon=True)
        self._thread.start()

    def _keep(self) -> None:
        loop = self._loop
        assert loop is not None
        while not self._stop.is_set():
            found: AppRound | None = None
            problem: str | None = None
            try:
                found = self.leases.round()
            except LeaseUnavailable as error:
                problem = str(error)
            if self._stop.is_set():
                break
            acted = threading.Event()  # set once the loop took the round in
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._update, found, problem, acted)
            # Apps past this process's share are given up only once the loop stopped
            # acting for them; a loop that takes longer gives them up a round later.
            if found is not None and found.to_give and acted.wait(self.interval):
                with contextlib.suppress(LeaseUnavailable):
                    self.leases.give_up(found.to_give)
            self._stop.wait(self.interval)

    def _update(self, found: AppRound | None, problem: str | None, acted: threading.Event) -> None:
        try:
            self._take_in(found, problem)
        finally:
            acted.set()

    def _take_in(self, found: AppRound | None, problem: str | None) -> None:
        if self._stop.is_set():
            return
        self.answered.set()
        if found is None:
            if problem != self.problem:
                log.warning("cannot renew or read the apps' leases: %s", problem)
            self.problem = problem
            return  # what it owns it owns until its deadline, which the timer keeps
        self.problem = None
        left = found.valid_until - time.monotonic()
        if left <= 0:
            self._fence("its renewal came back too late")
            return
        assert self._loop is not None
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self._loop.call_later(left, self._fence, "it could not renew them in time")
        taken = found.owned.keys() - self.owned.keys()
        lost = self.owned.keys() - found.owned.keys()
        if taken or lost:
            log.info(
                "apps owned: %d (took %s; gave up or lost %s) of %d live processes",
                len(found.owned),
                ", ".join(sorted(taken)) or "none",
                ", ".join(sorted(lost)) or "none",
                found.members,
            )
        self.owned = found.owned
        self.owners = found.owners
        self.members = found.members

    def _fence(self, why: str) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self.owned:
            log.error("this process stops owning its %d apps: %s", len(self.owned), why)
        self.owned = {}
        self.owners = {}

    async def stop(self, *, leave: bool) -> None:
        """Stop renewing; `leave` gives every app up at once (an orderly stop, once this
        process stopped acting for them), else the leases run out by themselves."""
        self._stop.set()
        if self._deadline is not None:
            self._deadline.cancel()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self.owned = {}
        if leave:
            await asyncio.to_thread(self.leases.leave)
        self.leases.close()
