"""`ember server --blob-store s3://…`: bundles, snapshot images and volume files in an S3
bucket (moto in server mode), none of them in the state dir; a bucket that is not there
stops the server with a message that says so."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from harness import EMBER, Platform, join_worker, running_platform, wait_for
from machine_needs import snapshots_on

import ember

APP = "snappy"
LABEL = f"{APP}--stateful"
BUCKET = "ember-blobs"
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="module")
def s3_client(s3_endpoint: str) -> Any:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=BUCKET)
    return client


def keys(client: Any) -> list[str]:
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix="ember/")
    return [o["Key"] for o in listing.get("Contents", [])]


def test_bundles_snapshots_and_volume_files_live_in_the_bucket(
    tmp_path: Path, s3_endpoint: str, s3_client: Any
) -> None:
    app_file = tmp_path / "app" / "app.py"
    app_file.parent.mkdir()
    shutil.copy(Path(__file__).parent / "apps" / "snappy.py", app_file)
    extra = ("--blob-store", f"s3://{BUCKET}/ember", "--blob-s3-endpoint-url", s3_endpoint)
    with running_platform(tmp_path / "cp", extra=extra, env=AWS_ENV) as platform:
        platform.deploy(app_file, APP)
        assert any(k.startswith("ember/bundles/sha256-") for k in keys(s3_client))
        stateful = ember.Endpoint.lookup(APP, "stateful", config=platform.config())
        first = stateful.info.call()
        assert first["loaded_pid"] == first["pid"]
        check_volume_files(platform, s3_client, tmp_path)
        # (Left out only where EMBER_TEST_ALLOW_SKIP names criu, else the test fails.)
        if snapshots_on(platform.status()["workers"][0]["snapshots"].get("problem")):
            check_snapshot_images(platform, s3_client, tmp_path)
        blob_dir = platform.state_dir / "blobs"
        assert not blob_dir.exists() or not any(blob_dir.iterdir())


def check_volume_files(platform: Platform, s3_client: Any, tmp_path: Path) -> None:
    source = tmp_path / "notes.txt"
    source.write_text("kept in the bucket")
    platform.ember("volume", "put", f"{APP}/shelf", str(source))
    got = platform.ember("volume", "get", f"{APP}/shelf", "notes.txt", "-").stdout
    assert got == "kept in the bucket"
    contents = [k for k in keys(s3_client) if k.startswith("ember/volumes/sha256-")]
    assert len(contents) == 1
    assert not [k for k in keys(s3_client) if k.startswith("ember/volumes/uploads/")]
    # Written again with other content: the old content leaves the bucket.
    source.write_text("a second version")
    platform.ember("volume", "put", f"{APP}/shelf", str(source))
    got = platform.ember("volume", "get", f"{APP}/shelf", "notes.txt", "-").stdout
    assert got == "a second version"
    wait_for(lambda: [k for k in keys(s3_client) if k.startswith("ember/volumes/")] != contents, 10)
    assert len([k for k in keys(s3_client) if k.startswith("ember/volumes/sha256-")]) == 1


def check_snapshot_images(platform: Platform, s3_client: Any, tmp_path: Path) -> None:
    """The image goes to the bucket; a node that joins fetches it from there and its
    replicas restore from it."""
    snapshot = wait_for(lambda: platform.endpoint_status(LABEL)["snapshots"], 60)[0]
    assert f"ember/snapshots/{snapshot['key']}" in keys(s3_client)
    token = platform.ember("token", "create", "--scope", "worker").stdout.strip()
    node_b = tmp_path / "node-b"
    worker = join_worker(platform, token, node_b)
    try:
        image = node_b / "snapshots" / f"{snapshot['key']}-{snapshot['image_id']}"
        wait_for((image / "images" / "meta.json").exists, 60)
        # From the bucket itself, by the presigned URL the control plane handed it.
        log = (tmp_path / "node-b.log").read_text()
        assert f"snapshot {snapshot['key'][:12]} downloaded from the blob store directly" in log
        platform.ember("node", "drain", "local", "--wait", "--timeout", "60")
        stateful = ember.Endpoint.lookup(APP, "stateful", config=platform.config())
        again = stateful.info.call()
        assert again["loaded_pid"] != again["pid"]  # restored there, not booted
        assert platform.endpoint_status(LABEL)["last_start"]["kind"] == "restore"
        # A node that cannot reach the bucket (here: through a proxy that is not there)
        # gets the image through the control plane instead.
        node_c = tmp_path / "node-c"
        walled = join_worker(platform, token, node_c, env={"HTTP_PROXY": "http://127.0.0.1:9"})
        try:
            image = node_c / "snapshots" / f"{snapshot['key']}-{snapshot['image_id']}"
            wait_for((image / "images" / "meta.json").exists, 60)
            log = (tmp_path / "node-c.log").read_text()
            assert "the blob store's URL failed" in log and "directly" not in log
        finally:
            walled.terminate()
            walled.wait(30)
    finally:
        worker.terminate()
        worker.wait(30)


def test_a_bucket_that_is_not_there_stops_the_server_with_a_message(
    tmp_path: Path, s3_endpoint: str, s3_client: Any
) -> None:
    command = [
        *EMBER,
        "server",
        "--state-dir",
        str(tmp_path / "state"),
        "--port",
        "0",
        "--no-worker",
        "--blob-store",
        "s3://no-such-bucket/ember",
        "--blob-s3-endpoint-url",
        s3_endpoint,
    ]
    env = {**Platform(tmp_path).env, **AWS_ENV}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "cannot use the blob store s3://no-such-bucket/ember" in done.stderr
    assert "is the bucket there" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_restart_on_a_bucket_without_the_apps_bundles_says_so(
    tmp_path: Path, s3_endpoint: str, s3_client: Any
) -> None:
    app_file = tmp_path / "app" / "app.py"
    app_file.parent.mkdir()
    shutil.copy(Path(__file__).parent / "apps" / "snappy.py", app_file)
    prefix = "emptied"
    extra = ("--blob-store", f"s3://{BUCKET}/{prefix}", "--blob-s3-endpoint-url", s3_endpoint)
    platform = Platform(tmp_path / "cp", extra=(*extra, "--no-worker"), env=AWS_ENV).start()
    try:
        platform.deploy(app_file, APP)
        warning = f"the blob store s3://{BUCKET}/{prefix} lacks the bundle sha256:"
        assert not any(warning in line for line in platform.output)
    finally:
        platform.stop()
    listing = s3_client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/bundles/")
    for item in listing["Contents"]:
        s3_client.delete_object(Bucket=BUCKET, Key=item["Key"])
    platform = Platform(tmp_path / "cp", extra=(*extra, "--no-worker"), env=AWS_ENV).start()
    try:
        said = [line for line in platform.output if warning in line]
        assert said and f"of app {APP}: its replicas cannot start" in said[0]
        assert "deploy it again, or point --blob-store at the store" in said[0]
    finally:
        platform.stop()
