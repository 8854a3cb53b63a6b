"""Code that raises what is not an Exception still gets its caller an answer: an async
method that raises asyncio.CancelledError itself (it awaited a task that was cancelled),
and a BaseException of the code's own. Only a cancel the platform asked for is answered
`cancelled`; the control plane fails an input a replica cancelled by itself."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from cluster_harness import Env, error_of, outcome_of, run
from runtime_harness import runtime_for

from ember.wire import messages as wire


class Odd(BaseException):
    """Not an Exception: what `except Exception` lets through."""


async def awaits_the_cancelled(kind: str) -> dict:
    if kind == "cancelled":
        helper = asyncio.ensure_future(asyncio.sleep(10))
        helper.cancel()
        await helper  # raises CancelledError into this code, though no one cancelled it
    elif kind == "odd":
        raise Odd("odd things")
    elif kind == "sleep":
        await asyncio.sleep(10)
    elif kind == "sync-odd":
        await asyncio.get_running_loop().run_in_executor(None, _raise_odd)
    return {}


def _raise_odd() -> None:
    raise Odd("from a thread")


class Channel:
    def __init__(self) -> None:
        self.headers: list[wire.FromReplica] = []

    async def send(self, text: str) -> None:
        self.headers.append(wire.from_replica(text)[0])


async def answers(kind: str, cancel: bool = False) -> list[wire.FromReplica]:
    channel = Channel()
    runtime = runtime_for(awaits_the_cancelled, channel)
    runtime._dispatch(
        wire.frame(wire.Input(id="i-1", method="__call__"), json.dumps({"kind": kind}))
    )
    if cancel:
        await asyncio.sleep(0)
        runtime._dispatch(wire.frame(wire.Cancel(id="i-1")))
    while runtime.inputs.tasks or runtime.inputs.sending:
        await asyncio.sleep(0.01)
    runtime.executor.shutdown()
    return channel.headers


@pytest.mark.parametrize(
    ("kind", "error_type"),
    [("cancelled", "CancelledError"), ("odd", "Odd"), ("sync-odd", "Odd")],
)
def test_what_the_code_raised_is_its_error(kind: str, error_type: str) -> None:
    (answer,) = asyncio.run(answers(kind))
    assert isinstance(answer, wire.Error)
    assert (answer.status, answer.error_type) == (500, error_type)


def test_a_cancel_the_platform_asked_for_is_still_cancelled() -> None:
    assert asyncio.run(answers("sleep", cancel=True)) == [wire.Cancelled(id="i-1")]


def test_an_input_its_replica_cancelled_by_itself_fails(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy()
        inp = env.submit()
        (replica,) = env.start_ready()
        env.inputs_sent(replica)
        env.reply(replica, "cancelled", inp)
        outcome = outcome_of(inp)
        assert outcome.status == 500
        assert error_of(outcome)[0] == "CancelledError"
        assert inp.id not in replica.inflight

    run(tmp_path, scenario)
