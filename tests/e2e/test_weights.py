"""Weights from an S3 API (moto in server mode) through `weights=`, in a deployed endpoint:
loaded in enter(snap=True), inside the snapshot, read again after a restore."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from harness import (
    Platform,
    join_worker,
    replicas_reach,
    replicas_ready,
    running_platform,
    wait_for,
)
from machine_needs import need

import ember
from ember.cli.common import byte_size

APP = "weighted"
BUCKET = "weights"
KEY = "tiny.safetensors"


@pytest.fixture(scope="module")
def s3_client(s3_endpoint: str) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


@pytest.fixture(scope="module")
def tensors(s3_client: Any, tmp_path_factory: pytest.TempPathFactory) -> dict:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(7)
    data = {
        "weight": torch.randn(4, 16, generator=generator),
        "bias": torch.randn(4, generator=generator),
        "extra": torch.arange(6, dtype=torch.int32),
    }
    path = tmp_path_factory.mktemp("weights") / KEY
    save_file(data, str(path))
    s3_client.create_bucket(Bucket=BUCKET)
    s3_client.upload_file(str(path), BUCKET, KEY)
    return data


@pytest.fixture(scope="module")
def weights_platform(
    s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("weights-platform")
    with running_platform(
        root, env=platform_env(s3_endpoint), extra=replicas_reach(s3_endpoint)
    ) as platform:
        yield platform


def platform_env(s3_endpoint: str) -> dict[str, str]:
    """What the platform and its replicas need to read apps/weighted.py's weights."""
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "EMBER_TEST_WEIGHTS_URL": f"s3://{BUCKET}/{KEY}",
        "EMBER_TEST_S3_ENDPOINT": s3_endpoint,
    }


@pytest.fixture(scope="module")
def app_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("weighted-app")
    shutil.copy(Path(__file__).parent / "apps" / "weighted.py", folder / "app.py")
    return folder / "app.py"


def test_weights_load_in_enter_and_read_after_a_restore(
    weights_platform: Platform, app_file: Path, tensors: dict, s3_client: Any
) -> None:
    platform = weights_platform
    platform.deploy(app_file, APP)
    tiny = ember.Endpoint.lookup(APP, "tiny", config=platform.config())
    first = tiny.info.call()
    assert first["loaded"] == ["bias", "weight"]
    assert first["keys"] == ["bias", "extra", "weight"]
    assert first["weight_sum"] == pytest.approx(float(tensors["weight"].sum()), abs=1e-5)
    assert first["bias"] == pytest.approx(tensors["bias"].tolist())
    assert first["extra"] == list(range(6))
    logs = platform.ember("logs", f"{APP}/tiny", "-n", "200").stdout
    assert f"ember.weights: read s3://{BUCKET}/{KEY}" in logs  # progress, in the replica's log

    def chunks_from(tier: str) -> float:
        with platform.client() as client:
            text = client.get("/metrics").text
        labels = f'ember:weights_chunks_total{{app="{APP}",endpoint="tiny",tier="{tier}"}} '
        found = [
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(labels)
        ]
        return found[0] if found else 0.0

    # The replica's reads reach the metrics with its heartbeats (once a second).
    assert wait_for(lambda: chunks_from("origin") + chunks_from("disk"), 10) > 0
    # The node's heartbeats say its disk cache holds them: the scheduler prefers it.
    cached = wait_for(lambda: platform.status()["workers"][0]["weights_cached_bytes"], 10)
    assert cached >= s3_client.head_object(Bucket=BUCKET, Key=KEY)["ContentLength"]
    header, row = platform.ember("node", "ls").stdout.splitlines()[:2]
    assert header.split()[-2:] == ["WEIGHTS", "IMAGES"]
    assert row.split()[-3:-1] == byte_size(cached).split(), row
    # The dump succeeded: the weights' connections were closed at the quiet point.
    check_restored_replicas(platform, APP, tiny, first)


def check_restored_replicas(platform: Platform, app: str, tiny: Any, first: dict) -> None:
    """Once the endpoint has a snapshot, two calls at once: the replica that was restored
    holds the original's weights and reads a new tensor after the restore."""
    support = platform.status()["workers"][0]["snapshots"]
    if support.get("problem"):
        need("criu", f"snapshots are off here: {support['problem']}")
    wait_for(lambda: platform.endpoint_status(f"{app}--tiny")["snapshots"], 60)
    # The restored replica is ready before the calls, which take one replica each.
    with replicas_ready(platform, tiny, 2), ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: tiny.info.call(seconds=1.5), range(2)))
    restored = [r for r in results if r["pid"] != first["pid"]]
    assert restored, "no replica was restored"
    for result in restored:
        assert result["loaded_pid"] == first["pid"]  # the weights came with the snapshot
        assert result["weight_sum"] == first["weight_sum"]
        assert result["extra"] == list(range(6))  # read after the restore, reconnected


