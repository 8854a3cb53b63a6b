"""Write docs/cli.md, the reference of every `ember` command, from the CLI's own parser.

    .venv/bin/python docs/gen_cli_reference.py           # rewrite docs/cli.md
    .venv/bin/python docs/gen_cli_reference.py --check   # exit 1 if docs/cli.md is stale

Nothing here declares an option: the page is read off `ember.cli.main.build_parser()`, so
it changes only when the parser does, and tests/unit/test_docs.py fails until the page is
written again. The usage lines are built here rather than by argparse's formatter, whose
wrapping follows the terminal's width and whose layout differs between Python versions.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ember.cli.main import build_parser

REFERENCE = Path(__file__).resolve().parent / "cli.md"
RAW_FORMATTERS = (argparse.RawDescriptionHelpFormatter, argparse.RawTextHelpFormatter)
CODE_SPAN = re.compile(r"(`[^`]*`)")
USAGE_WIDTH = 88

HEADER = """\
# CLI reference

Every `ember` command with its options, as `ember COMMAND --help` prints them. This page
is generated from the command's own argparse definitions: do not edit it by hand, run
`python docs/gen_cli_reference.py` after changing an option (a unit test fails until
then). Every command also takes `-h`/`--help`.
"""


@dataclass(frozen=True)
class Command:
    """One parser of the tree: `ember`, `ember calls`, `ember calls ls`."""

    words: tuple[str, ...]
    summary: str
    parser: argparse.ArgumentParser

    @property
    def name(self) -> str:
        return " ".join(self.words)


def subcommands(command: Command) -> list[Command]:
    """The commands directly under `command`, in the order they were registered."""
    found: list[Command] = []
    for action in command.parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            summaries = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for word, parser in action.choices.items():
                found.append(Command((*command.words, word), summaries.get(word, ""), parser))
    return found


def walk(command: Command) -> Iterator[Command]:
    yield command
    for child in subcommands(command):
        yield from walk(child)


def metavar_of(action: argparse.Action) -> str:
    if isinstance(action.metavar, tuple):
        return " ".join(action.metavar)
    if action.metavar is not None:
        return action.metavar
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        return "{" + ",".join(str(choice) for choice in action.choices) + "}"
    return action.dest.upper() if action.option_strings else action.dest


def with_values(name: str, action: argparse.Action) -> str:
    """`name` followed by what the action takes, as argparse's usage spells it."""
    metavar = metavar_of(action)
    nargs = action.nargs
    if nargs == 0:
        return name
    if nargs is None:
        values = metavar
    elif nargs == argparse.OPTIONAL:
        values = f"[{metavar}]"
    elif nargs == argparse.ZERO_OR_MORE:
        values = f"[{metavar} ...]"
    elif nargs == argparse.ONE_OR_MORE:
        values = f"{metavar} [{metavar} ...]"
    elif nargs == argparse.REMAINDER:  # argparse shows "...", unless a metavar says more
        values = metavar if action.metavar else "..."
    elif nargs == argparse.PARSER:
        values = f"{metavar} ..."
    else:
        values = " ".join([metavar] * int(nargs))
    return f"{name} {values}" if name else values


def visible(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        action
        for action in parser._actions
        if action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)
    ]


def usage(command: Command) -> str:
    """One line: the command, its options (exclusive ones grouped), then its arguments."""
    parser = command.parser
    actions = visible(parser)
    groups = {
        id(action): group
        for group in parser._mutually_exclusive_groups
        for action in group._group_actions
    }
    parts: list[str] = []
    seen_groups: set[int] = set()
    for action in actions:
        if not action.option_strings:
            continue
        group = groups.get(id(action))
        if group is None:
            text = with_values(action.option_strings[0], action)
            parts.append(text if action.required else f"[{text}]")
        elif id(group) not in seen_groups:
            seen_groups.add(id(group))
            members = " | ".join(
                with_values(member.option_strings[0], member)
                for member in group._group_actions
                if member.help != argparse.SUPPRESS
            )
            parts.append(f"({members})" if group.required else f"[{members}]")
    parts.extend(with_values("", action) for action in actions if not action.option_strings)
    return wrapped(command.name, parts)


