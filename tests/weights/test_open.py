"""`ember.weights.open` against real origins (a file, the HTTP server, moto's S3): the
tensors equal those of `safetensors.torch.load_file`, and only what is asked is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ember
from ember.errors import WeightsFormatError, WeightsNotFoundError

from .conftest import HttpStore, Store

CHUNK = 64 * 1024


def make_tensors() -> dict:
    import torch

    generator = torch.Generator().manual_seed(3)
    return {
        "embed.weight": torch.randn(256, 64, generator=generator),  # 64 KiB
        "block.0.weight": torch.randn(128, 128, generator=generator).to(torch.bfloat16),
        "block.0.bias": torch.randn(128, generator=generator).to(torch.float16),
        "head.weight": torch.randn(512, 64, generator=generator),  # 128 KiB
        "steps": torch.arange(10, dtype=torch.int64),
    }


def safetensors_bytes(tensors: dict, tmp_path: Path, name: str) -> bytes:
    from safetensors.torch import save_file

    path = tmp_path / name
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path.read_bytes()


def open_view(url: str, tmp_path: Path) -> ember.weights.WeightsView:  # type: ignore[name-defined]
    return ember.weights.open(url, cache_dir=tmp_path / "cache", chunk_bytes=CHUNK)


def test_state_dict_equals_load_file(store: Store, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    tensors = make_tensors()
    url = store.put("model.safetensors", safetensors_bytes(tensors, tmp_path, "m.safetensors"))
    view = open_view(url, tmp_path)
    assert view.metadata == {"format": "pt"}
    assert set(view) == set(tensors)
    expected = load_file(str(tmp_path / "m.safetensors"))
    got = view.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)


def test_one_tensor_reads_only_its_chunks(http_store: Store, tmp_path: Path) -> None:
    import torch

    tensors = make_tensors()
    data = safetensors_bytes(tensors, tmp_path, "m.safetensors")
    url = http_store.put("model.safetensors", data)
    view = open_view(url, tmp_path)
    server = http_store.server  # type: ignore[attr-defined]
    header_gets = server.gets("model.safetensors")
    assert header_gets == 1  # the header probe
    assert torch.equal(view["steps"], tensors["steps"])
    # `steps` is 80 bytes, in one chunk at most two: far fewer than the file's chunks.
    assert server.gets("model.safetensors") - header_gets <= 2
    assert len(data) // CHUNK >= 3


def test_opening_reads_the_header_bytes_alone_not_a_chunk(
    http_store: Store, tmp_path: Path
) -> None:
    """A header read whole chunks would cost a chunk per file (16 MiB by default) to open
    it; the probe asks for its 64 KiB only, and keeps nothing, so the cache fills with
    what tensors need. Once the file's first chunk is cached, opening reads it there."""
    tensors = make_tensors()
    data = safetensors_bytes(tensors, tmp_path, "m.safetensors")
    url = http_store.put("model.safetensors", data)
    server = http_store.server  # type: ignore[attr-defined]
    big = ember.weights.open(url, cache_dir=tmp_path / "cache", chunk_bytes=4 * CHUNK)
    assert [r.range for r in server.recorded("model.safetensors")] == [f"bytes=0-{CHUNK - 1}"]
    assert set(big.keys()) == set(tensors)
    ember.weights.open(url, cache_dir=tmp_path / "cache", chunk_bytes=4 * CHUNK)
    assert server.gets("model.safetensors") == 2  # nothing kept: asked again
    big.state_dict()
    asked = server.gets("model.safetensors")
    ember.weights.open(url, cache_dir=tmp_path / "cache", chunk_bytes=4 * CHUNK)
    assert server.gets("model.safetensors") == asked  # from the disk tier