DEFAULT_URL_LINE = 'URL = os.environ.get("EMBER_TEST_WEIGHTS_URL", "s3://weights/tiny.safetensors")'


def deploy_edited(
    platform: Platform, tmp_path: Path, app: str, edits: dict[str, str], tensors: dict
) -> tuple[Any, dict]:
    """apps/weighted.py with each key of `edits` in its source made its value, deployed
    as `app`: its endpoint, and the answer of a first call, whose weights are checked."""
    source = (Path(__file__).parent / "apps" / "weighted.py").read_text()
    for old, new in edits.items():
        assert old in source
        source = source.replace(old, new)
    app_file = tmp_path / "app.py"
    app_file.write_text(source)
    platform.deploy(app_file, app)
    tiny = ember.Endpoint.lookup(app, "tiny", config=platform.config())
    first: dict = tiny.info.call()
    assert first["weight_sum"] == pytest.approx(float(tensors["weight"].sum()), abs=1e-5)
    return tiny, first


def from_zero(platform: Platform, app: str, tiny: Any) -> dict:
    """Stop the app's replicas, wait until none is left, and call: a new replica answers."""

    def replicas() -> list[dict]:
        return json.loads(platform.ember("replica", "ls", app, "--json").stdout)

    for replica in replicas():
        platform.ember("replica", "stop", replica["id"], "--now")
    wait_for(lambda: not replicas(), 30)
    result: dict = tiny.info.call()
    return result


def test_weights_over_http_snapshot_and_restore(
    weights_platform: Platform, s3_endpoint: str, s3_client: Any, tmp_path: Path, tensors: dict
) -> None:
    """The same endpoint reading its weights over plain HTTP (moto answers path-style GETs
    and HEADs of a public-read object without credentials). The replica reads over HTTP
    before the snapshot, so fsspec's event-loop thread is in the image, and a restored
    replica reads a new tensor through a fresh connection."""
    public = "public.safetensors"
    s3_client.copy_object(
        Bucket=BUCKET, Key=public, CopySource={"Bucket": BUCKET, "Key": KEY}, ACL="public-read"
    )
    url = f"{s3_endpoint}/{BUCKET}/{public}"
    platform = weights_platform
    app = "weighted-http"
    tiny, first = deploy_edited(
        platform, tmp_path, app, {DEFAULT_URL_LINE: f"URL = {url!r}"}, tensors
    )
    assert first["extra"] == list(range(6))
    logs = platform.ember("logs", f"{app}/tiny", "-n", "200").stdout
    assert f"ember.weights: read {url}" in logs
    check_restored_replicas(platform, app, tiny, first)


