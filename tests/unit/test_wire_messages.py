"""The wire messages: each kind round-trips, the framing batches and splits, and what does not
fit its kind (a hostile replica's header, an agent of another release) is a WireError."""

from __future__ import annotations

import json
import math

import pytest

from ember.wire import messages as wire


def test_a_replica_message_round_trips_with_its_body() -> None:
    text = wire.frame(wire.Result(id="in-1", media_type="image/png"), b'"aGk="')
    assert text == '{"type":"result","id":"in-1","media_type":"image/png"}\n"aGk="'
    header, body = wire.from_replica(text)
    assert header == wire.Result(id="in-1", media_type="image/png")
    assert body == '"aGk="'


def test_defaults_are_left_out_and_come_back() -> None:
    text = wire.frame(wire.Input(id="in-2", method="predict"), '{"x": 1}')
    assert json.loads(text.partition("\n")[0]) == {
        "type": "input",
        "id": "in-2",
        "method": "predict",
    }
    header, body = wire.to_replica(text)
    assert isinstance(header, wire.Input)
    assert (header.stream, header.affinity, header.trace) == (False, None, None)
    assert json.loads(body) == {"x": 1}


def test_batched_records_split_whole() -> None:
    sent = [wire.frame(wire.Event(id="a"), '"x\\u001e"'), wire.frame(wire.End(id="a"))]
    parts = wire.records(wire.RECORD_SEPARATOR.join(sent))
    assert [wire.from_replica(p)[0] for p in parts] == [wire.Event(id="a"), wire.End(id="a")]


def test_agent_messages_round_trip() -> None:
    start = wire.StartReplica(
        replica_id="r-1",
        token="t",
        app="shop",
        endpoint="predict",
        label="shop--predict",
        version=3,
        bundle_digest="sha256-x",
        entry="app.py",
        attribute="predict",
        concurrency=4,
        env={"A": "1"},
        snapshot=wire.SnapshotPlan(action="restore", key="k", image_id="i"),
    )
    assert wire.to_agent(wire.encode(start)) == start
    beat = wire.AgentHeartbeat(replica_memory={"r-1": 1 << 20})
    assert wire.from_agent(wire.encode(beat)) == beat
    assert wire.from_agent('{"type": "leaving"}') == wire.Leaving()


def test_the_same_kind_names_different_messages_on_each_channel() -> None:
    assert isinstance(wire.from_agent('{"type": "heartbeat"}'), wire.AgentHeartbeat)
    header, _ = wire.from_replica('{"type": "heartbeat", "weights": {"chunks": 2}}')
    assert header == wire.ReplicaHeartbeat(weights={"chunks": 2})


@pytest.mark.parametrize(
    "header",
    [
        "not json",
        "[]",
        '{"id": "a"}',  # no kind
        '{"type": "start_replica"}',  # a kind of the other direction
        '{"type": "result"}',  # its id missing
        '{"type": "result", "id": 7}',  # of the wrong type
        '{"type": "error", "id": "a", "status": "500", "error_type": "E", "message": ""}',
        '{"type": "event", "id": "a", "media_type": ["image/png"]}',
    ],
)
def test_what_does_not_fit_its_kind_is_a_wire_error(header: str) -> None:
    with pytest.raises(wire.WireError):
        wire.from_replica(header + "\nbody")


def test_an_agent_message_that_does_not_fit_is_a_wire_error() -> None:
    with pytest.raises(wire.WireError, match="replica_id"):
        wire.from_agent('{"type": "replica_exited"}')
    with pytest.raises(wire.WireError):
        wire.from_agent('{"type": "hello", "name": "n", "cpu": "many", "memory": 1}')


def test_unknown_fields_are_ignored_for_agents_of_a_later_release() -> None:
    assert wire.from_agent('{"type": "leaving", "why": "upgrade"}') == wire.Leaving()


def test_every_kind_is_unique_on_its_channel_direction() -> None:
    for union in (wire.ToReplica, wire.FromReplica, wire.ToAgent, wire.FromAgent):
        names = list(wire.kinds(union))
        assert len(names) == len(set(names)), names


