"""Helper threads leave SIGINT and SIGTERM to the main thread, which runs the handlers."""

from __future__ import annotations

import signal

from ember.calling.mapping import map_calls
from ember.helper_threads import STOP_SIGNALS, start_helper_thread


def _blocked() -> set[signal.Signals]:
    return set(signal.pthread_sigmask(signal.SIG_BLOCK, []))


def test_a_helper_thread_blocks_the_stop_signals_and_its_creator_does_not() -> None:
    before = _blocked()
    seen: list[set[signal.Signals]] = []
    thread = start_helper_thread(lambda: seen.append(_blocked()), "test-helper")
    thread.join(5)
    assert thread.daemon
    assert seen[0] >= STOP_SIGNALS
    assert _blocked() == before and not STOP_SIGNALS & before


def test_map_calls_run_on_threads_that_leave_ctrl_c_to_the_caller() -> None:
    results = map_calls(
        lambda _: _blocked(),
        ({"i": i} for i in range(3)),
        concurrency=2,
        order_outputs=True,
        return_exceptions=False,
    )
    assert all(blocked >= STOP_SIGNALS for _, blocked in results)
    assert not STOP_SIGNALS & _blocked()
