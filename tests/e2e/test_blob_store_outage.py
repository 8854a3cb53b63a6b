"""A blob store that stops answering for a while: API calls that need it answer 503 and
name the store, and a replica whose start waits on it starts once it is back, instead of
failing. The bucket is moto's, behind a TCP proxy that can be switched off."""

from __future__ import annotations

import contextlib
import json
import select
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from harness import running_platform, wait_for

import ember

BUCKET = "ember-outage"
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class SwitchableProxy:
    """Forwards TCP connections to `target`; while off, takes each connection and closes
    it at once, and drops those open, as a store that went away does."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.on = True
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def switch(self, on: bool) -> None:
        self.on = on
        if not on:
            with self.lock:
                for sock in self.open:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                self.open.clear()

    def close(self) -> None:
        self.switch(False)
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.on:
                client.close()
                continue
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        """Both directions of one connection, until either side ends (or a switch off
        shuts them); then both sockets are closed."""
        with client, socket.create_connection(self.target) as upstream:
            with self.lock:
                self.open |= {client, upstream}
            other = {client: upstream, upstream: client}
            with contextlib.suppress(OSError):
                while True:
                    readable, _, _ = select.select([client, upstream], [], [], 1.0)
                    data = b""
                    for sock in readable:
                        data = sock.recv(65536)
                        if not data:
                            break
                        other[sock].sendall(data)
                    if readable and not data:
                        break
            with self.lock:
                self.open -= {client, upstream}


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[SwitchableProxy]:
    import boto3

    host, port = s3_endpoint.removeprefix("http://").split(":")
    client: Any = boto3.client("s3", endpoint_url=s3_endpoint, **_credentials())
    client.create_bucket(Bucket=BUCKET)
    switchable = SwitchableProxy((host, int(port)))
    yield switchable
    switchable.close()


def _credentials() -> dict[str, str]:
    return {
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
        "region_name": "us-east-1",
    }


def test_an_outage_answers_503_naming_the_store_and_a_start_waits_it_out(
    tmp_path: Path, proxy: SwitchableProxy
) -> None:
    app_file = tmp_path / "app" / "basic.py"
    app_file.parent.mkdir()
    shutil.copy(Path(__file__).parent / "apps" / "basic.py", app_file)
    store = f"s3://{BUCKET}/ember"
    extra = ("--blob-store", store, "--blob-s3-endpoint-url", f"http://127.0.0.1:{proxy.port}")
    with running_platform(tmp_path / "cp", extra=extra, env=AWS_ENV) as platform:
        proxy.switch(False)
        refused = platform.ember("deploy", str(app_file), "--name", "outage", check=False)
        assert refused.returncode == 1
        assert f"the blob store {store} failed" in refused.stderr
        assert "try again once it answers" in refused.stderr
        with platform.client() as client:
            answer = client.get("/v1/volumes/outage/shelf/files/notes.txt")
        assert answer.status_code in (404, 503), answer.text  # no such app yet, or the store
        proxy.switch(True)
        platform.deploy(app_file, "outage")
        echo = ember.Endpoint.lookup("outage", "echo", config=platform.config())
        # The first call starts the first replica, whose bundle is in the bucket: the
        # store goes away just before and comes back a few seconds later.
        proxy.switch(False)
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(echo.call, text="back", times=2)
            time.sleep(4)
            assert not call.done()
            proxy.switch(True)
            assert call.result(timeout=120)["text"] == "backback"
        log = platform.ember("logs", "outage").stdout
        assert "replica failed to start" not in log, log
        # While the store is away, what needs it says so, and what does not still works.
        proxy.switch(False)
        with platform.client() as client:
            bundle = client.get(f"/v1/bundles/sha256:{'0' * 64}")
            assert bundle.status_code == 503, bundle.text
            error = json.loads(bundle.text)["error"]
            assert error["type"] == "blob_store_unavailable" and store in error["message"]
            assert bundle.headers["Retry-After"] == "5"
        assert echo.call(text="still", times=1)["text"] == "still"
        proxy.switch(True)


def test_a_delete_the_store_failed_is_sent_again_at_the_next_start(
    tmp_path: Path, proxy: SwitchableProxy, s3_endpoint: str
) -> None:
    """A volume file removed while the store is away: the removal answers, and its
    content, which the store kept, goes once the store is back (here: at the next start),
    where it stayed in the bucket for good."""
    import boto3

    bucket: Any = boto3.client("s3", endpoint_url=s3_endpoint, **_credentials())

    def contents() -> list[str]:
        listed = bucket.list_objects_v2(Bucket=BUCKET, Prefix="ember/volumes/")
        return [o["Key"] for o in listed.get("Contents", []) if "/uploads/" not in o["Key"]]

    extra = (
        "--no-worker",
        "--blob-store",
        f"s3://{BUCKET}/ember",
        "--blob-s3-endpoint-url",
        f"http://127.0.0.1:{proxy.port}",
    )
    files = "/v1/apps/shelves/volumes/shelf/files"
    root = tmp_path / "cp"
    with running_platform(root, extra=extra, env=AWS_ENV) as platform:
        with platform.client() as client:
            assert client.put(f"{files}/gone.txt", content=b"to go").status_code < 300
            assert client.put(f"{files}/kept.txt", content=b"to keep").status_code < 300
            assert len(contents()) == 2
            proxy.switch(False)
            removed = client.delete(f"{files}/gone.txt")
            assert removed.status_code < 300, removed.text
            assert client.get(f"{files}/gone.txt").status_code == 404
        wait_for(lambda: any("could not delete blob" in line for line in platform.output), 60)
    import sqlite3

    print(
        [
            r
            for r in sqlite3.connect(root / "state" / "state.db").execute(
                "select * from blob_deletes"
            )
        ],
        platform.output[-15:],
    )
    assert len(contents()) == 2  # the store never got the delete
    proxy.switch(True)
    with running_platform(root, extra=extra, env=AWS_ENV) as platform:
        assert any("sending again 1 blob delete" in line for line in platform.output), (
            platform.output
        )
        wait_for(lambda: len(contents()) == 1, 30)
        with platform.client() as client:
            assert client.get(f"{files}/kept.txt").content == b"to keep"
