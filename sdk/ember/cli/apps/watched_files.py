"""The files `ember serve` watches: those its deploy bundles (`.emberignore` and the
caches `ember deploy` leaves out are left out here too), less those `.gitignore` names
(logs, outputs: a file git does not track is no edit of the code) and those the serving
process itself writes (`ember serve app.py > serve.log` in the app's folder)."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ember.bundle import bundled_files
from ember.errors import BundleError
from ember.ignore_rules import Rule, leaves_out, parse_rules

GIT_IGNORE_FILE = ".gitignore"
# A file is known by its device and inode: a log opened for our output is the same file
# under whatever name the folder shows it.
FileId = tuple[int, int]


@dataclass(frozen=True)
class GitIgnore:
    """One `.gitignore`: its patterns, and the app folder's path from the folder that
    holds it (patterns are relative to their own file's folder)."""

    rules: list[Rule]
    prefix: str  # "" for the app folder's own; "examples/app/" for one two levels up

    def leaves_out(self, relative: str) -> bool:
        return leaves_out(self.rules, self.prefix + relative)


def load_git_ignores(folder: Path) -> list[GitIgnore]:
    """The `.gitignore` files of `folder` and of the folders above it up to its git
    repository's root (only its own when it is in no repository). Nested ones below
    `folder` and a later file taking back (`!`) what an earlier one named are not read."""
    folder = folder.resolve()
    chain = [folder, *folder.parents]
    in_repository = any((parent / ".git").exists() for parent in chain)
    ignores = []
    for parent in chain:
        path = parent / GIT_IGNORE_FILE
        if path.is_file():
            try:
                rules = parse_rules(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, BundleError):
                rules = []  # git polices its own file: one we cannot read ignores nothing
            prefix = folder.relative_to(parent).as_posix()
            ignores.append(GitIgnore(rules, "" if prefix == "." else prefix + "/"))
        if not in_repository or (parent / ".git").exists():
            break
    return ignores


def own_outputs() -> frozenset[FileId]:
    """The regular files this process's stdout and stderr write to (a child's deploy
    inherits them): writing there is no change to watch."""
    found = set()
    for fd in (1, 2):
        try:
            status = os.fstat(fd)
        except OSError:
            continue
        if stat.S_ISREG(status.st_mode):
            found.add((status.st_dev, status.st_ino))
    return frozenset(found)


def watched_mtimes(
    folder: Path, ignores: list[GitIgnore], outputs: frozenset[FileId] = frozenset()
) -> dict[Path, float] | None:
    """Each watched file with its modification time; None while the folder is changing
    under the walk (a folder removed midway): the caller looks again."""
    mtimes = {}
    try:
        for relative, source in bundled_files(folder):
            if any(ignore.leaves_out(relative) for ignore in ignores):
                continue
            try:
                status = source.stat()
            except FileNotFoundError:
                continue  # gone between the listing and the look (an editor's swap file)
            if (status.st_dev, status.st_ino) in outputs:
                continue
            mtimes[folder / relative] = status.st_mtime
    except BundleError:
        return None
    return mtimes
