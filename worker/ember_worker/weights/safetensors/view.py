"""Lazy views of safetensors weights: headers read at open, each tensor fetched by byte range
only when asked for, bulk loads streamed in file order with the next ranges already in flight.

`SafetensorsFile` is one object; `ShardedCheckpoint` is several tied together by an index;
`WeightsView` is what users get for either (`self.weights["model"]`, `ember.weights.open`).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol, TypeVar, overload

from ember.errors import WeightsFormatError
from ember_worker.weights.safetensors.header import ShardIndex, TensorInfo
from ember_worker.weights.safetensors.progress import ProgressCallback, _Progress
from ember_worker.weights.safetensors.safetensors_file import (
    _NAMES_SHOWN,
    SafetensorsFile,
    _close,
    _quoted,
    _sorted_infos,
)
from ember_worker.weights.safetensors.sharded import ShardedCheckpoint

if TYPE_CHECKING:
    import torch
    from torch import nn

_T = TypeVar("_T")


class WeightsView(Mapping[str, "torch.Tensor"]):
    """Weights from one safetensors file or a sharded checkpoint, as a read-only mapping of
    tensor names to tensors. Nothing but headers is read until a tensor is asked for."""

    def __init__(self, weights: SafetensorsFile | ShardedCheckpoint) -> None:
        self._layout: _Layout = (
            _SingleFile(weights) if isinstance(weights, SafetensorsFile) else weights
        )

    @classmethod
    def sharded(
        cls,
        url: str,
        index: ShardIndex | bytes | str,
        open_shard: Callable[[str], SafetensorsFile],
    ) -> WeightsView:
        """A view of the checkpoint whose index (parsed, or its raw JSON) was read at `url`;
        `open_shard(file_name)` opens a shard named by the index."""
        return cls(ShardedCheckpoint(url, index, open_shard))

    @property
    def url(self) -> str:
        return self._layout.url

    @property
    def metadata(self) -> dict[str, str]:
        """The file's `__metadata__`, or the index's "metadata" (non-strings JSON-encoded)."""
        return self._layout.metadata

    @property
    def dtypes(self) -> dict[str, str]:
        return {info.name: info.dtype for info in self._infos()}

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {info.name: info.shape for info in self._infos()}

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data, all tensors together."""
        return sum(info.nbytes for info in self._infos())

    def __iter__(self) -> Iterator[str]:
        return (info.name for info in self._infos())

    def __len__(self) -> int:
        return len(self._layout)

    def __contains__(self, name: object) -> bool:
        # Mapping's default would fetch the tensor to find out.
        return isinstance(name, str) and name in self._layout

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._layout.file_of(name).get(name)

    # A view is equal only to itself: comparing contents would read every tensor.
    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"WeightsView({self.url!r}, {len(self)} tensors)"

    @overload
    def get(
        self,
        name: str,
        /,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor | None: ...

    @overload
    def get(
        self,
        name: str,
        default: torch.Tensor | _T,
        /,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor | _T: ...

    def get(
        self,
        name: str,
        default: object = None,
        /,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> object:
        """Tensor `name` (on `device`, as `dtype`), reading only its bytes; `default` when
        there is no such tensor, like any mapping (`view[name]` raises KeyError instead)."""
        if name not in self:
            return default
        return self._layout.file_of(name).get(name, device=device, dtype=dtype)

    def state_dict(
        self,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        names: Iterable[str] | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> dict[str, torch.Tensor]:
        """Tensors `names` (default: all), streamed in file order, shard by shard.

        Through the node's disk cache the tensors are private, writable mappings of its
        files (no copy; written pages become the process's own). A snapshot leaves the
        unwritten pages out of its image and a restore maps the files again, so restores
        need the files on their node; `load_into` copies the weights into the image."""
        return dict(self._stream(names, device, dtype, on_progress))

    def load_into(
        self,
        module: nn.Module,
        *,
        strict: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> list[str]:
        """Copy each tensor into `module`'s parameter or buffer of the same name, streaming,
        so about one tensor is held at a time; return the names loaded, in file order.

        Each tensor is converted to its parameter's dtype and device before the copy, or to
        `dtype`/`device` when given (e.g. `device="cuda"` to convert on the GPU); parameters
        keep their own dtype and device. All names and shapes are checked against the headers
        before anything is copied: with `strict`, names missing on either side are an error;
        shape mismatches always are. A tied parameter is loaded through whichever of its
        names the weights hold.
        """
        import torch

        targets = {
            name: value
            for name, value in module.state_dict(keep_vars=True).items()
            if isinstance(value, torch.Tensor)
        }
        shapes = self.shapes
        present = [name for name in shapes if name in targets]
        loaded_tensors = {id(targets[name]) for name in present}
        missing = [
            name
            for name, target in targets.items()
            if name not in shapes and id(target) not in loaded_tensors
        ]
        unexpected = [name for name in shapes if name not in targets]
        mismatched = [name for name in present if tuple(targets[name].shape) != shapes[name]]
        problems = []
        if strict and missing:
            problems.append(f"missing from the weights: {_quoted(missing)}")
        if strict and unexpected:
            problems.append(f"not in the module: {_quoted(unexpected)}")
        problems.extend(
            f"'{name}' is {list(shapes[name])} in the weights "
            f"but {list(targets[name].shape)} in the module"
            for name in mismatched[:_NAMES_SHOWN]
        )
        if len(mismatched) > _NAMES_SHOWN:
            problems.append(f"and {len(mismatched) - _NAMES_SHOWN} more shape mismatches")
        if problems:
            raise WeightsFormatError(
                self.url, f"the weights do not fit {type(module).__name__}: " + "; ".join(problems)
            )
        on_meta = [name for name in present if targets[name].is_meta]
        if on_meta:
            raise ValueError(
                f"{type(module).__name__} has {_quoted(on_meta)} on the meta device; "
                "give it memory first, e.g. module.to_empty(device=...)"
            )

        # Tensors read through the disk tier are private mappings of the node cache's files:
        # file pages, which CRIU does not copy into an image (it records the file instead).
        # Copying into the module's own memory is what puts weights loaded in
        # `enter(snap=True)` into the snapshot, so this copies even when a tensor is mapped.
        with torch.no_grad():
            for name, tensor in self._stream(present, None, None, on_progress):
                target = targets[name]
                converted = tensor.to(
                    device=target.device if device is None else device,
                    dtype=target.dtype if dtype is None else dtype,
                )
                target.data.copy_(converted)
                del tensor, converted  # peak memory: about the one tensor being copied
        return present

    def prefetch(self, background: bool = True) -> concurrent.futures.Future[None] | None:
        """Warm every file of the weights into the cache. Returns a future that completes
        when all is in, or waits for that and returns None when not `background`.
        Opens the shard headers (in parallel) first."""
        futures = [file.source.prefetch() for file, _ in self._layout.parts()]
        done = futures[0] if len(futures) == 1 else _all_of(futures)
        if background:
            return done
        done.result()
        return None

    def reset(self) -> None:
        """Reset every opened source, e.g. after a snapshot restore so connections reopen."""
        for file in self._layout.opened_files():
            file.source.reset()

    def _infos(self) -> list[TensorInfo]:
        return [info for _, infos in self._layout.parts() for info in infos]

    def _stream(
        self,
        names: Iterable[str] | None,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        on_progress: ProgressCallback | None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if isinstance(names, str):
            raise TypeError(f"names must be a collection of tensor names, not the string {names!r}")
        plan = (
            self._layout.parts() if names is None else self._layout.plan(list(dict.fromkeys(names)))
        )
        total = sum(info.nbytes for _, infos in plan for info in infos)
        count = sum(len(infos) for _, infos in plan)
        progress = _Progress(self.url, total, count, on_progress)
        try:
            for file, infos in plan:
                stream = file.iter_tensors(
                    [info.name for info in infos], device=device, dtype=dtype
                )
                try:
                    # Not zip: its reused result tuple would keep the last tensor alive.
                    for entry in stream:
                        progress.advance(file.info(entry[0]).nbytes)
                        yield entry
                        del entry  # hold no tensor while the next one is read
                finally:
                    _close(stream)  # cancels the file's ranges still in flight
        except BaseException:
            progress.close(finished=False)
            raise
        progress.close(finished=True)


class _Layout(Protocol):
    """What `WeightsView` needs of one file or a sharded checkpoint."""

    @property
    def url(self) -> str: ...

    @property
    def metadata(self) -> dict[str, str]: ...

    def __contains__(self, name: object) -> bool: ...

    def __len__(self) -> int: ...

    def file_of(self, name: str) -> SafetensorsFile: ...

    def parts(self) -> list[tuple[SafetensorsFile, list[TensorInfo]]]: ...

    def plan(self, names: list[str]) -> list[tuple[SafetensorsFile, list[TensorInfo]]]: ...

    def opened_files(self) -> list[SafetensorsFile]: ...


class _SingleFile:
    """One file, in the shape of a sharded checkpoint with a single shard."""

    def __init__(self, file: SafetensorsFile) -> None:
        self._file = file

    @property
    def url(self) -> str:
        return self._file.url

    @property
    def metadata(self) -> dict[str, str]:
        return self._file.metadata

    def __contains__(self, name: object) -> bool:
        return name in self._file

    def __len__(self) -> int:
        return len(self._file)

    def file_of(self, name: str) -> SafetensorsFile:
        self._file.info(name)  # KeyError naming known tensors
        return self._file

    def parts(self) -> list[tuple[SafetensorsFile, list[TensorInfo]]]:
        return [(self._file, list(self._file.header.tensors.values()))]

    def plan(self, names: list[str]) -> list[tuple[SafetensorsFile, list[TensorInfo]]]:
        return [(self._file, _sorted_infos(self._file, names))] if names else []

    def opened_files(self) -> list[SafetensorsFile]:
        return [self._file]


def _all_of(futures: list[concurrent.futures.Future[None]]) -> concurrent.futures.Future[None]:
    """A future done when all `futures` are, failing with the first of them to fail."""
    combined: concurrent.futures.Future[None] = concurrent.futures.Future()
    remaining = len(futures)
    lock = threading.Lock()

    def on_done(future: concurrent.futures.Future[None]) -> None:
        nonlocal remaining
        with lock:
            remaining -= 1
            if combined.done():
                return
            if future.cancelled():
                combined.set_exception(concurrent.futures.CancelledError())
            elif future.exception() is not None:
                combined.set_exception(future.exception())
            elif remaining == 0:
                combined.set_result(None)

    if not futures:
        combined.set_result(None)
    for future in futures:
        future.add_done_callback(on_done)
    return combined