def test_sharded_checkpoint_equals_the_whole(store: Store, tmp_path: Path) -> None:
    import torch

    tensors = make_tensors()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    weight_map = {}
    for shard, members in shards.items():
        part = {name: tensors[name] for name in members}
        store.put(f"ckpt/{shard}", safetensors_bytes(part, tmp_path, shard))
        weight_map.update(dict.fromkeys(members, shard))
    index = {"metadata": {"total_size": 1}, "weight_map": weight_map}
    store.put("ckpt/model.safetensors.index.json", json.dumps(index).encode())
    folder = store.url("ckpt/model.safetensors.index.json").rsplit("/", 1)[0] + "/"
    view = open_view(folder, tmp_path)
    assert set(view) == set(tensors)
    got = view.state_dict()
    for name, tensor in tensors.items():
        assert torch.equal(got[name], tensor)


def test_load_into_a_module(s3_store: Store, tmp_path: Path) -> None:
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    source = {name: torch.randn_like(p) for name, p in model.state_dict().items()}
    url = s3_store.put("small.safetensors", safetensors_bytes(source, tmp_path, "s.safetensors"))
    loaded = open_view(url, tmp_path).load_into(model)
    assert sorted(loaded) == sorted(source)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, source[name])


def test_errors_name_the_url(store: Store, tmp_path: Path) -> None:
    with pytest.raises(WeightsNotFoundError) as missing:
        open_view(store.url("absent.safetensors"), tmp_path)
    assert "absent.safetensors" in str(missing.value)
    url = store.put("notes.txt", b"just some text, not a tensor file at all")
    with pytest.raises(WeightsFormatError) as bad:
        open_view(url, tmp_path)
    assert "notes.txt" in str(bad.value)


def test_weights_by_name_prepares_clients_without_a_request(
    s3_store: Store, http_store: HttpStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What a replica does before its snapshot: client libraries imported and the shared
    S3 client built, no origin contacted; the reads that follow use that client."""
    from ember_worker.weights.opener import WeightsByName
    from ember_worker.weights.origins import s3

    s3_url = s3_store.put("model.safetensors", b"not read")
    http_url = http_store.put("model.safetensors", b"not read")
    s3._s3_clients.clear()
    weights = WeightsByName({"s3": s3_url, "web": http_url, "odd": "ftp://host/x"})
    with caplog.at_level("WARNING", logger="ember.worker.weights"):
        weights.prepare()
    assert "could not prepare the origin of weights 'odd'" in caplog.text
    assert http_store.server.recorded(method="GET") == []
    assert http_store.server.recorded(method="HEAD") == []
    (prepared,) = s3._s3_clients.values()
    reader = s3.S3Origin(s3_url)
    assert reader._s3() is prepared
    assert reader.stat().size == len(b"not read")


def test_after_a_restore_readers_write_into_the_cache_the_environment_names(
    http_store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restored replica on a node whose cache is elsewhere: readers opened before the
    snapshot put what they read next into this node's cache, not the snapshot node's."""
    from ember_worker.identity import WEIGHTS_CACHE_DIR_ENV
    from ember_worker.weights import opener

    tensors = make_tensors()
    url = http_store.put("m.safetensors", safetensors_bytes(tensors, tmp_path, "m.safetensors"))
    snapshot_node, this_node = tmp_path / "node-a", tmp_path / "node-b"
    monkeypatch.setenv(WEIGHTS_CACHE_DIR_ENV, str(snapshot_node))
    view = opener.open_weights(url)
    view["embed.weight"]
    monkeypatch.setenv(WEIGHTS_CACHE_DIR_ENV, str(this_node))
    assert opener.follow_cache_dir() >= 1
    assert opener.follow_cache_dir() == 0  # all of them use this node's cache now
    before = sorted(p.name for p in (snapshot_node / "objects").iterdir())
    head = view["head.weight"]
    assert head.equal(tensors["head.weight"])
    assert sorted(p.name for p in (snapshot_node / "objects").iterdir()) == before
    assert any(p.suffix == ".data" for p in (this_node / "objects").iterdir())
