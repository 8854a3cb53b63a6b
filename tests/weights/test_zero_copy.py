"""Warm reads map the node cache's data files: tensors on the page cache's pages, no copy,
valid as long as they live (past the view, the reader and the file's eviction)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import ember

from .conftest import HttpStore, Store
from .test_open import CHUNK, make_tensors, safetensors_bytes

_WARM_CHILD = r"""
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
import ember

url, cache, local, chunk = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
view = ember.weights.open(url, cache_dir=cache, chunk_bytes=chunk)
tensors = view.state_dict()
objects = str(cache / "objects") + "/"
regions = []
with open("/proc/self/maps") as maps:
    for line in maps:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(objects):
            low, high = (int(part, 16) for part in fields[0].split("-"))
            regions.append((low, high))
mapped = [
    name for name, tensor in tensors.items()
    if any(low <= tensor.untyped_storage().data_ptr() < high for low, high in regions)
]
expected = load_file(local)
equal = sorted(expected) == sorted(tensors) and all(
    tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor)
    for name, tensor in expected.items()
)
print(json.dumps({"mapped": sorted(mapped), "equal": equal}))
"""


def _mapped_files(data_ptr: int) -> list[str]:
    """The paths of the file mappings that hold `data_ptr` (" (deleted)" once unlinked)."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(part, 16) for part in fields[0].split("-"))
            if len(fields) == 6 and low <= data_ptr < high:
                found.append(fields[5].strip())
    return found


