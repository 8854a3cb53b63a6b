"""Two `ember server` processes on one PostgreSQL database with different blob stores: the
second is refused at start, saying which store the database holds and which it was given;
with --move-blob-store, once the first has stopped, it starts and the database's store is
its own."""

from __future__ import annotations

import subprocess
from pathlib import Path

from harness import EMBER, Platform, running_platform


def test_a_second_server_with_another_blob_store_is_refused_unless_it_moves_the_store(
    tmp_path: Path, postgres_url: str
) -> None:
    extra = ("--no-worker", "--database", postgres_url)
    with running_platform(tmp_path / "first", extra=extra) as first:
        other = tmp_path / "second"
        command = [*EMBER, "server", "--state-dir", str(other / "state"), "--port", "0", *extra]
        done = subprocess.run(
            command, env=Platform(other).env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode != 0, done.stdout
        said = done.stderr
        kept = (first.state_dir / "blobs").resolve().as_uri()
        given = (other / "state" / "blobs").resolve().as_uri()
        assert f"this database's blob store is {kept}" in said, said
        assert f"started with {given}" in said and "--move-blob-store" in said
        assert "Traceback" not in said
        with first.client() as client:  # the first one serves on
            assert client.get("/v1/health").status_code == 200
    moved = ("--move-blob-store", *extra)
    with running_platform(other, extra=moved) as second, second.client() as client:
        assert client.get("/v1/health").status_code == 200
        told = f"the blob store moves from {kept} to {given}"
        assert any(told in line for line in second.output), second.output
    done = subprocess.run(
        [*EMBER, "server", "--state-dir", str(first.state_dir), "--port", "0", *extra],
        env=first.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and f"this database's blob store is {given}" in done.stderr
