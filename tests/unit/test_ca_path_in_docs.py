"""The pages and examples point a new user at the one CA file `ember server` writes (its
state dir's ca.pem, ~/.ember/server by default), and the README says where an app's name
comes from: a copied command that names another path or app fails with a TLS error or a
404."""

from __future__ import annotations

import re
from pathlib import Path

from ember.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES += sorted((ROOT / "examples").rglob("*.py"))
HOME_PATH = re.compile(r"~/\.ember/[\w./-]*ca\.pem")


def server_default_state_dir() -> str:
    args = build_parser().parse_args(["server"])
    return "~/" + str(args.state_dir.relative_to(Path.home()))


def test_every_page_names_the_ca_file_ember_server_writes() -> None:
    expected = f"{server_default_state_dir()}/ca.pem"
    assert expected == "~/.ember/server/ca.pem"
    found = {
        (path.relative_to(ROOT).as_posix(), match)
        for path in SOURCES
        for match in HOME_PATH.findall(path.read_text())
    }
    assert found, "no page names the CA file"
    assert {hit for hit in found if hit[1] != expected} == set()


def test_the_readme_says_where_the_app_name_comes_from() -> None:
    text = (ROOT / "README.md").read_text()
    assert "ember deploy app.py --name app" in text
    assert "name comes from its folder" in text
