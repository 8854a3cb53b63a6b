"""Who a cold replica's process is until it serves (launch.run_as): a table of every
case, the snapshot phase's uid 0 only where CRIU could not dump the workspace's uid."""

from __future__ import annotations

import pytest

from ember_worker.agent.replicas.launch import RunAs, run_as
from ember_worker.processes.replica_users import ReplicaUser

USER = ReplicaUser(201_000, 201_000)


@pytest.mark.parametrize(
    ("user", "taking", "sandboxed", "dumps_other_uids", "expected"),
    [
        # A worker that is not root: its replicas run as it, whatever else holds.
        (None, True, False, False, RunAs(None, False, False)),
        (None, False, True, True, RunAs(None, False, False)),
        # No snapshot to take: the workspace's user from the first instruction.
        (USER, False, True, False, RunAs(USER, False, False)),
        (USER, False, False, False, RunAs(USER, False, False)),
        # CRIU dumps other uids and the replica is sandboxed: its user throughout.
        (USER, True, True, True, RunAs(USER, False, False)),
        # CRIU lacks CAP_SYS_RESOURCE: uid 0 without capabilities in its sandbox.
        (USER, True, True, False, RunAs(USER, True, True)),
        # Outside a sandbox CRIU dumps uid 0 only: root, giving up root itself after.
        (USER, True, False, True, RunAs(None, False, True)),
        (USER, True, False, False, RunAs(None, False, True)),
    ],
)
def test_who_a_cold_replica_runs_as(
    user: ReplicaUser | None, taking: bool, sandboxed: bool, dumps_other_uids: bool, expected: RunAs
) -> None:
    got = run_as(user, taking=taking, sandboxed=sandboxed, dumps_other_uids=dumps_other_uids)
    assert got == expected
