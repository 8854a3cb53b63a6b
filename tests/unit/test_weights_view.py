"""Lazy safetensors views: headers, ranged tensor reads, streaming loads and sharded checkpoints,
checked against the safetensors package over an in-memory stand-in for the cache tier."""

from __future__ import annotations

import concurrent.futures
import io
import json
import logging
import random
import struct
import sys
import tracemalloc
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ember.errors import WeightsFormatError, WeightsUnavailableError
from ember_worker.weights.safetensors.header import (
    HEADER_PROBE,
    header_length,
    parse_header,
    parse_index,
)
from ember_worker.weights.safetensors.safetensors_file import SafetensorsFile
from ember_worker.weights.safetensors.sharded import ShardedCheckpoint
from ember_worker.weights.safetensors.view import WeightsView

URL = "mem://weights/model.safetensors"
INDEX_URL = "mem://weights/model.safetensors.index.json"


class MemorySource:
    """The cache tier's interface over bytes in memory, recording every range read."""

    def __init__(self, data: bytes, url: str = URL) -> None:
        self.url = url
        self.size = len(data)
        self._data = data
        self.reads: list[tuple[int, int]] = []
        self.range_calls: list[list[tuple[int, int]]] = []
        self.streams_closed = 0
        self.prefetched: list[tuple[int, int | None]] = []
        self.prefetch_error: Exception | None = None
        self.resets = 0

    def read(self, start: int, end: int) -> bytes:
        assert 0 <= start <= end <= self.size, (start, end)
        self.reads.append((start, end))
        return self._data[start:end]

    def peek(self, start: int, end: int) -> bytes:
        return self.read(start, end)

    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> Iterator[bytes]:
        self.range_calls.append(list(ranges))
        return self._stream(list(ranges))

    def _stream(self, ranges: list[tuple[int, int]]) -> Iterator[bytes]:
        try:
            for start, end in ranges:
                yield self.read(start, end)
        finally:
            self.streams_closed += 1

    def prefetch(self, start: int = 0, end: int | None = None) -> concurrent.futures.Future[None]:
        self.prefetched.append((start, end))
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        if self.prefetch_error is not None:
            future.set_exception(self.prefetch_error)
        else:
            future.set_result(None)
        return future

    def reset(self) -> None:
        self.resets += 1


def save(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> Path:
    save_file(tensors, str(path), metadata=metadata)
    return path


def open_file(path: Path, url: str = URL) -> tuple[WeightsView, MemorySource]:
    source = MemorySource(path.read_bytes(), url)
    return WeightsView(SafetensorsFile(source)), source


def raw_safetensors(header: object, data: bytes = b"") -> bytes:
    encoded = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(encoded)) + encoded + data


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (torch.equal lacks float8 kernels and NaN != NaN)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def same_dicts(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(same(a[name], b[name]) for name in a)


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(128, 256, generator=generator),  # 128 KiB: past the probe
        "proj.weight": torch.randn(16, 16, generator=generator).to(torch.bfloat16),
        "proj.bias": torch.randn(16, generator=generator).to(torch.float16),
        "steps": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
        "mask": torch.rand(5, generator=generator) > 0.5,
    }


# --- header ---------------------------------------------------------------------------------


def test_keys_dtypes_shapes_and_metadata_come_from_the_header_alone(
    tmp_path: Path, tensors: dict[str, torch.Tensor]
) -> None:
    path = save(tmp_path / "m.safetensors", tensors, metadata={"format": "pt", "step": "12"})
    view, source = open_file(path)

    assert set(view) == set(tensors)
    assert len(view) == len(tensors)
    assert "embed.weight" in view and "nope" not in view
    assert view.shapes == {name: tuple(t.shape) for name, t in tensors.items()}
    assert view.dtypes["proj.weight"] == "BF16"
    assert view.dtypes["mask"] == "BOOL"
    assert view.metadata == {"format": "pt", "step": "12"}
    assert view.nbytes == sum(t.nbytes for t in tensors.values())
    assert view.url == URL
    assert source.reads == [(0, HEADER_PROBE)]
    assert source.range_calls == []