def test_commands_as_the_control_plane_writes_them_today_decode() -> None:
    """Its dicts, through json.dumps: explicit nulls, a take without an image id."""
    start = {
        "snapshot": {"action": "take", "key": "k"},
        "snapshot_note": None,
        "type": "start_replica",
        "replica_id": "r-1",
        "token": "t",
        "call_token": "c",
        "app": "shop",
        "endpoint": "predict",
        "label": "shop--predict",
        "version": 2,
        "bundle_digest": "sha256-x",
        "entry": "app.py",
        "attribute": "predict",
        "concurrency": 1,
        "memory": 512,
        "memory_limit": None,
        "cpu_limit": 2,
        "requirements": [],
        "env": {},
        "gpu_type": None,
        "gpu_count": 0,
    }
    command = wire.to_agent(json.dumps(start))
    assert isinstance(command, wire.StartReplica)
    assert command.snapshot == wire.SnapshotPlan(action="take", key="k", image_id="")
    assert (command.memory, command.cpu_limit, command.call_token) == (512, 2.0, "c")
    exec_ = {"type": "exec", "exec_id": "x", "replica_id": "r", "command": ["ls"]}
    exec_ |= {"timeout": None, "interactive": True, "terminal": [24, 80]}
    assert wire.to_agent(json.dumps(exec_)) == wire.Exec(
        exec_id="x", replica_id="r", command=["ls"], interactive=True, terminal=(24, 80)
    )
    with pytest.raises(wire.WireError):
        wire.to_agent(json.dumps({**exec_, "terminal": [24]}))
    stop = wire.to_agent(json.dumps({"type": "stop_replica", "replica_id": "r", "grace": 30.0}))
    assert stop == wire.StopReplica(replica_id="r")


def test_a_lazy_restores_seconds_are_always_sent() -> None:
    """The control plane reads them without a default."""
    text = wire.encode(wire.ReplicaMemoryIn(replica_id="r", seconds=0.0))
    assert json.loads(text) == {"type": "replica_memory_in", "replica_id": "r", "seconds": 0.0}


def test_what_only_pythons_json_writes_still_passes() -> None:
    """A lone surrogate (undecodable bytes in a str) is escaped as json escapes it, and
    read back, from either; NaN, which json writes, is read where a number may be."""
    error = wire.Error(id="i", error_type="OSError", message="no file \udcff here")
    text = wire.frame(error, "null")
    assert "\\udcff" in text.partition("\n")[0]
    assert wire.from_replica(text) == (error, "null")
    assert wire.from_replica(json.dumps(wire.to_builtins(error))) == (error, "")
    stop = wire.to_agent('{"type": "stop_replica", "replica_id": "r", "grace": NaN}')
    assert isinstance(stop, wire.StopReplica) and math.isnan(stop.grace)
    with pytest.raises(wire.WireError):  # read as json reads it, and still checked
        wire.to_agent('{"type": "stop_replica", "replica_id": "\\udcff", "grace": "soon"}')


def test_status_pipe_reports_are_typed_and_checked() -> None:
    quiet = wire.Quiet(boot_seconds=1.5, weights=[wire.ReadWeights(url="s3://b/k", tag="v1")])
    assert wire.from_status_pipe(wire.status_line(quiet)) == quiet
    checked = wire.WeightsChecked(changed=[wire.ChangedWeights(url="u", was="1", now="2")])
    assert wire.from_status_pipe(wire.status_line(checked)) == checked
    for hostile in (
        b"not json\n",
        b'{"type": "quiet"}\n',
        b'{"type": "quiet", "boot_seconds": -1}\n',
    ):
        with pytest.raises(wire.WireError):
            wire.from_status_pipe(hostile)


def test_a_start_report_names_its_phases() -> None:
    report = wire.StartReport(kind="restore", fetch_seconds=0.1, restore_seconds=0.2)
    assert report.phases() == {"fetch": 0.1, "restore": 0.2}
    ready = wire.frame(wire.Ready(start=report))
    header, _ = wire.from_replica(ready)
    assert isinstance(header, wire.Ready) and header.start == report
    with pytest.raises(wire.WireError):
        wire.from_replica('{"type": "ready", "start": {"kind": "warm"}}\n')
