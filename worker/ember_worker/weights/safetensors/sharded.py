"""Shard files tied together by a `model.safetensors.index.json`, each opened when first
needed."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

from ember.errors import WeightsFormatError
from ember_worker.weights.safetensors.header import ShardIndex, TensorInfo, parse_index
from ember_worker.weights.safetensors.safetensors_file import (
    SafetensorsFile,
    _quoted,
    _sorted_infos,
    _unknown_tensor,
)

# Each shard header is one network round trip; a few at once hides most of the latency.
_SHARD_HEADER_THREADS = 8


class ShardedCheckpoint:
    """Shard files tied together by a `model.safetensors.index.json`; each shard is opened
    (its header read and checked against the index) once, when first needed."""

    def __init__(
        self,
        url: str,
        index: ShardIndex | bytes | str,
        open_shard: Callable[[str], SafetensorsFile],
    ) -> None:
        self.url = url
        self.index = index if isinstance(index, ShardIndex) else parse_index(url, index)
        self._open_shard = open_shard
        self._names_by_shard: dict[str, list[str]] = {name: [] for name in self.index.shard_files}
        for tensor, file_name in self.index.weight_map.items():
            self._names_by_shard[file_name].append(tensor)
        self._lock = threading.Lock()
        self._opening: dict[str, threading.Lock] = {}
        self._files: dict[str, SafetensorsFile] = {}
        self._parts: list[tuple[SafetensorsFile, list[TensorInfo]]] | None = None

    @property
    def metadata(self) -> dict[str, str]:
        return self.index.metadata

    def __contains__(self, name: object) -> bool:
        return name in self.index.weight_map

    def __len__(self) -> int:
        return len(self.index.weight_map)

    def __repr__(self) -> str:
        return (
            f"ShardedCheckpoint({self.url!r}, {len(self)} tensors "
            f"in {len(self._names_by_shard)} shards)"
        )

    def shard(self, file_name: str) -> SafetensorsFile:
        """The shard `file_name`, opened on first use and checked against the index."""
        opened = self._files.get(file_name)
        if opened is not None:
            return opened
        if file_name not in self._names_by_shard:
            raise KeyError(f"{self.url} names no shard {file_name!r}")
        with self._lock:
            opening = self._opening.setdefault(file_name, threading.Lock())
        # One lock per shard: threads opening different shards do not wait for each other.
        with opening:
            opened = self._files.get(file_name)
            if opened is None:
                opened = self._open_shard(file_name)
                self._check_shard(opened, self._names_by_shard[file_name])
                self._files[file_name] = opened
        return opened

    def file_of(self, name: str) -> SafetensorsFile:
        try:
            file_name = self.index.weight_map[name]
        except KeyError:
            raise _unknown_tensor(self.url, name, self.index.weight_map) from None
        return self.shard(file_name)

    def parts(self) -> list[tuple[SafetensorsFile, list[TensorInfo]]]:
        """Every shard (headers opened in parallel) with the index's tensors in it, in file
        order, shard by shard."""
        if self._parts is None:
            self._open_all(self.index.shard_files)
            self._parts = [
                (self._files[name], _sorted_infos(self._files[name], self._names_by_shard[name]))
                for name in self.index.shard_files
            ]
        return self._parts

    def plan(self, names: list[str]) -> list[tuple[SafetensorsFile, list[TensorInfo]]]:
        """The shards holding `names`, each with its share of them in file order."""
        wanted: dict[str, list[str]] = {}
        for name in names:
            if name not in self.index.weight_map:
                raise _unknown_tensor(self.url, name, self.index.weight_map)
            wanted.setdefault(self.index.weight_map[name], []).append(name)
        shard_order = [file_name for file_name in self.index.shard_files if file_name in wanted]
        self._open_all(shard_order)
        return [
            (self._files[file_name], _sorted_infos(self._files[file_name], wanted[file_name]))
            for file_name in shard_order
        ]

    def opened_files(self) -> list[SafetensorsFile]:
        return list(self._files.values())

    def _open_all(self, file_names: list[str]) -> None:
        pending = [name for name in file_names if name not in self._files]
        if len(pending) <= 1:
            for file_name in pending:
                self.shard(file_name)
            return
        workers = min(_SHARD_HEADER_THREADS, len(pending))
        with concurrent.futures.ThreadPoolExecutor(workers, "ember-shard-header") as pool:
            for _ in pool.map(self.shard, pending):
                pass

    def _check_shard(self, file: SafetensorsFile, names: list[str]) -> None:
        missing = [name for name in names if name not in file]
        if missing:
            raise WeightsFormatError(
                file.url,
                f"the index {self.url} puts {_quoted(missing)} in this shard, "
                "but the shard has no such tensor",
            )
