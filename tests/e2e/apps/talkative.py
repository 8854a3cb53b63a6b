"""An endpoint whose calls print while others run beside them (test_call_logs.py)."""

import asyncio
import sys
import time

import ember


@ember.endpoint(concurrency=4, scaledown_window=30)
def chatter(word: str, lines: int = 5) -> dict:
    for n in range(lines):
        print(f"{word} line {n}")
        time.sleep(0.02)
    print(f"{word} done", file=sys.stderr)
    return {"word": word}


@ember.endpoint(concurrency=4, scaledown_window=30)
async def murmur(word: str) -> dict:
    for n in range(3):
        print(f"{word} async {n}")
        await asyncio.sleep(0.02)
    return {"word": word}


@ember.endpoint(concurrency=4, scaledown_window=30)
def whoami() -> dict:
    return {"call": ember.current_call_id()}


@ember.endpoint(concurrency=4, scaledown_window=30)
async def whoami_async() -> dict:
    await asyncio.sleep(0)
    return {"call": ember.current_call_id()}


@ember.endpoint(concurrency=1, scaledown_window=30)
def delegate(word: str) -> dict:
    # A thread of the code's own does not inherit its context: its lines are still the
    # call's, the one input running.
    import threading

    helper = threading.Thread(target=lambda: print(f"{word} from a helper thread"))
    helper.start()
    helper.join()
    return {"word": word}