def test_a_restore_whose_weights_changed_boots_cold_and_loads_the_new_ones(
    weights_platform: Platform, s3_client: Any, tmp_path: Path, tensors: dict
) -> None:
    """Weights rewritten at the same URL after the snapshot: the restored replica asks
    the origin for the object's version before it serves, finds it changed, and a cold
    boot takes its place with the new weights (and a new snapshot). Unchanged, the next
    restore serves."""
    import torch
    from safetensors.torch import save_file

    platform = weights_platform
    support = platform.status()["workers"][0]["snapshots"]
    if support.get("problem"):
        need("criu", f"snapshots are off here: {support['problem']}")
    changing = "changing.safetensors"
    s3_client.copy_object(Bucket=BUCKET, Key=changing, CopySource={"Bucket": BUCKET, "Key": KEY})
    app = "weighted-changing"
    label = f"{app}--tiny"
    url_line = f"URL = 's3://{BUCKET}/{changing}'"
    tiny, _ = deploy_edited(platform, tmp_path, app, {DEFAULT_URL_LINE: url_line}, tensors)
    (snapshot,) = wait_for(lambda: platform.endpoint_status(label)["snapshots"], 60)

    generator = torch.Generator().manual_seed(8)
    rewritten = {
        "weight": torch.randn(4, 16, generator=generator),
        "bias": torch.randn(4, generator=generator),
        "extra": torch.arange(6, dtype=torch.int32),
    }
    path = tmp_path / changing
    save_file(rewritten, str(path))
    s3_client.upload_file(str(path), BUCKET, changing)

    second = from_zero(platform, app, tiny)
    assert second["loaded_pid"] == second["pid"]  # booted cold, not served from the image
    assert second["weight_sum"] == pytest.approx(float(rewritten["weight"].sum()), abs=1e-5)
    assert second["bias"] == pytest.approx(rewritten["bias"].tolist())
    logs = platform.ember("logs", f"{app}/tiny", "-n", "500").stdout
    assert f"taken (s3://{BUCKET}/{changing}: version " in logs
    assert "now): booting cold instead" in logs
    # The replica that found the image stale took the new one as it booted cold.
    renewed = wait_for(
        lambda: [
            s
            for s in platform.endpoint_status(label)["snapshots"]
            if s["image_id"] != snapshot["image_id"]
        ],
        60,
    )
    assert renewed[0]["key"] == snapshot["key"]  # the same code: a new image of the key

    # Unchanged since the new snapshot: restored, and it serves.
    third = from_zero(platform, app, tiny)
    assert third["loaded_pid"] == second["pid"] != third["pid"]
    assert third["weight_sum"] == second["weight_sum"]
    logs = platform.ember("logs", f"{app}/tiny", "-n", "500").stdout
    assert "weights unchanged since the snapshot (1 object(s) checked" in logs
    start = platform.endpoint_status(label)["last_start"]
    assert start["kind"] == "restore" and start["weights_check_seconds"] >= 0


# apps/weighted.py edited to keep its tensors as views of the node cache's file.
KEPT_MAPPED = {
    'self.loaded = self.weights["model"].load_into(self.model, strict=False)': (
        'self.kept = self.weights["model"].state_dict(names=["weight", "bias"])\n'
        "        self.model.load_state_dict(self.kept, strict=False, assign=True)\n"
        "        self.loaded = list(self.kept)"
    )
}


def test_weights_kept_mapped_stay_out_of_the_image_and_need_the_nodes_cache(
    weights_platform: Platform, s3_client: Any, tmp_path: Path, tensors: dict
) -> None:
    """Tensors from `state_dict()` kept in enter(snap=True) stay mappings of the node
    cache's file: the image records the file instead of holding its pages and a restore
    maps it again. With the file gone from the cache, the node fetches it before the
    restore; when it changed at its origin meanwhile, the image is stale: the replica
    boots cold with the new weights, and a new snapshot is taken."""
    import torch
    from safetensors.torch import save_file

    platform = weights_platform
    support = platform.status()["workers"][0]["snapshots"]
    if support.get("problem"):
        need("criu", f"snapshots are off here: {support['problem']}")
    own_key = "mapped.safetensors"  # rewritten below: no other test reads it
    s3_client.copy_object(Bucket=BUCKET, Key=own_key, CopySource={"Bucket": BUCKET, "Key": KEY})
    app = "weighted-mapped"
    label = f"{app}--tiny"
    edits = {**KEPT_MAPPED, DEFAULT_URL_LINE: f"URL = 's3://{BUCKET}/{own_key}'"}
    tiny, first = deploy_edited(platform, tmp_path, app, edits, tensors)
    (snapshot,) = wait_for(lambda: platform.endpoint_status(label)["snapshots"], 60)
    worker_dir = platform.state_dir / "worker"
    images = worker_dir / "snapshots" / f"{snapshot['key']}-{snapshot['image_id']}" / "images"
    [mapped] = json.loads((images / "meta.json").read_text())["mapped_weights"]
    data_file = Path(mapped["path"])
    # In its workspace's cache (`weights/uid-<uid>/objects`): no other workspace's.
    assert data_file.parent.name == "objects"
    assert data_file.parent.parent.parent == (worker_dir / "weights").resolve()
    assert data_file.parent.parent.name.startswith("uid-")
    assert mapped["size"] == data_file.stat().st_size
    logs = platform.ember("logs", f"{app}/tiny", "-n", "500").stdout
    assert "of weights in 1 file stay mapped from the node's cache" in logs

    restored = from_zero(platform, app, tiny)
    assert restored["loaded_pid"] == first["pid"] != restored["pid"]
    assert restored["weight_sum"] == first["weight_sum"]
    assert restored["bias"] == first["bias"]
    assert restored["extra"] == list(range(6))

    def evict() -> None:  # as the cache's eviction does: the file and its markers go
        data_file.unlink()
        shutil.rmtree(data_file.with_suffix(".chunks"))

    evict()
    fetched = from_zero(platform, app, tiny)
    assert fetched["loaded_pid"] == first["pid"] != fetched["pid"]  # restored all the same
    assert fetched["weight_sum"] == first["weight_sum"]
    assert data_file.stat().st_size == mapped["size"]
    logs = platform.ember("logs", f"{app}/tiny", "-n", "500").stdout
    assert "MB of weights that the snapshot maps into this node's cache in" in logs

    generator = torch.Generator().manual_seed(9)
    rewritten = {name: torch.randn(t.shape, generator=generator) for name, t in tensors.items()}
    rewritten["extra"] = tensors["extra"]
    path = tmp_path / own_key
    save_file(rewritten, str(path))
    s3_client.upload_file(str(path), BUCKET, own_key)
    evict()
    cold = from_zero(platform, app, tiny)
    assert cold["loaded_pid"] == cold["pid"]
    assert cold["weight_sum"] == pytest.approx(float(rewritten["weight"].sum()), abs=1e-5)
    logs = platform.ember("logs", f"{app}/tiny", "-n", "500").stdout
    assert (
        f"restoring snapshot {snapshot['key'][:12]} failed, booting cold: weights changed "
        f"since the snapshot: s3://{BUCKET}/{own_key} is version"
    ) in logs
    wait_for(
        lambda: [
            s
            for s in platform.endpoint_status(label)["snapshots"]
            if s["image_id"] != snapshot["image_id"]
        ],
        60,
    )


