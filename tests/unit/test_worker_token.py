"""Where `ember worker` takes its token from: $EMBER_WORKER_TOKEN or --token-file, and
--token still, with a warning that `ps` shows it to every user."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ember_worker.cli import add_arguments, worker_token


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--server", "https://cp:8443", *argv])


def test_the_token_comes_from_the_environment_or_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("EMBER_WORKER_TOKEN", "from-env")
    assert worker_token(parse()) == "from-env"
    held = tmp_path / "token"
    held.write_text("from-file\n")
    assert worker_token(parse("--token-file", str(held))) == "from-file"
    monkeypatch.delenv("EMBER_WORKER_TOKEN")
    assert worker_token(parse()) is None
    assert capsys.readouterr().err == ""  # none of these is visible in ps: no warning
    with pytest.raises(OSError):
        worker_token(parse("--token-file", str(tmp_path / "missing")))


def test_a_token_on_the_command_line_still_works_with_a_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert worker_token(parse("--token", "on-the-line")) == "on-the-line"
    assert "--token shows the token to every user" in capsys.readouterr().err


def test_replica_uid_ranges_and_pids_are_options() -> None:
    args = parse("--replica-uids", "300000:1000", "--replica-pids-max", "512")
    assert args.replica_uids == (300_000, 1000) and args.replica_pids_max == 512
    assert parse().replica_uids == (200_000, 65_536) and parse().replica_pids_max == 4096
    with pytest.raises(SystemExit):
        parse("--replica-uids", "5:5")
