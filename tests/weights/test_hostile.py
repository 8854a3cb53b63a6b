"""`ember.weights.open` under hostile or unusual input: each gives a clear error naming
the URL, or works as asked."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

import ember
from ember.errors import WeightsFormatError

from .conftest import Store
from .test_open import make_tensors, safetensors_bytes


def _raw_file(path: Path, header: dict, data: bytes = b"") -> str:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path.as_uri()


def test_a_budget_of_zero_keeps_nothing_on_disk(tmp_path: Path) -> None:
    import torch

    tensors = make_tensors()
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes(tensors, tmp_path, "source.safetensors"))
    cache = tmp_path / "cache"
    view = ember.weights.open(path.as_uri(), cache_dir=cache, cache_bytes=0)
    assert torch.equal(view["head.weight"], tensors["head.weight"])
    assert list(cache.rglob("*.data")) == []


@pytest.mark.parametrize("shape", [[0, 2**70], [0, 2**62, 4]])
def test_a_shape_too_large_for_any_tensor_is_a_format_error(
    tmp_path: Path, shape: list[int]
) -> None:
    url = _raw_file(
        tmp_path / "m.safetensors", {"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}
    )
    with pytest.raises(WeightsFormatError, match="too large") as caught:
        ember.weights.open(url, cache_dir=tmp_path / "cache").state_dict()
    assert url in str(caught.value)


@pytest.mark.parametrize("name", ["%2E%2E/x.safetensors", "..%2Fx.safetensors", "%2Fx.safetensors"])
def test_an_index_naming_an_encoded_way_out_of_its_folder_is_refused(
    tmp_path: Path, name: str
) -> None:
    tensors = {"a": make_tensors()["steps"]}
    (tmp_path / "x.safetensors").write_bytes(safetensors_bytes(tensors, tmp_path, "s.safetensors"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": name}}))
    with pytest.raises(WeightsFormatError, match="outside the index's folder"):
        ember.weights.open(folder.as_uri() + "/", cache_dir=tmp_path / "cache").state_dict()


def test_shard_names_are_file_names_not_url_text(store: Store, tmp_path: Path) -> None:
    import torch

    tensors = make_tensors()
    # '#', '%' and ' ' mean something in a URL; the index names files.
    names = {"embed.weight": "part #1 100%.safetensors", "steps": "sub dir/ü 2.safetensors"}
    for tensor, file_name in names.items():
        data = safetensors_bytes({tensor: tensors[tensor]}, tmp_path, "shard.safetensors")
        store.put(f"model/{file_name}", data)
    index = json.dumps({"weight_map": names}).encode()
    store.put("model/model.safetensors.index.json", index)
    folder = store.url("model/x")[: -len("x")]  # a file store's url() drops a final "/"
    view = ember.weights.open(folder, cache_dir=tmp_path / "cache")
    for tensor in names:
        assert torch.equal(view[tensor], tensors[tensor])


def test_a_cache_dir_given_as_a_string_is_used(tmp_path: Path) -> None:
    import torch

    tensors = make_tensors()
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes(tensors, tmp_path, "source.safetensors"))
    cache = tmp_path / "cache"
    view = ember.weights.open(path.as_uri(), cache_dir=str(cache))
    assert torch.equal(view["steps"], tensors["steps"])
    assert len(list(cache.rglob("*.data"))) == 1


def test_writing_a_tensor_in_place_never_changes_what_later_reads_return(
    file_store: Store, tmp_path: Path
) -> None:
    import torch

    tensors = make_tensors()
    url = file_store.put("model.safetensors", safetensors_bytes(tensors, tmp_path, "s.safetensors"))
    view = ember.weights.open(url, cache_dir=tmp_path / "cache", chunk_bytes=4096)
    view.prefetch(background=False)  # all on disk: reads are views of the mapped file
    first = view["head.weight"]
    first.mul_(7)  # a user's in-place scaling or quantizing
    state = view.state_dict()
    first.zero_()
    assert torch.equal(view["head.weight"], tensors["head.weight"])
    assert all(torch.equal(state[name], tensors[name]) for name in tensors)
    assert torch.equal(first, torch.zeros_like(first))  # the written tensor keeps its bytes


def test_bytes_copied_out_of_the_cache_are_the_objects_not_a_written_tensors(
    tmp_path: Path,
) -> None:
    from ember_worker.weights.cache.disk_cache import DiskCache
    from ember_worker.weights.origins.origin import ObjectVersion

    data = bytes(range(256)) * 64
    cached = DiskCache(tmp_path / "cache", 2**20).open("file:///x", ObjectVersion(len(data), "t"))
    assert cached is not None
    spans = [(0, len(data))]
    cached.fetch_run(spans, lambda start, end: data[start:end])
    lent = cached.view(0, 100, spans)
    assert lent is not None
    lent[:] = bytes(100)  # a tensor built on it, written in place
    # As `_assemble` copies from a chunk that is on disk, for a read of these bytes again.
    copied = cached.view(0, 200, spans, use="copy")
    assert copied is not None and bytes(copied) == data[:200]
