"""Helpers shared by the CLI commands: the admin HTTP client and output."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import stat
import sys
import time
import unicodedata
from collections.abc import Iterator
from typing import Any

import httpx

from ember.calling.client import error_from_response
from ember.calling.connections import platform_client
from ember.config import ClientConfig, load_config
from ember.declarations.node_labels import parse_node_label
from ember.declarations.settings import check_name
from ember.errors import InvalidError


def app_name(text: str) -> str:
    """An argparse type: an app's name, checked before it goes into a URL path."""
    try:
        return check_name("app", text)
    except InvalidError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def app_and_name(target: str) -> tuple[str, str]:
    """(app, name) of an `APP/NAME` argument: an app's dict, queue or volume."""
    app, _, name = target.partition("/")
    if not app or not name:
        raise InvalidError(f"{target!r}: name it as APP/NAME")
    return app, name


def ago(timestamp: float) -> str:
    """How long ago a Unix time was, for a table: "just now", "5m ago", "3h ago", "2d ago"."""
    seconds = time.time() - timestamp
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit} ago"
    return "just now"


UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400}


def byte_size(count: int) -> str:
    """A byte count for people: 1.5 GB, 12.0 MB, 4.1 kB, 512 B."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def duration(text: str) -> float:
    """An argparse type: seconds from `30s`, `10m`, `2h`, `1d` (or a bare number of seconds)."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in UNITS else (text, "s")
    try:
        seconds = float(number) * UNITS[unit]
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not an age like 30s, 10m, 2h or 1d")
    return seconds


def node_label(text: str) -> tuple[str, str]:
    """An argparse type: one `KEY=VALUE` node label."""
    try:
        return parse_node_label(text)
    except InvalidError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_number(text: str) -> float:
    """An argparse type: a finite number above zero (sizes, seconds)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def seconds_or_zero(text: str) -> float:
    """An argparse type: a finite number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return value


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 to 65535 (0 lets the system pick one)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65_535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0 to 65535)")
    return port


def admin_client(config: ClientConfig | None = None, timeout: float | None = 60.0) -> httpx.Client:
    return platform_client(config or load_config(), timeout)


def check(response: httpx.Response, expected: tuple[int, ...] = (200,)) -> Any:
    """The response's JSON, or the platform's error raised as a RemoteError."""
    if response.status_code not in expected:
        raise error_from_response(response.status_code, response.content)
    return response.json()


def add_all_workspaces(parser: argparse.ArgumentParser) -> None:
    """A listing's `--all-workspaces`: the operator's view of every workspace."""
    parser.add_argument(
        "--all-workspaces",
        action="store_true",
        help="list every workspace's, with a WORKSPACE column (an admin token only)",
    )


def listing_params(args: argparse.Namespace, params: dict[str, str]) -> dict[str, str]:
    """A listing's query: `params`, and every workspace when `--all-workspaces` asks."""
    return {**params, "all_workspaces": "true"} if args.all_workspaces else params


def with_workspaces(
    args: argparse.Namespace, items: list[dict[str, Any]], rows: list[list[str]], header: list[str]
) -> tuple[list[list[str]], list[str]]:
    """A listing's table with each item's workspace first under `--all-workspaces`."""
    if not args.all_workspaces:
        return rows, header
    shown = [[item["workspace"], *row] for item, row in zip(items, rows, strict=True)]
    return shown, ["WORKSPACE", *header]


def table(rows: list[list[str]], header: list[str]) -> str:
    """Columns lined up as a terminal shows them: wide (CJK) characters take two
    cells, and control characters are escaped (they would move or colour the terminal)."""
    cells = [[_printable(str(c)) for c in row] for row in [header, *rows]]
    widths = [max(_width(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        padded = (c + " " * (w - _width(c)) for c, w in zip(row, widths, strict=True))
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


def _printable(text: str) -> str:
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _width(text: str) -> int:
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def json_object(text: str, what: str, example: str) -> dict[str, Any]:
    """Keyword arguments given on the command line: a JSON object, or a clear error."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidError(f"{what} must be JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidError(f"{what} must be a JSON object, e.g. '{example}'")
    return value


class OutputFile:
    """The file -o PATH names, opened before the call is sent: a path that cannot be
    written fails before anything runs, not after the result came. It is overwritten
    only as the result arrives: a command that fails first leaves a file that was there
    untouched and removes one it made."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        existed = os.path.lexists(self.path)
        try:
            # No O_TRUNC: what was there is kept until there is something to replace it.
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o666)
        except OSError as exc:
            raise output_error(self.path, exc) from None
        self._file = os.fdopen(fd, "wb")
        self._created = not existed
        # A pipe or a device (-o /dev/stdout) has no length to cut.
        self._regular = stat.S_ISREG(os.fstat(fd).st_mode)
        self.written = 0

    def write(self, data: bytes) -> None:
        try:
            self._file.write(data)
            self._file.flush()
        except OSError as exc:
            raise output_error(self.path, exc) from None
        self.written += len(data)

    def close(self, succeeded: bool) -> None:
        """Cut what an earlier, longer file left past the new data; or, when the command
        failed before writing anything, leave the file as it was (removed, if it was made
        for this command)."""
        try:
            if self._regular and (succeeded or self.written):
                self._file.truncate()
            self._file.close()
            if not succeeded and not self.written and self._created:
                os.unlink(self.path)
        except OSError as exc:
            raise output_error(self.path, exc) from None


def output_error(path: str, exc: OSError) -> InvalidError:
    return InvalidError(f"cannot write {path}: {exc.strerror or exc}")


@contextlib.contextmanager
def output_file(path: str | os.PathLike[str] | None) -> Iterator[OutputFile | None]:
    """An OutputFile for -o PATH (None without one), closed as the command ends."""
    if path is None:
        yield None
        return
    output = OutputFile(path)
    try:
        yield output
    except BaseException:
        with contextlib.suppress(InvalidError):  # the command's own error matters more
            output.close(succeeded=False)
        raise
    output.close(succeeded=True)


def write_result(result: Any, output: OutputFile | None) -> None:
    """JSON to the terminal; a file result's bytes to --output or a pipe, never a terminal."""
    data = result if isinstance(result, bytes) else None
    if output is not None:
        output.write(data if data is not None else json.dumps(result).encode() + b"\n")
        size = len(data) if data is not None else None
        print(
            f"wrote {output.path}" + (f" ({size} bytes)" if size is not None else ""),
            file=sys.stderr,
        )
    elif data is None:
        print(json.dumps(result, indent=2))
    elif sys.stdout.isatty():
        raise InvalidError(
            f"the result is a file of {len(data)} bytes: write it with -o PATH, or pipe it"
        )
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()


def _stop_requested(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    """Ctrl+C and SIGTERM raise KeyboardInterrupt, so a command cleans up as it ends. Set
    by the command itself: a process a shell starts in the background inherits SIGINT
    ignored, and would never stop otherwise."""
    signal.signal(signal.SIGINT, _stop_requested)
    signal.signal(signal.SIGTERM, _stop_requested)
