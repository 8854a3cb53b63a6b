"""Helper threads that leave SIGINT and SIGTERM to the main thread.

The kernel hands a process's signal to any thread that does not block it, while Python
runs signal handlers only in the main thread: a Ctrl+C that lands on a helper thread sets
a flag, but a main thread blocked in a read (a call's answer) is not woken to see it, and
the command seems to ignore the key until that read ends."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


def block_stop_signals() -> None:
    """Keep SIGINT and SIGTERM off the calling thread (a pool's initializer)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def start_helper_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread running `target` with SIGINT and SIGTERM blocked from its start: a
    thread inherits its creator's mask, so the mask is set around its creation rather than
    in the thread, where a signal could land before it blocks them."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return thread