def wrapped(name: str, parts: list[str]) -> str:
    """`name` and `parts` on lines of at most USAGE_WIDTH, later lines indented under the
    first part, as argparse lays out a long usage."""
    indent = " " * (len(name) + 1)
    lines = [name]
    for part in parts:
        if len(lines[-1]) + 1 + len(part) > USAGE_WIDTH and lines[-1].strip():
            lines.append(indent + part)
        else:
            lines[-1] += " " + part
    return "\n".join(lines)


def escaped(text: str, in_table: bool = False) -> str:
    """`text` as Markdown shows it literally: angle brackets and stars outside code spans
    escaped, and in a table every `|` (GitHub splits cells on one even inside code)."""
    pieces = []
    for piece in CODE_SPAN.split(text):
        if not piece.startswith("`"):
            piece = piece.replace("<", "&lt;").replace(">", "&gt;").replace("*", r"\*")
        if in_table:
            piece = piece.replace("|", r"\|")
        pieces.append(piece)
    return "".join(pieces)


def prose(text: str | None, parser: argparse.ArgumentParser) -> list[str]:
    """A description or epilog: as written when the parser keeps its layout, else one
    paragraph (argparse would re-wrap it to the terminal anyway)."""
    if not text:
        return []
    formatter = parser.formatter_class
    if isinstance(formatter, type) and issubclass(formatter, RAW_FORMATTERS):
        return ["```text", text.strip("\n"), "```", ""]
    return [escaped(" ".join(text.split())), ""]


def table(heading: str, rows: list[tuple[str, str]]) -> list[str]:
    lines = [f"| {heading} | description |", "|---|---|"]
    lines += [f"| {escaped(left, True)} | {escaped(right, True)} |" for left, right in rows]
    return [*lines, ""]


def help_of(action: argparse.Action, prog: str) -> str:
    """The action's help as `--help` shows it (`%(default)s` filled in, `%%` as `%`), on
    one line."""
    text = argparse.HelpFormatter(prog)._expand_help(action) if action.help else ""
    return " ".join(text.split())


def invocation(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{with_values('', action)}`"
    return ", ".join(f"`{with_values(name, action)}`" for name in action.option_strings)


def group_title(parser: argparse.ArgumentParser, group: argparse._ArgumentGroup) -> str:
    # argparse's own titles changed across Python versions ("optional arguments").
    if group is parser._positionals:
        return "Arguments"
    if group is parser._optionals:
        return "Options"
    return (group.title or "Options").capitalize()


def option_tables(parser: argparse.ArgumentParser) -> list[str]:
    shown = {id(action) for action in visible(parser)}
    lines: list[str] = []
    for group in parser._action_groups:
        rows = [
            (invocation(action), help_of(action, parser.prog))
            for action in group._group_actions
            if id(action) in shown and not isinstance(action, argparse._SubParsersAction)
        ]
        if rows:
            lines += [f"**{group_title(parser, group)}**", ""]
            lines += table("argument" if group is parser._positionals else "option", rows)
    return lines


def section(command: Command) -> list[str]:
    level = "#" * min(len(command.words), 3)
    lines = [f"{level} {command.name}", "", "```text", usage(command), "```", ""]
    lines += prose(command.parser.description or command.summary, command.parser)
    children = subcommands(command)
    if children:
        lines += table("command", [(f"`{child.name}`", child.summary) for child in children])
    lines += option_tables(command.parser)
    lines += prose(command.parser.epilog, command.parser)
    return lines


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def render() -> str:
    """The whole page, as docs/cli.md must hold it."""
    root = Command(("ember",), "", build_parser())
    commands = subcommands(root)
    lines = [HEADER, "## Commands", ""]
    lines += table("command", [(f"[`{c.name}`](#{anchor(c.name)})", c.summary) for c in commands])
    for command in walk(root):
        if command is not root:
            lines += section(command)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Write docs/cli.md from the ember parser.")
    parser.add_argument("--check", action="store_true", help="only say whether it is stale")
    args = parser.parse_args(argv)
    page = render()
    current = REFERENCE.read_text() if REFERENCE.exists() else ""
    if args.check:
        if current != page:
            print(f"{REFERENCE.name} is stale: run python docs/gen_cli_reference.py")
            return 1
        return 0
    if current != page:
        REFERENCE.write_text(page)
        print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
