"""Two `ember server` processes on one PostgreSQL database with different blob stores: the
second is refused at start, saying which store the database holds and which it was given."""

from __future__ import annotations

import subprocess
from pathlib import Path

from harness import EMBER, Platform, running_platform


def test_a_second_server_with_another_blob_store_is_refused(
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
