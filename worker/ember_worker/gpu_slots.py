"""Which of this node's GPUs each replica holds.

The control plane places a replica on a node with enough free GPUs of its type; the node
picks which ones. A replica keeps its GPUs from its start until its process ends, and
sees only those (CUDA_VISIBLE_DEVICES). A replica restored from a snapshot prefers the
GPUs the snapshot was taken on; when it gets others, the CUDA driver moves its device
memory onto them (`remap_pairs`), which needs their UUIDs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # replicas import this module for its constant alone
    from ember_worker.resources import GpuDevice

VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"  # the GPUs CUDA shows a process
UUID_PREFIX = "GPU-"  # nvidia-smi's form of a whole GPU's UUID (MIG instances differ)


class NoFreeGpu(Exception):
    """Fewer GPUs of the type asked for are free on this node than the replica needs."""


class GpuMoveError(Exception):
    """A snapshot's GPU state cannot be put on the GPUs a restored replica got."""


class GpuSlots:
    def __init__(self, devices: Sequence[GpuDevice], fenced: Callable[[], set[int]] = set) -> None:
        self.devices = list(devices)
        self.fenced = fenced  # indices of GPUs whose health failed: never given out
        self._held: dict[str, list[GpuDevice]] = {}

    def take(
        self, owner: str, kind: str | None, count: int, prefer: Sequence[str] = ()
    ) -> list[GpuDevice]:
        """`count` free GPUs of `kind` for `owner`, those named in `prefer` (visible ids)
        first and in that order; what `owner` already holds if it holds any."""
        if owner in self._held:
            return self._held[owner]
        if kind is None or count <= 0:
            return []
        busy = {device for held in self._held.values() for device in held}
        fenced = self.fenced()
        free = [
            d for d in self.devices if d.kind == kind and d not in busy and d.index not in fenced
        ]
        by_id = {device.visible_id: device for device in free}
        preferred = [by_id[i] for i in dict.fromkeys(prefer) if i in by_id]
        chosen = (preferred + [d for d in free if d not in preferred])[:count]
        if len(chosen) < count:
            total = sum(1 for d in self.devices if d.kind == kind)
            raise NoFreeGpu(
                f"{count} x {kind} GPU wanted, {len(free)} of this node's {total} are free"
                + (f" ({len(fenced)} fenced for their health)" if fenced else "")
            )
        self._held[owner] = chosen
        return chosen

    def release(self, owner: str) -> None:
        self._held.pop(owner, None)

    def held(self, owner: str) -> list[GpuDevice]:
        return list(self._held.get(owner, []))

    def holders(self) -> dict[int, list[str]]:
        """The replicas holding each GPU, by its index."""
        by_index: dict[int, list[str]] = {}
        for owner, devices in self._held.items():
            for device in devices:
                by_index.setdefault(device.index, []).append(owner)
        return by_index


def visible_devices(devices: Sequence[GpuDevice]) -> str:
    """CUDA_VISIBLE_DEVICES for a replica holding `devices` ("" hides every GPU)."""
    return ",".join(device.visible_id for device in devices)


def remap_pairs(old: Sequence[str], new: Sequence[GpuDevice]) -> list[tuple[str, str]] | None:
    """(old UUID, new UUID) for every GPU a snapshot was taken on, when a restore gets
    other GPUs: [] when it gets the same ones, None when the move cannot be described
    (a count that differs, or a GPU known by its index alone)."""
    new_ids = [device.visible_id for device in new]
    if list(old) == new_ids:
        return []
    if len(old) != len(new_ids) or not all(i.startswith(UUID_PREFIX) for i in [*old, *new_ids]):
        return None
    return list(zip(old, new_ids, strict=True))


def restore_moves(
    image_gpus: Sequence[str],
    gpus: Sequence[GpuDevice],
    *,
    holds_gpu_state: bool,
    can_remap: bool,
) -> list[tuple[str, str]]:
    """The (old, new) UUIDs for the CUDA driver's restore of an image taken on
    `image_gpus` onto `gpus`; [] when nothing moves. An image without GPU state needs no
    move: CUDA starts after the restore, on the GPUs its environment then names."""
    if not holds_gpu_state:
        return []
    pairs = remap_pairs(image_gpus, gpus)
    if pairs is None:
        raise GpuMoveError(
            f"the image's GPU state is on {', '.join(image_gpus) or 'GPUs it did not record'}, "
            f"this replica got {visible_devices(gpus) or 'none'}, and only GPUs known by "
            "their UUIDs can be swapped"
        )
    if pairs and not can_remap:
        raise GpuMoveError(
            "the image's GPUs are busy, and moving its GPU state onto others needs "
            "cuda-bindings 13 and a CUDA 13 driver (580+)"
        )
    return pairs
