"""What `ember serve` watches: the bundle's files, less what .gitignore names (in the app
folder and above it, up to the repository's root) and what serve's own output goes to."""

from __future__ import annotations

import os
from pathlib import Path

from ember.cli.apps.watched_files import load_git_ignores, own_outputs, watched_mtimes


def watched(folder: Path, **kwargs: frozenset[tuple[int, int]]) -> set[str]:
    mtimes = watched_mtimes(folder, load_git_ignores(folder), **kwargs)
    assert mtimes is not None
    return {path.relative_to(folder).as_posix() for path in mtimes}


def test_gitignores_up_to_the_repository_root_apply(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    app = repo / "examples" / "app"
    (app / "out").mkdir(parents=True)
    (repo / ".git").mkdir()
    (tmp_path / ".gitignore").write_text("*.py\n")  # above the repository: not read
    (repo / ".gitignore").write_text("*.log\n/examples/app/scratch.txt\n")
    (app / ".gitignore").write_text("out/\n")
    for name in ("app.py", "serve.log", "scratch.txt", "notes.txt", "out/result.json"):
        (app / name).write_text(name)
    assert watched(app) == {".gitignore", "app.py", "notes.txt"}


def test_outside_a_repository_only_the_apps_own_gitignore_counts(tmp_path: Path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    (tmp_path / ".gitignore").write_text("*.py\n")
    (app / "app.py").write_text("")
    assert watched(app) == {"app.py"}


def test_the_file_our_output_goes_to_is_not_watched(tmp_path: Path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    (app / "app.py").write_text("")
    log = app / "serve.log"
    saved = os.dup(1)
    try:
        with log.open("w") as output:
            os.dup2(output.fileno(), 1)  # as `ember serve app.py > serve.log` starts
            outputs = own_outputs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    assert watched(app) == {"app.py", "serve.log"}
    assert watched(app, outputs=outputs) == {"app.py"}
