"""This process's view of the platform lease, kept by a thread of its own: `held` while it
may act as the owner, `lost` the moment it may no longer (fencing), and the owner's URL
for a process that is not the owner.

The thread renews (or tries to take) the lease every `interval`; each answer reaches the
event loop as a callback. While held, a timer on the loop fires at the lease's local
deadline (`LeaseState.valid_until`): a holder whose renewals stop getting through (the
database lost, or this process starved) stops acting before anyone may take over."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

from ember_platform.peers.lease_connection import LeaseUnavailable
from ember_platform.peers.platform_lease import LeaseState, PlatformLease

log = logging.getLogger("ember.server")


class Leadership:
    def __init__(self, lease: PlatformLease, interval: float) -> None:
        self.lease = lease
        self.interval = interval
        self.held = asyncio.Event()  # this process owns the platform now
        self.lost = asyncio.Event()  # it owned it and may no longer: stop acting at once
        self.owner_known = asyncio.Event()  # `owner_url` names a live owner
        self.owner_url: str | None = None
        self.answered = asyncio.Event()  # the first answer (or failure) is in
        self.problem: str | None = None  # why the lease could not be read, if it could not
        self.term = 0
        self.fences = 0  # times this process lost the lease while holding it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._keep, name="ember-lease", daemon=True)
        self._thread.start()

    def _keep(self) -> None:
        loop = self._loop
        assert loop is not None
        while not self._stop.is_set():
            state: LeaseState | None = None
            problem: str | None = None
            try:
                state = self.lease.take()
            except LeaseUnavailable as error:
                problem = str(error)
            if self._stop.is_set():
                break
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._update, state, problem)
            self._stop.wait(self.interval)

    def _update(self, state: LeaseState | None, problem: str | None) -> None:
        if self._stop.is_set():
            return
        self.answered.set()
        if state is None:
            if problem != self.problem:
                log.warning("cannot renew or read the platform lease: %s", problem)
            self.problem = problem
            if not self.held.is_set():
                self._owner(None)
            return  # a holder acts on until its deadline, which the timer keeps
        self.problem = None
        if state.held:
            assert self._loop is not None
            left = state.valid_until - time.monotonic()
            if left <= 0:
                self._fence("its renewal came back too late")
                return
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self._loop.call_later(
                left, self._fence, "it could not renew it in time"
            )
            if not self.held.is_set():
                log.warning("this process owns the platform now (lease term %d)", state.term)
                self.term = state.term
                self.lost.clear()
                self.held.set()
            self._owner(self.lease.holder_url)
            return
        if self.held.is_set():
            self._fence("another process holds it")
        self._owner(None if state.holder is None or state.expired else state.holder_url)

    def _owner(self, url: str | None) -> None:
        self.owner_url = url
        if url is None:
            self.owner_known.clear()
        else:
            self.owner_known.set()

    def _fence(self, why: str) -> None:
        if not self.held.is_set():
            return
        log.error("this process lost the platform lease (%s): it stops acting as owner", why)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.fences += 1
        self.held.clear()
        self.lost.set()
        self._owner(None)

    async def stop(self, *, release: bool) -> None:
        """Stop renewing; `release` gives the lease up at once (an orderly stop, once this
        process stopped acting as owner), else it runs out by itself."""
        self._stop.set()
        if self._deadline is not None:
            self._deadline.cancel()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        if release:
            await asyncio.to_thread(self.lease.release)
        self.lease.close()
