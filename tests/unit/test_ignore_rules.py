"""`.emberignore`: what `ember deploy` leaves out of a bundle, and `ember serve` of its
watch."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.bundle import build_bundle
from ember.cli.apps.serve import snapshot_mtimes
from ember.errors import BundleError
from ember.ignore_rules import ignored, leaves_out, parse_rules
from ember_worker.agent.bundle_extract import extract_bundle

RULES = parse_rules(
    """
# checkpoints and data, wherever they are
*.ckpt
data/
/notes/draft.md
outputs/**/*.png
!keep.ckpt
docs/?.txt
"""
)


@pytest.mark.parametrize(
    ("path", "is_folder", "left_out"),
    [
        ("model.ckpt", False, True),
        ("deep/er/model.ckpt", False, True),
        ("keep.ckpt", False, False),  # taken back in by a later rule
        ("data", True, True),
        ("sub/data", True, True),
        ("data", False, False),  # a file named data: the rule is for folders
        ("notes/draft.md", False, True),
        ("other/notes/draft.md", False, False),  # anchored at the app folder
        ("outputs/a.png", False, True),
        ("outputs/x/y/a.png", False, True),
        ("outputs/a.jpg", False, False),
        ("docs/a.txt", False, True),
        ("docs/ab.txt", False, False),
        ("app.py", False, False),
    ],
)
def test_patterns_match_like_gitignore(path: str, is_folder: bool, left_out: bool) -> None:
    assert ignored(RULES, path, is_folder) is left_out


def test_a_folder_left_out_takes_its_files() -> None:
    assert leaves_out(RULES, "sub/data/train.csv")
    assert not leaves_out(RULES, "sub/code/train.py")


def test_bundles_and_the_serve_watch_leave_the_ignored_files_out(tmp_path: Path) -> None:
    app = tmp_path / "app"
    for name in ("app.py", "data/big.bin", "model.ckpt", "keep.ckpt", "lib/util.py"):
        (app / name).parent.mkdir(parents=True, exist_ok=True)
        (app / name).write_text(name)
    (app / ".emberignore").write_text("data/\n*.ckpt\n!keep.ckpt\n")
    bundle = build_bundle(app)
    files = {
        p.relative_to(tmp_path / "out").as_posix()
        for p in extract_bundle(bundle.data, tmp_path / "out").rglob("*")
        if p.is_file()
    }
    assert files == {".emberignore", "app.py", "keep.ckpt", "lib/util.py"}
    watched = {p.relative_to(app).as_posix() for p in snapshot_mtimes(app)}
    assert watched == files
    # Changing an ignored file changes nothing the deploy would send.
    (app / "data" / "big.bin").write_text("changed")
    assert build_bundle(app).digest == bundle.digest


def test_a_huge_ignore_file_is_refused() -> None:
    with pytest.raises(BundleError, match="more than 1000 patterns"):
        parse_rules("\n".join(f"file{i}" for i in range(1001)))
