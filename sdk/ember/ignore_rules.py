"""`.emberignore`: files of an app folder that `ember deploy` leaves out of the bundle
(data sets, checkpoints, notebooks' outputs), in a subset of `.gitignore`'s syntax:

- one pattern per line; blank lines and lines starting with `#` are skipped;
- a pattern without a `/` matches a file or folder name at any depth (`*.ckpt`, `data`);
- a pattern with a `/` matches the path from the app folder (`/notes/draft.md`,
  `outputs/*.png`); `**` matches any number of folders;
- a trailing `/` matches folders only; a leading `!` takes a file back in;
- the last pattern that matches decides.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ember.errors import BundleError

IGNORE_FILE = ".emberignore"
MAX_RULES = 1000


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern[str]
    anchored: bool  # matched against the whole relative path, not the name
    folders_only: bool
    negated: bool


def _translate(glob: str) -> str:
    """A glob as a regular expression: `*` and `?` stay within a path segment, `**`
    crosses them."""
    out = []
    index = 0
    while index < len(glob):
        char = glob[index]
        if glob.startswith("**/", index):
            out.append("(?:.*/)?")
            index += 3
            continue
        if glob.startswith("**", index):
            out.append(".*")
            index += 2
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[":
            end = glob.find("]", index + 1)
            if end < 0:
                out.append(re.escape(char))
            else:
                body = glob[index + 1 : end].replace("\\", "\\\\")
                out.append(f"[^{body[1:]}]" if body.startswith("!") else f"[{body}]")
                index = end
        else:
            out.append(re.escape(char))
        index += 1
    return "".join(out)


def parse_rules(text: str) -> list[Rule]:
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        line = line.removeprefix("!")
        folders_only = line.endswith("/")
        line = line.rstrip("/")
        anchored = "/" in line
        line = line.lstrip("/")
        if not line:
            continue
        rules.append(Rule(re.compile(_translate(line) + r"\Z"), anchored, folders_only, negated))
        if len(rules) > MAX_RULES:
            raise BundleError(f"{IGNORE_FILE} has more than {MAX_RULES} patterns")
    return rules


def load_rules(app_dir: Path) -> list[Rule]:
    path = app_dir / IGNORE_FILE
    if not path.is_file():
        return []
    try:
        return parse_rules(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise BundleError(f"cannot read {path}: {exc}") from None


def ignored(rules: list[Rule], relative_path: str, is_folder: bool) -> bool:
    """Whether the file or folder at `relative_path` (POSIX, from the app folder) is left
    out. A folder left out takes its files with it (they are never walked)."""
    name = relative_path.rsplit("/", 1)[-1]
    verdict = False
    for rule in rules:
        if rule.folders_only and not is_folder:
            continue
        if rule.pattern.match(relative_path if rule.anchored else name):
            verdict = not rule.negated
    return verdict


def leaves_out(rules: list[Rule], relative_path: str) -> bool:
    """Whether the file at `relative_path` is left out, by itself or by a folder above."""
    parts = relative_path.split("/")
    folders = ("/".join(parts[:depth]) for depth in range(1, len(parts)))
    return any(ignored(rules, folder, True) for folder in folders) or ignored(
        rules, relative_path, False
    )