def _snapshot_on_one_of_two_nodes(
    platform: Platform, tmp_path: Path, app: str, own_key: str, tensors: dict
) -> tuple[Any, dict, dict, str, Callable[[], str]]:
    """Once two workers have joined: `app` (its weights at `own_key`, kept mapped)
    deployed and called, and its snapshot taken. (Its endpoint, the first answer, the
    snapshot, the node that took it, and a reader of the endpoint's logs.)"""
    wait_for(lambda: len(platform.status()["workers"]) == 2, 30)
    if any(w["snapshots"].get("problem") for w in platform.status()["workers"]):
        need("criu", "snapshots are off on this machine")
    edits = {**KEPT_MAPPED, DEFAULT_URL_LINE: f"URL = 's3://{BUCKET}/{own_key}'"}
    tiny, first = deploy_edited(platform, tmp_path, app, edits, tensors)
    (snapshot,) = wait_for(lambda: platform.endpoint_status(f"{app}--tiny")["snapshots"], 60)

    def logs() -> str:
        return platform.ember("logs", f"{app}/tiny", "-n", "500").stdout

    taker = logs().split("starting replica on worker ")[1].split()[0]
    return tiny, first, snapshot, taker, logs


@pytest.mark.parametrize("fetch_ahead", [True, False], ids=["ahead", "at-restore"])
def test_the_other_node_gets_the_weights_an_image_maps_and_restores(
    s3_endpoint: str, s3_client: Any, tmp_path: Path, tensors: dict, fetch_ahead: bool
) -> None:
    """Two nodes whose workers use the same work-dir path, as separate machines do
    (node-b in a mount namespace of its own). The node that did not take the snapshot
    gets the weights file it maps, fetched ahead with the image or, with
    --no-fetch-ahead, before its first restore; either way the replica there restores."""
    from ember_worker.snapshots.mapped_weights import check_on_node

    if os.geteuid() != 0:
        need("root", "a second node at the same work-dir path needs a mount namespace (root)")
    own_key = "two-nodes.safetensors"
    s3_client.copy_object(Bucket=BUCKET, Key=own_key, CopySource={"Bucket": BUCKET, "Key": KEY})
    env = platform_env(s3_endpoint)
    with running_platform(tmp_path / "cp", env=env, extra=("--no-worker",)) as platform:
        token = platform.ember("token", "create", "--scope", "worker").stdout.strip()
        node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"
        flags = (*replicas_reach(s3_endpoint), *(() if fetch_ahead else ("--no-fetch-ahead",)))
        workers = [join_worker(platform, token, node_a, *flags)]
        workers.append(join_worker(platform, token, node_b, *flags, mounted_at=node_a))
        try:
            tiny, first, snapshot, taker, logs = _snapshot_on_one_of_two_nodes(
                platform, tmp_path, "weighted-two-nodes", own_key, tensors
            )
            other = "node-b" if taker == "node-a" else "node-a"
            # Seen from here, each node's cache is in its own folder; the image names the
            # file at the path both workers use (node-a's).
            image = f"{snapshot['key']}-{snapshot['image_id']}"
            folders = {"node-a": node_a, "node-b": node_b}
            meta = folders[taker] / "snapshots" / image
            mapped = json.loads((meta / "images" / "meta.json").read_text())["mapped_weights"]
            assert mapped and all(Path(m["path"]).is_relative_to(node_a) for m in mapped)
            workspace = Path(mapped[0]["path"]).parent.parent.name  # uid-<its uid>
            here = folders[other] / "weights" / workspace / "objects"
            mapped_here = [{**m, "path": str(here / Path(m["path"]).name)} for m in mapped]
            if fetch_ahead:

                def fetched_ahead() -> str | None:
                    text = logs()
                    return text if "MB of weights that snapshot" in text else None

                assert f"worker {other}: fetched ahead" in wait_for(fetched_ahead, 60)
                check_on_node(mapped_here, here)
            # A replica on the other node restores.
            platform.ember("node", "drain", taker, "--wait", "--timeout", "60")
            again = tiny.info.call()
            assert again["loaded_pid"] == first["pid"] != again["pid"]
            assert again["weight_sum"] == first["weight_sum"]
            check_on_node(mapped_here, here)
            fetched_at_restore = (
                "of weights that the snapshot maps into this node's cache" in logs()
            )
            assert fetched_at_restore is not fetch_ahead
        finally:
            for worker in workers:
                worker.terminate()
            for worker in workers:
                worker.wait(30)


