"""Calls made by an input's code (its children) end when it ends; a stream of bytes is
kept as a file. Driven on a real `Cluster` (the harness of test_cluster)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from cluster_harness import Env, error_of, outcome_of, run

from ember_platform.runtime.inputs import CHUNK, EVENT


def test_an_input_that_ends_cancels_the_calls_its_code_is_waiting_on(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, concurrency=8)
        parent = env.submit()
        done_child = env.submit(parent_id=parent.id)
        waiting_child = env.submit(parent_id=parent.id)
        spawned = env.submit(parent_id=parent.id, is_async=True)
        stranger = env.submit(parent_id="c-not-live")
        (replica,) = env.start_ready()
        env.inputs_sent(replica)
        env.reply(replica, "result", done_child, b"1")
        assert env.cluster.state.children == {parent.id: {waiting_child}}
        env.cluster.input_lifecycle.cancel(parent, "the caller left")
        assert outcome_of(waiting_child).status == 499
        assert error_of(outcome_of(waiting_child)) == (
            "cancelled",
            f"the call that made it, {parent.id}, has ended",
        )
        assert {h["id"] for h, _ in env.sent(replica) if h["type"] == "cancel"} == {
            parent.id,
            waiting_child.id,
        }
        assert not spawned.done and not stranger.done  # the code's to keep; no live parent
        assert env.cluster.state.children == {}

    run(tmp_path, scenario)


def test_a_stream_of_bytes_is_queued_as_chunks_and_kept_as_one_file(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, concurrency=2, streaming=True)
        live = env.submit()
        spawned = env.submit(is_async=True)
        (replica,) = env.start_ready()
        env.inputs_sent(replica)
        for inp in (live, spawned):
            # As the runtime sends them: every chunk says it is bytes; the first names them.
            first = {"media_type": "audio/wav", "filename": "a.wav"}
            env.reply(replica, "event", inp, base64.b64encode(b"RIFF"), **first)
            plain = {"media_type": "application/octet-stream"}
            env.reply(replica, "event", inp, base64.b64encode(b"\x00\x01"), **plain)
            env.reply(replica, "end", inp)
        assert live.queued_events()[:2] == [
            (CHUNK, b"RIFF"),
            (CHUNK, b"\x00\x01"),
        ]
        assert live.file == ("audio/wav", "a.wav")
        kept = outcome_of(spawned)
        assert (kept.body, kept.media_type, kept.filename) == (
            b"RIFF\x00\x01",
            "audio/wav",
            "a.wav",
        )
        record = env.cluster.calls.get(spawned.id)
        assert record is not None and record.media_type == "audio/wav"

    run(tmp_path, scenario)


def test_a_stream_of_json_events_is_unchanged(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1, streaming=True)
        spawned = env.submit(is_async=True)
        live = env.submit()
        (replica,) = env.start_ready()
        env.inputs_sent(replica)
        env.reply(replica, "event", spawned, b'{"n": 1}')
        env.reply(replica, "end", spawned)
        assert json.loads(outcome_of(spawned).body) == [{"n": 1}]
        assert outcome_of(spawned).media_type == "application/json"
        env.inputs_sent(replica)
        env.reply(replica, "event", live, b'{"n": 2}')
        assert live.queued_events() == [(EVENT, b'{"n": 2}')] and live.file is None

    run(tmp_path, scenario)


def test_a_parent_run_again_after_its_replica_was_lost_leaves_no_child_running(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=2, concurrency=1)
        parent = env.submit()
        (first,) = env.start_ready()
        assert env.inputs_sent(first) == [parent.id]
        child = env.submit(parent_id=parent.id)
        env.exited(first)  # the parent's replica died: the parent is requeued
        assert not parent.done and error_of(outcome_of(child)) == (
            "cancelled",
            f"the run of {parent.id} that made it has ended; it runs again",
        )
        assert env.cluster.state.children == {}

    run(tmp_path, scenario)
