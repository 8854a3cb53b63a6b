"""What `ember deploy`, `ember run` and `ember serve` refuse before anything is uploaded:
an empty --name, an entry file the bundle leaves out, code that fails to import, a file
that is not there."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

from ember.cli.apps import serve
from ember.cli.apps.deploy import deploy
from ember.cli.main import main
from ember.config import ClientConfig
from ember.errors import InvalidError

# Nothing listens here: a check that lets a deploy through fails on the connection.
NOWHERE = ClientConfig("https://127.0.0.1:1", "emb_token")

APP = """
import ember

@ember.endpoint()
def echo() -> int:
    return 1
"""


@pytest.fixture
def app_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ember_unit_deployed" / "app.py"
    path.parent.mkdir()
    path.write_text(APP)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "app", raising=False)
    return path


def test_an_empty_name_is_refused_not_replaced_by_the_default(app_file: Path) -> None:
    with pytest.raises(InvalidError, match="app name '' is not allowed"):
        deploy(app_file, "", NOWHERE)


def test_an_entry_file_the_ignore_file_leaves_out_is_refused(app_file: Path) -> None:
    (app_file.parent / ".emberignore").write_text("app.py\n")
    with pytest.raises(InvalidError, match=r"\.emberignore leaves out app\.py, the entry file"):
        deploy(app_file, "shop", NOWHERE)


def test_code_that_fails_to_import_is_one_error_without_embers_frames(
    app_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    app_file.write_text("import ember\nraise RuntimeError('no weights')\n")
    monkeypatch.setenv("EMBER_SERVER_URL", NOWHERE.server_url)
    monkeypatch.setenv("EMBER_TOKEN", NOWHERE.token)
    monkeypatch.delenv("EMBER_CA_CERT", raising=False)
    assert main(["deploy", str(app_file)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ember: cannot import {app_file}:\nTraceback (most recent call last):")
    assert err.rstrip().endswith("RuntimeError: no weights")
    assert "ember/endpoints/loader.py" not in err and "ember/cli" not in err


def _serve_args(file: Path, name: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(file=file, name=name, keep=False)


def test_serve_fails_at_once_for_a_missing_file_or_an_empty_name(
    app_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def deployed(file: Path, app: str) -> None:
        raise AssertionError("serve deployed")

    monkeypatch.setattr(serve, "_deploy", deployed)
    with pytest.raises(InvalidError, match="no such file"):
        serve.run(_serve_args(app_file.parent / "nope.py"))
    with pytest.raises(InvalidError, match="app name '' is not allowed"):
        serve.run(_serve_args(app_file, ""))


def test_the_serve_watch_skips_a_file_deleted_while_it_looks(
    app_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    swap = app_file.parent / ".app.py.swp"
    swap.write_text("editor state")
    real_stat = Path.stat

    def stat_then_vanish(path: Path, **kwargs: bool):  # type: ignore[no-untyped-def]
        status = real_stat(path, **kwargs)
        if path == swap and os.path.lexists(swap):
            os.unlink(swap)  # the editor removes it between two looks at it
        return status

    monkeypatch.setattr(Path, "stat", stat_then_vanish)
    assert app_file in serve.snapshot_mtimes(app_file.parent)
