"""Which GPUs a replica holds, and how a restore moves a snapshot's GPU state."""

from __future__ import annotations

import pytest

from ember_worker.gpu_slots import (
    GpuMoveError,
    GpuSlots,
    NoFreeGpu,
    remap_pairs,
    restore_moves,
    visible_devices,
)
from ember_worker.resources import GpuDevice

A = "GPU-11111111-1111-1111-1111-111111111111"
B = "GPU-22222222-2222-2222-2222-222222222222"
C = "GPU-33333333-3333-3333-3333-333333333333"


def detected() -> list[GpuDevice]:
    return [GpuDevice("H100", 0, A), GpuDevice("H100", 1, B), GpuDevice("L4", 2, C)]


def test_replicas_get_distinct_gpus_of_their_type() -> None:
    slots = GpuSlots(detected())
    first = slots.take("r1", "H100", 1)
    second = slots.take("r2", "H100", 1)
    assert [d.uuid for d in first + second] == [A, B]
    assert slots.take("r3", "L4", 1) == [GpuDevice("L4", 2, C)]
    with pytest.raises(NoFreeGpu, match="1 x H100 GPU wanted, 0 of this node's 2 are free"):
        slots.take("r4", "H100", 1)


def test_released_gpus_are_taken_again() -> None:
    slots = GpuSlots(detected())
    slots.take("r1", "H100", 2)
    slots.release("r1")
    slots.release("never-held")  # harmless
    assert len(slots.take("r2", "H100", 2)) == 2


def test_taking_again_returns_what_the_replica_holds() -> None:
    slots = GpuSlots(detected())
    held = slots.take("r1", "H100", 1, prefer=[B])
    assert slots.take("r1", "H100", 1) == held == slots.held("r1")


def test_preferred_gpus_come_first_when_free() -> None:
    slots = GpuSlots(detected())
    assert [d.uuid for d in slots.take("r1", "H100", 2, prefer=[B, A])] == [B, A]
    slots.release("r1")
    slots.take("other", "H100", 1, prefer=[B])
    assert [d.uuid for d in slots.take("r2", "H100", 1, prefer=[B])] == [A]


def test_a_replica_without_gpus_holds_none() -> None:
    slots = GpuSlots(detected())
    assert slots.take("cpu", None, 0) == []
    assert slots.held("cpu") == []
    assert visible_devices([]) == ""


def test_visible_ids_are_uuids_when_known_else_indexes() -> None:
    assert visible_devices(detected()[:2]) == f"{A},{B}"
    assert visible_devices([GpuDevice("H100", 0), GpuDevice("H100", 1)]) == "0,1"


def test_remap_pairs() -> None:
    h100 = detected()[:2]
    assert remap_pairs([A, B], h100) == []
    assert remap_pairs([B, A], h100) == [(B, A), (A, B)]
    assert remap_pairs([A], h100) is None  # counts differ
    assert remap_pairs(["0"], [GpuDevice("H100", 1)]) is None  # indexes alone


def test_restore_moves() -> None:
    on_b = [detected()[1]]
    assert restore_moves([A], on_b, holds_gpu_state=False, can_remap=False) == []
    assert restore_moves([B], on_b, holds_gpu_state=True, can_remap=False) == []
    assert restore_moves([A], on_b, holds_gpu_state=True, can_remap=True) == [(A, B)]
    with pytest.raises(GpuMoveError, match="cuda-bindings 13"):
        restore_moves([A], on_b, holds_gpu_state=True, can_remap=False)
    with pytest.raises(GpuMoveError, match="known by their UUIDs"):
        restore_moves(["0"], [GpuDevice("H100", 1)], holds_gpu_state=True, can_remap=True)
