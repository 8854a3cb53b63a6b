"""A ready replica's `@ember.health_check`, run every `period` seconds until it fails
`failures` times in a row; then the replica tells the control plane it is unhealthy,
which replaces it. Each failure is said in the replica's log, with why."""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

from ember.endpoints.health import HealthCheck
from ember.helper_threads import start_helper_thread


def _say(text: str) -> None:
    print(f"ember: {text}", file=sys.stderr, flush=True)


class CheckExited(Exception):
    """The check called sys.exit or raised KeyboardInterrupt: a failed check, as any other
    exception is, not the end of the replica (asyncio would let those two end the loop)."""


async def _guarded(hook: Callable[[], Awaitable[Any]]) -> Any:
    try:
        return await hook()
    except (SystemExit, KeyboardInterrupt) as exc:
        raise CheckExited(f"{type(exc).__name__}: {exc}") from None


class HealthMonitor:
    def __init__(
        self,
        name: str,
        hook: Callable[[], Any],
        check: HealthCheck,
        report_unhealthy: Callable[[str], Awaitable[None]],
    ) -> None:
        self.name = name
        self.hook = hook
        self.check = check
        self.report_unhealthy = report_unhealthy
        # A sync check runs on a daemon thread of its own, so that a full input pool
        # cannot delay it, one that hangs is not started again beside itself, and the
        # process can still exit around a hung one.
        self._hung: tuple[Future[Any], float] | None = None

    async def run(self) -> None:
        failed = 0
        while True:
            await asyncio.sleep(self.check.period)
            problem = await self.check_once()
            if problem is None:
                if failed:
                    _say(f"health check {self.name} passed again after {failed} failure(s)")
                failed = 0
                continue
            failed += 1
            _say(
                f"health check {self.name} failed ({failed} of {self.check.failures} in a "
                f"row): {problem}"
            )
            if failed >= self.check.failures:
                await self.report_unhealthy(problem)
                return

    async def check_once(self) -> str | None:
        """Why the check failed, or None when it passed."""
        timeout = self.check.timeout
        try:
            if inspect.iscoroutinefunction(self.hook):
                await asyncio.wait_for(_guarded(self.hook), timeout)
                return None
            if self._hung is not None:
                future, since = self._hung
                if not future.done():
                    return (
                        f"the check started {time.monotonic() - since:.1f} s ago has not returned"
                    )
                self._hung = None
            future = self._start_sync_check()
            try:
                await asyncio.wait_for(asyncio.wrap_future(future), timeout)
            except TimeoutError:
                self._hung = (future, time.monotonic() - timeout)
                raise
            return None
        except TimeoutError:
            return f"it did not return within {timeout:g} s"
        except CheckExited as exc:
            return str(exc)
        except Exception as exc:  # what the code raised is the reason, not a crash
            return f"{type(exc).__name__}: {exc}"

    def _start_sync_check(self) -> Future[Any]:
        future: Future[Any] = Future()

        def check() -> None:
            try:
                future.set_result(self.hook())
            except (SystemExit, KeyboardInterrupt) as exc:
                future.set_exception(CheckExited(f"{type(exc).__name__}: {exc}"))
            except BaseException as exc:  # handed to the event loop, which reports it
                future.set_exception(exc)

        future.set_running_or_notify_cancel()
        start_helper_thread(check, "ember-health")
        return future
