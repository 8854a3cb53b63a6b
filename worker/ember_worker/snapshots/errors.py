"""What every snapshot step fails with (`SnapshotError`), and a blocking CUDA checkpoint
step run so that its failure is one too."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from ember_worker.snapshots.cuda_checkpoint import CudaCheckpointError

T = TypeVar("T")


class SnapshotError(Exception):
    """A dump, restore, upload or download failed; the message carries CRIU's own lines.
    `held_killed`: CRIU hung holding processes (a dump's replica), which were killed."""

    def __init__(self, message: str, held_killed: bool = False) -> None:
        super().__init__(message)
        self.held_killed = held_killed


async def gpu_step(func: Callable[..., T], *args: Any) -> T:
    """A blocking CUDA checkpoint step, in a thread; its failure as a SnapshotError."""
    try:
        return await asyncio.to_thread(func, *args)
    except CudaCheckpointError as exc:
        raise SnapshotError(f"GPU checkpoint: {exc}") from None
