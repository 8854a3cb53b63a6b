"""The documentation stays true: the CLI reference matches the parser, every relative link
and every repository path the pages name exists, and the README and the architecture page
keep to their size and stay inside the repository."""

from __future__ import annotations

import importlib.util
import re
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
ARCHITECTURE = DOCS / "architecture.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

README_MAX_LINES = 220
ARCHITECTURE_MAX_LINES = 400

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.MULTILINE)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# A path into one of the repository's own folders, as pages name files: `sdk/ember/...`.
REPOSITORY_PATH = re.compile(
    r"(?:sdk|platform|worker|examples|bench|infra|tests|docs)/[\w.\-/]*\Z", re.ASCII
)
# The packages, whose folders the architecture page gives a section each.
PACKAGES = ("sdk/ember", "platform/ember_platform", "worker/ember_worker")
PACKAGE_FOLDER = re.compile(r"(?:sdk/ember|platform/ember_platform|worker/ember_worker)[\w/]*\Z")
# A module or folder named by itself inside its folder's section: `boot.py`, `replicas/`.
LOCAL_NAME = re.compile(r"[\w.-]+(?:\.py|/)\Z")
# Absolute paths of a machine's folders, which a reader's checkout does not have.
MACHINE_PATH = re.compile(
    r"(?<![\w.}\]>~-])/(?:home|root|tmp|usr|var|etc|opt|srv|mnt|work|Users|proc|dev|sys)\b"
)


def prose(text: str) -> str:
    """`text` without its fenced code blocks, whose brackets and backticks are code."""
    return FENCE.sub("", text)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: the text without markup, lower case, punctuation
    other than '-' and '_' dropped, spaces as '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors_of(page: Path) -> frozenset[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for match in HEADING.finditer(prose(page.read_text())):
        base = anchor(match.group(2))
        seen = counts.get(base, 0)
        counts[base] = seen + 1
        found.add(base if seen == 0 else f"{base}-{seen}")  # GitHub numbers repeats
    return frozenset(found)


@cache
def generator() -> ModuleType:
    """docs/gen_cli_reference.py, a script rather than a package's module."""
    path = DOCS / "gen_cli_reference.py"
    spec = importlib.util.spec_from_file_location("gen_cli_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of `page` whose file, or anchor in it, does not exist (or is
    outside `root`)."""
    problems = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # https:, mailto: and the like: not the repository's to check
        path_part, _, fragment = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if path_part.startswith("/") or not linked.is_relative_to(root):
            problems.append(f"{target} (outside the repository)")
        elif not linked.exists():
            problems.append(f"{target} (no such file)")
        elif fragment and linked.suffix == ".md" and fragment not in anchors_of(linked):
            problems.append(f"{target} (no heading #{fragment} in {linked.name})")
    return problems


def missing_paths(page: Path) -> list[str]:
    """Each repository path `page` names in backticks that is not in the checkout."""
    named = {span for span in CODE_SPAN.findall(prose(page.read_text()))}
    return sorted(
        path
        for path in named
        if REPOSITORY_PATH.match(path) and not (ROOT / path.rstrip("/")).exists()
    )


def test_the_cli_reference_matches_the_parser() -> None:
    reference = DOCS / "cli.md"
    assert reference.exists(), "docs/cli.md is missing: run python docs/gen_cli_reference.py"
    if reference.read_text() != generator().render():
        pytest.fail(
            "docs/cli.md no longer matches the ember parser's options: "
            "run python docs/gen_cli_reference.py and commit docs/cli.md"
        )


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_relative_links_point_at_files_and_headings_that_exist(page: Path) -> None:
    problems = broken_links(page)
    assert not problems, f"{page.relative_to(ROOT)} has broken links: {problems}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_repository_paths_named_in_the_docs_exist(page: Path) -> None:
    missing = missing_paths(page)
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_the_readme_stays_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"
    )


def test_the_architecture_page_is_short_and_stands_alone() -> None:
    text = ARCHITECTURE.read_text()
    lines = len(text.splitlines())
    assert lines <= ARCHITECTURE_MAX_LINES, (
        f"docs/architecture.md has {lines} lines (at most {ARCHITECTURE_MAX_LINES})"
    )
    assert "../" not in text, "docs/architecture.md points outside the repository (../)"
    assert not MACHINE_PATH.findall(text), (
        f"docs/architecture.md names absolute paths: {MACHINE_PATH.findall(text)}"
    )
    assert "```mermaid" in text, "docs/architecture.md lost its Mermaid diagram"


def folder_sections(text: str) -> dict[str, list[str]]:
    """The architecture page's sections titled by a package folder (`### worker/...`), each
    with the file and folder names it spells in backticks (`boot.py`, `replicas/`)."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in prose(text).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip()
            current = sections.setdefault(title, []) if PACKAGE_FOLDER.match(title) else None
        elif current is not None:
            current += [span for span in CODE_SPAN.findall(line) if LOCAL_NAME.match(span)]
    return sections


def package_folders() -> list[str]:
    """The three packages and each folder directly inside them."""
    found = []
    for package in PACKAGES:
        found.append(package)
        found += [
            str(init.parent.relative_to(ROOT))
            for init in sorted((ROOT / package).glob("*/__init__.py"))
        ]
    return found


def test_the_architecture_page_has_a_true_section_per_package_folder() -> None:
    sections = folder_sections(ARCHITECTURE.read_text())
    missing = [folder for folder in package_folders() if folder not in sections]
    assert not missing, f"docs/architecture.md has no section (### FOLDER) for {missing}"
    for folder, names in sections.items():
        where = ROOT / folder
        assert where.is_dir(), f"docs/architecture.md has a section for {folder}, now gone"
        gone = [
            name
            for name in names
            if not (where / name).exists() and not any(where.rglob(name.rstrip("/")))
        ]
        assert not gone, f"docs/architecture.md's section {folder} names {gone}, not there"


def test_the_diagrams_name_modules_that_exist() -> None:
    diagrams = "\n".join(re.findall(r"```mermaid\n(.*?)```", ARCHITECTURE.read_text(), re.DOTALL))
    modules = [
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
    ]
    named = set(re.findall(r"[\w/]+\.py", diagrams))
    gone = sorted(name for name in named if not any(m.endswith("/" + name) for m in modules))
    assert named and not gone, f"docs/architecture.md's diagrams name {gone}, not there"


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[ok](#title) [gone](#nowhere) [file](missing.md) [web](https://x.org)\n"
        "[up](../elsewhere.md) `sdk/no_such_module.py` `sdk/ember/`\n"
        "```sh\n[not a link](nowhere.md)\n```\n"
    )
    assert broken_links(page, root=tmp_path) == [
        "#nowhere (no heading #nowhere in page.md)",
        "missing.md (no such file)",
        "../elsewhere.md (outside the repository)",
    ]
    assert missing_paths(page) == ["sdk/no_such_module.py"]
    assert MACHINE_PATH.findall("see /home/me/x and /v1/calls/{id}") == ["/home"]
    assert anchor("Every `@ember.endpoint` setting") == "every-emberendpoint-setting"
    sections = folder_sections("### sdk/ember/wire\n`spec.py` and `gone.py`, `ember.wire`\n")
    assert sections == {"sdk/ember/wire": ["spec.py", "gone.py"]}