def test_a_node_whose_work_dir_is_elsewhere_restores_an_image_that_maps_weights(
    s3_endpoint: str, s3_client: Any, tmp_path: Path, tensors: dict
) -> None:
    """Two nodes whose work dirs are at different paths: the image names the file in the
    taker's cache; the other node fetches it into its own (ahead, with the image) and
    links it at the image's path for the restore, then removes the link."""
    own_key = "two-paths.safetensors"
    s3_client.copy_object(Bucket=BUCKET, Key=own_key, CopySource={"Bucket": BUCKET, "Key": KEY})
    env = platform_env(s3_endpoint)
    with running_platform(tmp_path / "cp", env=env, extra=("--no-worker",)) as platform:
        token = platform.ember("token", "create", "--scope", "worker").stdout.strip()
        folders = {"node-a": tmp_path / "node-a", "node-b": tmp_path / "node-b"}
        reach = replicas_reach(s3_endpoint)
        workers = {
            name: join_worker(platform, token, path, *reach) for name, path in folders.items()
        }
        try:
            app = "weighted-two-paths"
            tiny, first, snapshot, taker, logs = _snapshot_on_one_of_two_nodes(
                platform, tmp_path, app, own_key, tensors
            )
            other = "node-b" if taker == "node-a" else "node-a"
            image = folders[taker] / "snapshots" / f"{snapshot['key']}-{snapshot['image_id']}"
            meta = json.loads((image / "images" / "meta.json").read_text())
            mapped = [Path(m["path"]) for m in meta["mapped_weights"]]
            assert mapped and all(p.is_relative_to(folders[taker]) for p in mapped)
            wait_for(lambda: f"worker {other}: fetched ahead" in logs(), 60)
            # The taker goes, with its cache: nothing is at the image's path any more.
            platform.ember("node", "drain", taker, "--wait", "--timeout", "60")
            workers[taker].terminate()
            workers[taker].wait(30)
            shutil.rmtree(folders[taker] / "weights")
            again = tiny.info.call()
            assert again["loaded_pid"] == first["pid"] != again["pid"]  # restored
            assert again["weight_sum"] == first["weight_sum"]
            assert platform.endpoint_status(f"{app}--tiny")["last_start"]["kind"] == "restore"
            # The link is gone, and the extra tensor read after the restore went into
            # this node's cache, not into a folder made again at the taker's path.
            assert not any(os.path.lexists(p) for p in mapped)
            assert not (folders[taker] / "weights").exists()
        finally:
            for worker in workers.values():
                if worker.poll() is None:
                    worker.terminate()
                    worker.wait(30)