def test_keys_are_in_file_order(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> None:
    view, _ = open_file(save(tmp_path / "m.safetensors", tensors))
    header = SafetensorsFile(MemorySource((tmp_path / "m.safetensors").read_bytes())).header
    starts = [header.tensors[name].start for name in view]
    assert starts == sorted(starts)


def test_a_header_longer_than_the_probe_takes_one_more_read(tmp_path: Path) -> None:
    many = {f"layers.{i}.{'x' * 200}.weight": torch.full((2,), float(i)) for i in range(400)}
    path = save(tmp_path / "m.safetensors", many)
    source = MemorySource(path.read_bytes())
    file = SafetensorsFile(source)

    assert file.header.data_start > HEADER_PROBE
    assert source.reads == [(0, HEADER_PROBE), (HEADER_PROBE, file.header.data_start)]
    assert set(file.keys()) == set(many)
    assert same(file.get("layers.399." + "x" * 200 + ".weight"), many[next(reversed(many))])


def test_a_small_file_is_read_whole_at_open(tmp_path: Path) -> None:
    path = save(tmp_path / "m.safetensors", {"w": torch.ones(3)})
    source = MemorySource(path.read_bytes())
    SafetensorsFile(source)
    assert source.reads == [(0, source.size)]


# --- tensors --------------------------------------------------------------------------------


def test_get_reads_exactly_the_tensors_range(
    tmp_path: Path, tensors: dict[str, torch.Tensor]
) -> None:
    path = save(tmp_path / "m.safetensors", tensors)
    file = SafetensorsFile(MemorySource(path.read_bytes()))
    view = WeightsView(file)
    source = file.source
    assert isinstance(source, MemorySource)
    source.reads.clear()

    weight = view["embed.weight"]

    info = file.info("embed.weight")
    assert source.reads == [(info.start, info.end)]
    assert same(weight, tensors["embed.weight"])
    weight.add_(1)  # writable, and its own memory
    assert same(view["embed.weight"], tensors["embed.weight"])


def test_get_converts_and_falls_back_like_a_mapping(
    tmp_path: Path, tensors: dict[str, torch.Tensor]
) -> None:
    view, _ = open_file(save(tmp_path / "m.safetensors", tensors))
    half = view.get("embed.weight", dtype=torch.float16, device="cpu")
    assert half is not None and same(half, tensors["embed.weight"].half())
    assert view.get("nope") is None
    assert view.get("nope", "fallback") == "fallback"


def test_empty_and_scalar_tensors(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> None:
    view, source = open_file(save(tmp_path / "m.safetensors", tensors))
    source.reads.clear()
    assert same(view["empty"], tensors["empty"])
    assert source.reads == []  # nothing to read
    assert same(view["steps"], tensors["steps"])


def test_an_unknown_name_lists_known_ones(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> None:
    view, _ = open_file(save(tmp_path / "m.safetensors", tensors))
    with pytest.raises(KeyError, match=r"did you mean 'embed.weight'") as caught:
        view["embed.weights"]
    assert URL in str(caught.value)
    with pytest.raises(KeyError, match=r"it has '.*' and 1 more"):
        view["zzz"]


def _sample(dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        return torch.rand(4, 5, generator=generator) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(4, 5, generator=generator) * 3).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(low, high, (4, 5), generator=generator).to(dtype)


_DTYPES = [
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
    "float8_e5m2",
    "complex64",
]


@pytest.mark.parametrize("dtype_name", _DTYPES)
def test_every_dtype_round_trips_like_load_file(tmp_path: Path, dtype_name: str) -> None:
    # The pinned torch and safetensors (the `test` extra) have every one of these dtypes.
    dtype = getattr(torch, dtype_name)
    sample = {"t": _sample(dtype), "scalar": _sample(dtype)[0, 0].clone()}
    path = save(tmp_path / "m.safetensors", sample)
    view, _ = open_file(path)
    expected = load_file(str(path))
    assert same(view["t"], expected["t"])
    assert same(view["scalar"], expected["scalar"])
    assert same_dicts(view.state_dict(), expected)


# --- streaming ------------------------------------------------------------------------------


def test_state_dict_equals_load_file_and_streams_in_file_order(
    tmp_path: Path, tensors: dict[str, torch.Tensor]
) -> None:
    path = save(tmp_path / "m.safetensors", tensors)
    view, source = open_file(path)
    expected = load_file(str(path))

    loaded = view.state_dict(device="cpu")

    assert same_dicts(loaded, expected)
    assert list(loaded) == list(view)
    assert len(source.range_calls) == 1  # one stream, later ranges in flight
    ranges = source.range_calls[0]
    assert ranges == sorted(ranges)
    assert len(ranges) == len(tensors) - 1  # the empty tensor needs no bytes


def test_state_dict_converts_dtype_and_picks_names(
    tmp_path: Path, tensors: dict[str, torch.Tensor]
) -> None:
    path = save(tmp_path / "m.safetensors", tensors)
    view, _ = open_file(path)
    expected = load_file(str(path))

    halves = view.state_dict(dtype=torch.float16, device="cpu")
    assert same_dicts(halves, {name: t.to(torch.float16) for name, t in expected.items()})

    some = view.state_dict(names=["proj.bias", "embed.weight", "proj.bias"])
    assert same_dicts(some, {name: expected[name] for name in ("embed.weight", "proj.bias")})
    with pytest.raises(KeyError, match="nope"):
        view.state_dict(names=["nope"])


def test_stopping_a_stream_early_closes_the_readers_stream(
    tmp_path: Path, tensors: dict[str, torch.Tensor]
) -> None:
    path = save(tmp_path / "m.safetensors", tensors)
    file = SafetensorsFile(MemorySource(path.read_bytes()))
    source = file.source
    assert isinstance(source, MemorySource)

    stream = file.iter_tensors()
    name, _ = next(stream)
    assert name == file.keys()[0]
    stream.close()  # type: ignore[attr-defined]

    assert source.streams_closed == 1
    with pytest.raises(KeyError):
        file.iter_tensors(["nope"])  # checked at the call, not at the first next()


def test_progress_reaches_the_total(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> None:
    view, _ = open_file(save(tmp_path / "m.safetensors", tensors))
    seen: list[tuple[int, int]] = []
    view.state_dict(on_progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (view.nbytes, view.nbytes)
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)


def test_progress_is_logged_when_stderr_is_no_terminal(
    tmp_path: Path, tensors: dict[str, torch.Tensor], caplog: pytest.LogCaptureFixture
) -> None:
    view, _ = open_file(save(tmp_path / "m.safetensors", tensors))
    with caplog.at_level(logging.INFO, logger="ember.weights"):
        view.state_dict()
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2
    assert messages[0].startswith(f"reading {URL}")
    assert messages[1].startswith(f"read {URL}") and "MB/s" in messages[1]


def test_progress_is_a_bar_on_a_terminal(
    tmp_path: Path, tensors: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    view, _ = open_file(save(tmp_path / "m.safetensors", tensors))
    view.state_dict()
    assert "mem://weights/model" in terminal.getvalue()
    assert "100%" in terminal.getvalue()


# --- load_into ------------------------------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.ones(8))


def _trained() -> Tiny:
    torch.manual_seed(3)
    model = Tiny()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
        model.get_buffer("scale").fill_(0.5)
    return model


def _file_of(model: nn.Module, *, drop: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    return {
        name: t.detach().clone().contiguous()
        for name, t in model.state_dict().items()
        if name not in drop
    }


def test_load_into_fills_a_module_with_a_tied_weight(tmp_path: Path) -> None:
    source_model = _trained()
    path = save(tmp_path / "m.safetensors", _file_of(source_model, drop=["head.weight"]))
    view, _ = open_file(path)
    target = Tiny()

    loaded = view.load_into(target)

    assert sorted(loaded) == ["embed.weight", "proj.bias", "proj.weight", "scale"]
    assert loaded == list(view)
    assert same_dicts(target.state_dict(), source_model.state_dict())
    assert target.head.weight is target.embed.weight


def test_load_into_loads_both_names_of_a_tie_when_the_file_has_both(tmp_path: Path) -> None:
    source_model = _trained()
    view, _ = open_file(save(tmp_path / "m.safetensors", _file_of(source_model)))
    target = Tiny()
    assert set(view.load_into(target)) == set(source_model.state_dict())
    assert same_dicts(target.state_dict(), source_model.state_dict())


def test_load_into_converts_to_the_parameters_dtype(tmp_path: Path) -> None:
    source_model = _trained()
    path = save(tmp_path / "m.safetensors", _file_of(source_model, drop=["head.weight"]))
    view, _ = open_file(path)
    target = Tiny().double()
    progress: list[int] = []

    view.load_into(target, on_progress=lambda done, total: progress.append(done))

    assert target.proj.weight.dtype == torch.float64
    expected = {name: t.double() for name, t in source_model.state_dict().items()}
    assert same_dicts(target.state_dict(), expected)
    assert progress[-1] == view.nbytes

    # An explicit dtype is where the conversion goes through; the parameter keeps its own.
    view.load_into(target, dtype=torch.float16, device="cpu")
    assert target.proj.weight.dtype == torch.float64
    assert same(target.proj.weight, source_model.proj.weight.detach().half().double())


def test_load_into_holds_about_one_tensor_at_a_time(tmp_path: Path) -> None:
    layers = 8
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(layers)])  # 1 MiB each
    view, _ = open_file(save(tmp_path / "m.safetensors", _file_of(model)))
    target = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(layers)])

    tracemalloc.start()
    try:
        view.load_into(target, on_progress=lambda done, total: None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    # The source's bytes and the tensor's own copy of them, for one tensor: not all eight.
    assert peak < 3 * 1024 * 1024
    assert same_dicts(_file_of(target), _file_of(model))


def test_strict_mismatches_are_named_and_nothing_is_copied(tmp_path: Path) -> None:
    source_model = _trained()
    weights = _file_of(source_model, drop=["head.weight", "proj.bias"])
    weights["extra.weight"] = torch.ones(2)
    weights["scale"] = torch.ones(4)  # the module's is (8,)
    view, source = open_file(save(tmp_path / "m.safetensors", weights))
    target = Tiny()
    before = _file_of(target)
    source.reads.clear()

    with pytest.raises(WeightsFormatError) as caught:
        view.load_into(target)

    message = str(caught.value)
    assert caught.value.url == URL
    assert "missing from the weights: 'proj.bias'" in message
    assert "not in the module: 'extra.weight'" in message
    assert "'scale' is [4] in the weights but [8] in the module" in message
    assert "head.weight" not in message  # tied to embed.weight, which the file has
    assert same_dicts(_file_of(target), before)
    assert source.reads == [] and source.range_calls == []


def test_non_strict_loads_what_matches_but_never_a_wrong_shape(tmp_path: Path) -> None:
    source_model = _trained()
    weights = _file_of(source_model, drop=["head.weight", "proj.bias"])
    weights["extra.weight"] = torch.ones(2)
    view, _ = open_file(save(tmp_path / "m.safetensors", weights))
    target = Tiny()
    bias_before = target.proj.bias.detach().clone()

    loaded = view.load_into(target, strict=False)

    assert "extra.weight" not in loaded and "proj.bias" not in loaded
    assert same(target.proj.weight, source_model.proj.weight.detach())
    assert same(target.proj.bias.detach(), bias_before)

    weights["scale"] = torch.ones(4)
    view, _ = open_file(save(tmp_path / "wrong.safetensors", weights))
    with pytest.raises(WeightsFormatError, match="'scale' is"):
        view.load_into(Tiny(), strict=False)


# --- sharded checkpoints --------------------------------------------------------------------


class Shards:
    """Shard files in tmp_path behind MemorySources, counting opens."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.opened: list[str] = []
        self.sources: dict[str, MemorySource] = {}

    def open(self, file_name: str) -> SafetensorsFile:
        self.opened.append(file_name)
        source = MemorySource((self.folder / file_name).read_bytes(), f"mem://weights/{file_name}")
        self.sources[file_name] = source
        return SafetensorsFile(source)


def _shard(
    folder: Path, tensors: dict[str, torch.Tensor], parts: int
) -> tuple[dict[str, Any], Shards]:
    names = list(tensors)
    weight_map: dict[str, str] = {}
    for number in range(parts):
        file_name = f"model-{number + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {name: tensors[name] for name in names[number::parts]}
        save(folder / file_name, chunk)
        weight_map.update(dict.fromkeys(chunk, file_name))
    total = sum(t.nbytes for t in tensors.values())
    return {"metadata": {"total_size": total}, "weight_map": weight_map}, Shards(folder)


def test_a_sharded_checkpoint_equals_the_unsharded_file(
    tmp_path: Path, tensors: dict[str, torch.Tensor]
) -> None:
    whole = save(tmp_path / "whole.safetensors", tensors)
    index, shards = _shard(tmp_path, tensors, parts=3)
    view = WeightsView.sharded(INDEX_URL, json.dumps(index).encode(), shards.open)

    assert "proj.bias" in view and len(view) == len(tensors)
    assert shards.opened == []  # the index answers these

    assert view.shapes == {name: tuple(t.shape) for name, t in tensors.items()}
    assert sorted(shards.opened) == sorted(set(index["weight_map"].values()))
    assert same_dicts(view.state_dict(), load_file(str(whole)))
    assert len(shards.opened) == 3  # each shard opened once
    assert view.metadata == {"total_size": str(view.nbytes)}
    assert view.url == INDEX_URL


def test_a_sharded_tensor_opens_only_its_shard(
    tmp_path: Path, tensors: dict[str, torch.Tensor]
) -> None:
    index, shards = _shard(tmp_path, tensors, parts=3)
    view = WeightsView(ShardedCheckpoint(INDEX_URL, json.dumps(index), shards.open))

    assert same(view["proj.weight"], tensors["proj.weight"])
    assert shards.opened == [index["weight_map"]["proj.weight"]]
    with pytest.raises(KeyError, match="did you mean"):
        view["proj.weights"]


def test_load_into_from_shards(tmp_path: Path) -> None:
    source_model = _trained()
    index, shards = _shard(tmp_path, _file_of(source_model, drop=["head.weight"]), parts=2)
    view = WeightsView.sharded(INDEX_URL, json.dumps(index), shards.open)
    target = Tiny()
    view.load_into(target)
    assert same_dicts(target.state_dict(), source_model.state_dict())


def test_prefetch_and_reset_reach_every_source(
    tmp_path: Path, tensors: dict[str, torch.Tensor]
) -> None:
    index, shards = _shard(tmp_path, tensors, parts=3)
    view = WeightsView.sharded(INDEX_URL, json.dumps(index), shards.open)

    future = view.prefetch()
    assert future is not None and future.result(timeout=5) is None
    assert all(source.prefetched == [(0, None)] for source in shards.sources.values())
    assert len(shards.sources) == 3

    view.reset()
    assert all(source.resets == 1 for source in shards.sources.values())

    next(iter(shards.sources.values())).prefetch_error = OSError("origin down")
    with pytest.raises(OSError, match="origin down"):
        view.prefetch(background=False)


def test_prefetch_of_one_file(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> None:
    view, source = open_file(save(tmp_path / "m.safetensors", tensors))
    assert view.prefetch(background=False) is None
    assert source.prefetched == [(0, None)]
    view.reset()
    assert source.resets == 1


def test_an_index_naming_a_tensor_its_shard_lacks(
    tmp_path: Path, tensors: dict[str, torch.Tensor]
) -> None:
    index, shards = _shard(tmp_path, tensors, parts=2)
    shard = index["weight_map"]["proj.bias"]
    index["weight_map"]["ghost.weight"] = shard
    view = WeightsView.sharded(INDEX_URL, json.dumps(index), shards.open)

    with pytest.raises(WeightsFormatError, match=r"'ghost\.weight'") as caught:
        view["proj.bias"]
    assert caught.value.url == f"mem://weights/{shard}"
    assert INDEX_URL in str(caught.value)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{nope", "not valid JSON"),
        (b"[]", "not an object"),
        (b'{"metadata": {}}', 'no "weight_map"'),
        (b'{"weight_map": {"w": 3}}', "not a shard file name"),
        (b'{"weight_map": {"w": "../secret.safetensors"}}', "outside the index's folder"),
        (b'{"weight_map": {"w": "/abs/x.safetensors"}}', "outside the index's folder"),
        (b'{"weight_map": {"w": "a.safetensors"}, "metadata": [1]}', '"metadata" is not'),
    ],
)
def test_bad_indexes(raw: bytes, reason: str) -> None:
    with pytest.raises(WeightsFormatError, match=reason) as caught:
        parse_index(INDEX_URL, raw)
    assert caught.value.url == INDEX_URL


# --- corrupt files --------------------------------------------------------------------------


def _f32(offsets: list[int], shape: list[int] | None = None) -> dict[str, Any]:
    return {"dtype": "F32", "shape": shape or [4], "data_offsets": offsets}


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (random.Random(0).randbytes(4096), "not a safetensors file"),
        (json.dumps({"weight_map": {"a": "b"}}).encode() * 4, "not a safetensors file"),
        (b"abc", "not a safetensors file \\(the object has only 3 bytes\\)"),
        (b"", "only 0 bytes"),
        (struct.pack("<Q", 0) + b"{}", "header length is 0"),
        (struct.pack("<Q", 1000) + b"{}", "says it is 1000 bytes long but the object has only 10"),
        (raw_safetensors(b"not json"), "not valid JSON"),
        (raw_safetensors(b"\xff\xfe{}"), "not UTF-8"),
        (raw_safetensors([1, 2]), "header is a JSON list"),
        (
            raw_safetensors({"w": _f32([0, 16])}, bytes(8)),
            r"'w' ends at byte \d+ but the object has only \d+ bytes",
        ),
        (
            raw_safetensors({"a": _f32([0, 16]), "b": _f32([8, 24])}, bytes(24)),
            "tensors 'a' and 'b' overlap",
        ),
        (raw_safetensors({"w": _f32([0, 12])}, bytes(12)), "12 bytes .* needs 16"),
        (raw_safetensors({"w": _f32([8, 0])}, bytes(8)), "not \\[begin, end\\]"),
        (
            raw_safetensors({"w": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}}, b"x"),
            "unknown dtype 'F7'",
        ),
        (raw_safetensors({"w": _f32([0, 16], [-4])}, bytes(16)), "not a list of non-negative"),
        (raw_safetensors({"w": _f32([0, 4], [True])}, bytes(4)), "not a list of non-negative"),
        (raw_safetensors({"w": [1]}), "entry for tensor 'w' is not an object"),
        (raw_safetensors({"__metadata__": {"a": 1}}), "__metadata__ is not an object of strings"),
        (
            raw_safetensors(
                b'{"w": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}, '
                b'"w": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}'
            ),
            "names 'w' twice",
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_corrupt_files_name_the_url_and_the_reason(data: bytes, reason: str) -> None:
    with pytest.raises(WeightsFormatError, match=reason) as caught:
        SafetensorsFile(MemorySource(data))
    assert caught.value.url == URL
    assert str(caught.value).startswith(URL)


def test_zero_byte_tensors_overlap_nothing() -> None:
    header = {
        "a": _f32([0, 16]),
        "none": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]},
        "b": _f32([16, 32]),
    }
    file = SafetensorsFile(MemorySource(raw_safetensors(header, bytes(32))))
    assert file.keys() == ["a", "none", "b"]
    assert file.get("none").shape == (0,)


def test_header_functions_directly() -> None:
    raw = json.dumps({"w": _f32([0, 16])}).encode()
    data = struct.pack("<Q", len(raw)) + raw + bytes(16)
    assert header_length(URL, data[:8], len(data)) == len(raw)
    header = parse_header(URL, raw, len(data))
    info = header.tensors["w"]
    assert (info.start, info.end, info.nbytes, info.shape) == (8 + len(raw), len(data), 16, (4,))
    assert header.data_start == 8 + len(raw) and header.metadata == {}


def test_a_short_read_from_the_source_is_an_error(tmp_path: Path) -> None:
    class Truncating(MemorySource):
        def read(self, start: int, end: int) -> bytes:
            return super().read(start, end)[: max(0, min(end - start, 64 * 1024) - 1)]

    data = save(tmp_path / "m.safetensors", {"w": torch.ones(4)}).read_bytes()
    with pytest.raises(WeightsUnavailableError, match="got"):
        SafetensorsFile(Truncating(data))
