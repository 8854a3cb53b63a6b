"""`Endpoint.map`: many inputs through one endpoint method, concurrently, over shared
connections, with the platform's back-pressure (429 queue_full) waited out, not failed."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import httpx

from ember.calling.call_bodies import answer_value, call_body
from ember.cancellation import carried
from ember.errors import CallTimeoutError, InvalidError, RemoteError
from ember.helper_threads import block_stop_signals
from ember.wire.spec import STREAM_DONE
from ember.wire.sse import Event, parse_events

# How long a full queue's Retry-After may ask us to wait before one retry.
LONGEST_RETRY_AFTER_S = 30.0
# Inputs taken from the caller's iterable ahead of the results given back, per slot:
# enough to keep every slot busy while one slow input holds up ordered results, few
# enough that a map over a huge generator holds a bounded number of inputs and results.
BACKLOG_PER_SLOT = 16


def retry_after_seconds(header: str | None) -> float:
    """Seconds from a Retry-After header (delta seconds only), within [0.1, 30]."""
    try:
        seconds = float(header) if header is not None else 1.0
    except ValueError:
        seconds = 1.0
    if seconds != seconds:  # NaN
        seconds = 1.0
    return min(max(seconds, 0.1), LONGEST_RETRY_AFTER_S)


def post_until_queued(
    client: httpx.Client,
    url: str,
    arguments: Mapping[str, Any],
    error_from_response: Callable[[int, bytes], RemoteError],
    headers: dict[str, str] | None = None,
) -> Any:
    """One call; while the endpoint's queue is full, wait as it asks and send it again
    (the input was not taken, so nothing runs twice). A generator's result is the list
    of what it yielded."""
    while True:
        try:
            response = client.post(url, **call_body(arguments, headers))
        except httpx.TimeoutException as exc:
            raise no_answer_in_time(exc) from None
        answered, value = read_answer(response, error_from_response)
        if answered:
            return value
        time.sleep(value)


def no_answer_in_time(exc: httpx.TimeoutException) -> CallTimeoutError:
    # One slow input is that input's failure; closing its connection cancels it.
    return CallTimeoutError(408, "timeout", f"no answer in time ({exc})")


def read_answer(
    response: httpx.Response, error_from_response: Callable[[int, bytes], RemoteError]
) -> tuple[bool, Any]:
    """(True, the call's result), or (False, seconds to wait before sending it again)
    when the endpoint's queue was full; the call's error raised otherwise."""
    if response.status_code == 200:
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return True, streamed_items(response.text, error_from_response)
        return True, answer_value(response)
    if response.status_code == 429:
        return False, retry_after_seconds(response.headers.get("retry-after"))
    raise error_from_response(response.status_code, response.content)


def streamed_items(
    text: str, error_from_response: Callable[[int, bytes], RemoteError]
) -> list[Any]:
    """What a generator yielded, from its whole event stream; its error raised."""
    return [
        stream_item(event, error_from_response)
        for event in parse_events(text.splitlines())
        if not ends_stream(event)
    ]


def ends_stream(event: Event) -> bool:
    """OpenAI's last event (`@ember.method(stream_done=True)`): an end, not an item."""
    return event.event == "message" and event.data == STREAM_DONE


def stream_item(event: Event, error_from_response: Callable[[int, bytes], RemoteError]) -> Any:
    """One streamed item's value, or the error the stream ended with: of the status the
    call would have had, had it failed before its first item (504 past its own timeout,
    400 for an ember.InputError, ...)."""
    if event.event == "error":
        raise error_from_response(error_event_status(event.data), event.data.encode())
    return json.loads(event.data)


def error_event_status(data: str) -> int:
    try:
        status = json.loads(data)["error"]["status"]
    except (ValueError, KeyError, TypeError):
        return 500  # from a server that did not say
    return status if isinstance(status, int) and 400 <= status < 600 else 500


def checked_input(index: int, item: Any) -> Mapping[str, Any]:
    if not isinstance(item, Mapping) or not all(isinstance(key, str) for key in item):
        raise InvalidError(
            f"input {index} of the map is {type(item).__name__}, not a dict of keyword "
            "arguments: map over dicts, e.g. [{'text': 'a'}, {'text': 'b'}]"
        )
    return item


def map_calls(
    call: Callable[[Mapping[str, Any]], Any],
    inputs: Iterable[Mapping[str, Any]],
    *,
    concurrency: int,
    order_outputs: bool,
    return_exceptions: bool,
) -> Iterator[tuple[int, Any]]:
    """Run `call` over `inputs` on `concurrency` threads and yield (input index, result),
    in input order or as they finish. A failed input raises (after a note says which input it
    was) unless `return_exceptions`, which yields its RemoteError in its place. Leaving
    early, by an error or by closing the iterator, sends nothing more and waits for the
    calls in flight."""
    if concurrency < 1:
        raise InvalidError(f"concurrency must be at least 1, not {concurrency}")
    call = carried(call)  # in a replica, the calls are the running input's
    numbered = enumerate(inputs)
    backlog = concurrency * BACKLOG_PER_SLOT
    # Ctrl+C goes to the thread that waits on the calls, not to one blocked in a call.
    pool = ThreadPoolExecutor(
        concurrency, thread_name_prefix="ember-map", initializer=block_stop_signals
    )
    running: dict[Future[Any], int] = {}
    finished: dict[int, Future[Any]] = {}
    next_to_yield = 0
    exhausted = False
    leave_at_once = False
    try:
        while True:
            while not exhausted and len(running) + len(finished) < backlog:
                entry = next(numbered, None)
                if entry is None:
                    exhausted = True
                    break
                index, item = entry
                running[pool.submit(call, checked_input(index, item))] = index
            if not running and not finished:
                return
            if running:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    finished[running.pop(future)] = future
            if order_outputs:
                while next_to_yield in finished:
                    result = outcome(finished.pop(next_to_yield), next_to_yield, return_exceptions)
                    yield next_to_yield, result
                    next_to_yield += 1
            else:
                for index in sorted(finished):
                    yield index, outcome(finished.pop(index), index, return_exceptions)
    except (KeyboardInterrupt, SystemExit):
        leave_at_once = True  # the calls in flight end with the process
        raise
    finally:
        # Calls not yet sent are dropped. Those in flight are waited for: closing the
        # client under their threads would free sockets those threads still read, and a
        # new connection given the same descriptor would have its bytes stolen.
        pool.shutdown(wait=not leave_at_once, cancel_futures=True)


def outcome(future: Future[Any] | asyncio.Future[Any], index: int, return_exceptions: bool) -> Any:
    """A finished call's result, its RemoteError with `return_exceptions`, or its error
    raised, noting which input it was."""
    error = future.exception()
    if error is None:
        return future.result()
    if return_exceptions and isinstance(error, RemoteError):
        return error
    error.add_note(f"(input {index} of the map)")
    raise error
