"""Run a coroutine on uvloop when it is installed (faster, and it sets TCP_NODELAY), with
subprocesses that run no Python in the forked child (`ember.loop_subprocesses`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


@functools.cache
def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    from ember.loop_subprocesses import fork_safe_loop_class

    loop_class: Callable[[], asyncio.AbstractEventLoop] = fork_safe_loop_class(uvloop.Loop)
    return loop_class


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(coroutine)
