"""Spare network namespaces (networks/namespaces.py): made ahead for a workspace,
taken by its next replica's start, never handed to another workspace's, made again once
stale, and at most MAX_SPARES kept. Real namespaces and pasta (root)."""

from __future__ import annotations

import os

import pytest
from machine_needs import need

from ember_worker.networks import namespaces as networks
from ember_worker.networks.namespaces import ReplicaNetworks

FIRST = 200_000  # the replica uids these tests' networks belong to


@pytest.fixture
def made() -> ReplicaNetworks:
    if os.geteuid() != 0:
        need("root", "network namespaces of the network uids are made by root")
    if problem := ReplicaNetworks.missing():
        need("pasta", problem)
    return ReplicaNetworks(FIRST, ())


def _namespace(network: networks.HeldNetwork) -> int:
    return os.fstat(network.fd).st_ino


def test_the_next_start_of_a_workspace_takes_its_spare_and_no_other_does(
    made: ReplicaNetworks,
) -> None:
    made.make_spare(FIRST + 1, now=0.0)
    spare = made._spares[made.uids.for_replica(FIRST + 1, FIRST)][1]
    other = made.take(FIRST + 2, now=1.0)  # another workspace: a new one
    taken = made.take(FIRST + 1, now=1.0)
    again = made.take(FIRST + 1, now=2.0)  # none left: a new one
    try:
        assert taken is spare and _namespace(other) != _namespace(spare)
        assert again is not spare and not made._spares
    finally:
        for network in (other, taken, again):
            network.close()


def test_a_stale_spare_is_made_again_and_the_oldest_go_past_the_bound(
    made: ReplicaNetworks, monkeypatch: pytest.MonkeyPatch
) -> None:
    made.make_spare(FIRST + 1, now=0.0)
    stale = made._spares[made.uids.for_replica(FIRST + 1, FIRST)][1]
    fresh = made.take(FIRST + 1, now=networks.SPARE_SECONDS + 1)
    try:
        assert fresh is not stale and stale.closed and stale.holder.poll() is not None
    finally:
        fresh.close()
    monkeypatch.setattr(networks, "MAX_SPARES", 2)
    for offset in (1, 2, 3):
        made.make_spare(FIRST + offset, now=float(offset))
    kept = sorted(made._spares)
    try:
        assert kept == [made.uids.for_replica(FIRST + o, FIRST) for o in (2, 3)]
    finally:
        for _, network in made._spares.values():
            network.close()
