"""The async load loop: send requests on a schedule, time every event, collect records."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from ember.calling.client import error_from_response
from ember.errors import EmberError
from ember.loadgen.arrivals import poisson_gaps
from ember.loadgen.records import RequestRecord, is_success, tokens_in_event
from ember.wire.sse import parse_events

# Answers that mean every request will fail the same way: stop early rather than hammer.
# (405: a web app's path that takes no POST.)
FATAL_STATUSES = (401, 403, 404, 405)

# What an OpenAI-compatible server sends as its stream's last event: an end, not output.
STREAM_DONE = "[DONE]"


class FatalLoadError(EmberError):
    """The endpoint cannot be loaded at all (unknown, forbidden, unreachable)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status that said so; None when none came


@dataclass(frozen=True)
class LoadPlan:
    rate: float | None  # Poisson arrivals per second; None sends as fast as slots free up
    concurrency: int | None  # most requests in flight at once; None: no limit
    num_requests: int | None  # stop issuing after this many...
    duration: float | None  # ...or after this many seconds (whichever comes first)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.rate is None and self.concurrency is None:
            raise ValueError("a plan needs a rate or a concurrency")
        if self.num_requests is None and self.duration is None:
            raise ValueError("a plan needs a number of requests or a duration")


@dataclass
class LoadResult:
    records: list[RequestRecord]  # finished requests, in the order they were sent
    started_at: float
    interrupted: int = 0  # requests cancelled in flight by Ctrl+C
    first_errors: list[str] = field(default_factory=list)

    @property
    def finished_at(self) -> float:
        ends = [r.finished_at for r in self.records if r.finished_at is not None]
        return max(ends, default=self.started_at)


async def send_request(
    client: httpx.AsyncClient, url: str, arguments: dict[str, Any], record: RequestRecord
) -> None:
    """POST one request and fill in `record`; never raises for a failing request."""
    try:
        async with client.stream("POST", url, json=arguments) as response:
            record.status = response.status_code
            if not is_success(response.status_code):
                body = await response.aread()
                record.error = str(error_from_response(response.status_code, body))
            elif response.headers.get("content-type", "").startswith("text/event-stream"):
                record.streamed = True
                await _read_events(response, record)
            else:
                await response.aread()
                record.event_times.append(time.perf_counter())
                record.output_tokens = 1  # a whole answer is one "token": TTFT = E2E
    except Exception as exc:  # whatever failed this request is its error, not the run's
        record.error = describe_error(exc)
    record.finished_at = time.perf_counter()


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _read_events(response: httpx.Response, record: RequestRecord) -> None:
    frame: list[str] = []
    async for line in response.aiter_lines():
        if line:
            frame.append(line)
            continue
        # A blank line completes an event: that is when the caller could use it.
        arrived = time.perf_counter()
        for event in parse_events(frame):
            if event.event == "error":
                record.error = str(error_from_response(500, event.data.encode()))
            elif event.data.strip() != STREAM_DONE:
                record.event_times.append(arrived)
                record.output_tokens += tokens_in_event(event.data)
        frame = []


async def run_load(
    client: httpx.AsyncClient,
    url: str,
    arguments: Iterator[dict[str, Any]],
    plan: LoadPlan,
    interrupt: asyncio.Event,
    on_finished: Callable[[RequestRecord], None] = lambda record: None,
) -> LoadResult:
    """Drive load per `plan` until it is done or `interrupt` is set (then cancel in flight).

    Raises FatalLoadError if the first answers say no request can succeed.
    """
    started = time.perf_counter()
    result = LoadResult(records=[], started_at=started)
    slots = asyncio.Semaphore(plan.concurrency) if plan.concurrency else None
    stop_issuing = asyncio.Event()
    in_flight: dict[asyncio.Task[None], RequestRecord] = {}
    fatal: list[FatalLoadError] = []
    any_ok = False

    def finish(task: asyncio.Task[None]) -> None:
        nonlocal any_ok
        record = in_flight.pop(task)
        if slots is not None:
            slots.release()
        if task.cancelled():
            result.interrupted += 1
            return
        failure = task.exception()  # retrieved here, so asyncio never logs it unseen
        if failure is not None and record.error is None:
            record.error = describe_error(failure)
        result.records.append(record)
        any_ok = any_ok or record.ok
        if not record.ok and record.error and len(result.first_errors) < 5:
            result.first_errors.append(record.error)
        if not any_ok and not fatal and _is_fatal(record):
            reason = record.error or f"HTTP {record.status}"
            message = reason if record.status else f"cannot reach {url}: {reason}"
            fatal.append(FatalLoadError(message, record.status))
            stop_issuing.set()
            for other in in_flight:
                other.cancel()
        on_finished(record)

    loop = asyncio.get_running_loop()
    timer = loop.call_later(plan.duration, stop_issuing.set) if plan.duration else None
    watcher = asyncio.ensure_future(_cancel_on(interrupt, stop_issuing, in_flight))
    gaps = poisson_gaps(plan.rate, plan.seed) if plan.rate else None
    next_send = started
    try:
        for index in range(plan.num_requests or 1 << 62):
            if index and gaps is not None:
                next_send += next(gaps)
                await _wait(asyncio.sleep(max(0.0, next_send - time.perf_counter())), stop_issuing)
            if slots is not None and not await _wait(slots.acquire(), stop_issuing):
                break
            if stop_issuing.is_set():
                if slots is not None:
                    slots.release()
                break
            record = RequestRecord(index=index, sent_at=time.perf_counter())
            task = asyncio.ensure_future(send_request(client, url, next(arguments), record))
            in_flight[task] = record
            task.add_done_callback(finish)
        while in_flight:
            await asyncio.wait(list(in_flight))
            await asyncio.sleep(0)  # let done callbacks run
    finally:
        watcher.cancel()
        if timer is not None:
            timer.cancel()
    if fatal:
        raise fatal[0]
    result.records.sort(key=lambda record: record.index)
    return result


def _is_fatal(record: RequestRecord) -> bool:
    if record.status in FATAL_STATUSES:
        return True
    return record.status is None and bool(record.error) and "Connect" in (record.error or "")


async def _wait(awaitable: Any, stop: asyncio.Event) -> bool:
    """Await `awaitable` unless `stop` is set first; True if it completed."""
    work = asyncio.ensure_future(awaitable)
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if work in done:
        return True
    work.cancel()
    return False


async def _cancel_on(
    interrupt: asyncio.Event,
    stop_issuing: asyncio.Event,
    in_flight: dict[asyncio.Task[None], RequestRecord],
) -> None:
    await interrupt.wait()
    stop_issuing.set()
    for task in list(in_flight):
        task.cancel()