def test_a_warm_read_in_a_new_process_maps_the_cache(http_store: HttpStore, tmp_path: Path) -> None:
    tensors = make_tensors()
    data = safetensors_bytes(tensors, tmp_path, "m.safetensors")
    url = http_store.put("model.safetensors", data)
    cache = tmp_path / "cache"
    ember.weights.open(url, cache_dir=cache, chunk_bytes=CHUNK).state_dict()  # fills it
    gets = http_store.server.gets("model.safetensors")
    command = [sys.executable, "-c", _WARM_CHILD, url, str(cache)]
    command += [str(tmp_path / "m.safetensors"), str(CHUNK)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["equal"]
    assert report["mapped"] == sorted(tensors)  # every tensor on the file's pages
    assert http_store.server.gets("model.safetensors") == gets  # nothing from the origin


def test_a_tensor_outlives_its_view(store: Store, tmp_path: Path) -> None:
    import torch

    tensors = make_tensors()
    url = store.put("model.safetensors", safetensors_bytes(tensors, tmp_path, "m.safetensors"))
    view = ember.weights.open(url, cache_dir=tmp_path / "cache", chunk_bytes=CHUNK)
    view.prefetch(background=False)
    got = view["head.weight"]
    streamed = view.state_dict(names=["embed.weight"])["embed.weight"]
    assert any("/objects/" in path for path in _mapped_files(got.untyped_storage().data_ptr()))
    del view
    gc.collect()
    assert torch.equal(got, tensors["head.weight"])
    assert torch.equal(streamed, tensors["embed.weight"])
    got.mul_(2)  # writable, and private: the cache's file is not changed
    assert torch.equal(got, tensors["head.weight"] * 2)
    again = ember.weights.open(url, cache_dir=tmp_path / "cache", chunk_bytes=CHUNK)
    assert torch.equal(again["head.weight"], tensors["head.weight"])


def test_evicting_a_mapped_object_leaves_its_tensors_intact(
    http_store: HttpStore, tmp_path: Path
) -> None:
    import torch

    first, second = make_tensors(), {"other": torch.randn(300, 200)}
    first_url = http_store.put("a.safetensors", safetensors_bytes(first, tmp_path, "a"))
    second_url = http_store.put("b.safetensors", safetensors_bytes(second, tmp_path, "b"))
    cache = tmp_path / "cache"
    budget = 300 * 1024  # room for either object, not for both

    def open_view(url: str) -> ember.weights.WeightsView:  # type: ignore[name-defined]
        return ember.weights.open(url, cache_dir=cache, cache_bytes=budget, chunk_bytes=CHUNK)

    held = open_view(first_url).state_dict()
    pointer = held["head.weight"].untyped_storage().data_ptr()
    [path] = [path for path in _mapped_files(pointer) if "/objects/" in path]
    assert Path(path).exists()
    assert torch.equal(open_view(second_url)["other"], second["other"])
    assert not Path(path).exists()  # evicted, least recently used
    assert _mapped_files(pointer) == [f"{path} (deleted)"]
    gc.collect()
    for name, tensor in first.items():
        assert torch.equal(held[name], tensor)


def test_objects_tensors_still_map_are_made_whole(file_store: Store, tmp_path: Path) -> None:
    """At a replica's quiet point: a snapshot leaves mapped pages out, and a restore maps
    the files again, so those a tensor maps are fetched whole; objects read and let go
    are left as they are."""
    import torch

    from ember_worker.weights.cache.disk_object import missing_bytes
    from ember_worker.weights.opener import complete_mapped_objects

    tensors = make_tensors()
    kept_url = file_store.put("kept.safetensors", safetensors_bytes(tensors, tmp_path, "k.st"))
    dropped_url = file_store.put("gone.safetensors", safetensors_bytes(tensors, tmp_path, "g.st"))
    cache = tmp_path / "cache"
    kept_view = ember.weights.open(kept_url, cache_dir=cache, chunk_bytes=CHUNK)
    dropped_view = ember.weights.open(dropped_url, cache_dir=cache, chunk_bytes=CHUNK)
    kept = kept_view["head.weight"]
    assert torch.equal(dropped_view["head.weight"], tensors["head.weight"])  # and let go
    gc.collect()
    [kept_file] = [p for p in _mapped_files(kept.untyped_storage().data_ptr()) if "/objects/" in p]
    data_files = sorted((cache / "objects").glob("*.data"))
    [dropped_file] = [p for p in data_files if str(p) != kept_file]
    size = Path(kept_file).stat().st_size
    assert missing_bytes(Path(kept_file), size) > 0 and missing_bytes(dropped_file, size) > 0

    completed = complete_mapped_objects()
    assert kept_url in completed and dropped_url not in completed
    assert missing_bytes(Path(kept_file), size) == 0
    assert missing_bytes(dropped_file, size) > 0
    assert torch.equal(kept, tensors["head.weight"])
    for name, tensor in kept_view.state_dict().items():
        assert torch.equal(tensor, tensors[name])


def test_a_node_fetches_whole_what_a_snapshot_maps(file_store: Store, tmp_path: Path) -> None:
    """What a node that lacks them runs before a restore (`ember_worker.weights.fill`):
    each object whole into the cache, or word that it changed since the snapshot."""
    from ember_worker.weights.cache.disk_cache import DiskCache
    from ember_worker.weights.cache.disk_object import missing_bytes
    from ember_worker.weights.fill import fill
    from ember_worker.weights.origins.by_scheme import open_origin

    data = safetensors_bytes(make_tensors(), tmp_path, "f.st")
    url = file_store.put("filled.safetensors", data)
    version = open_origin(url).stat()
    cache = DiskCache(tmp_path / "cache", 10 * len(data))
    wanted = {"url": url, "s3_endpoint_url": None, "tag": version.tag, "size": version.size}
    [answer] = fill(cache, [wanted])
    assert answer["fetched_bytes"] == len(data)
    data_path = cache.data_path(DiskCache.key(url, version))
    assert missing_bytes(data_path, len(data)) == 0
    assert data_path.read_bytes() == data
    [again] = fill(cache, [wanted])
    assert again["fetched_bytes"] == 0  # whole already
    [changed] = fill(cache, [{**wanted, "tag": "old"}])
    assert changed == {"url": url, "changed": version.tag}
    [failed] = fill(cache, [{**wanted, "url": url + ".missing"}])
    assert "WeightsNotFoundError" in failed["error"]

    # As the agent runs it: JSON in, JSON out, the cache from the environment.
    env = {**os.environ, "EMBER_WEIGHTS_CACHE": str(tmp_path / "other-cache")}
    ran = subprocess.run(
        [sys.executable, "-m", "ember_worker.weights.fill"],
        input=json.dumps({"objects": [wanted]}),
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert json.loads(ran.stdout)["objects"][0]["fetched_bytes"] == len(data)
