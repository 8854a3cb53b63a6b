"""`ember call LABEL '{json}'`: call an endpoint from the shell."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ember.calling.client import Endpoint
from ember.calling.priority import PRIORITIES
from ember.cli.common import (
    OutputFile,
    json_object,
    output_file,
    positive_number,
    write_result,
)
from ember.config import load_config
from ember.errors import InvalidError
from ember.wire.labels import label_in, meant_label
from ember.wire.spec import FUNCTION_METHOD


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "call",
        help="call an endpoint",
        description="Call APP--ENDPOINT (or APP--ENDPOINT/METHOD) with keyword arguments given "
        "as a JSON object (@FILE reads it from FILE, - from standard input), and print the "
        "result; a streaming method prints one line per item.",
    )
    parser.add_argument("label", metavar="APP--ENDPOINT[/METHOD]")
    parser.add_argument("arguments", nargs="?", default="{}", metavar="'{json}' | @FILE | -")
    parser.add_argument(
        "--spawn", action="store_true", help="start it asynchronously; print the call id"
    )
    parser.add_argument(
        "--stream", action="store_true", help="read it as a server-sent-event stream"
    )
    add_file_options(parser, "--file")
    parser.add_argument(
        "--idempotency-key",
        metavar="KEY",
        help="with --spawn: the same KEY again gives the call it started, not a new one",
    )
    parser.add_argument(
        "--priority",
        choices=PRIORITIES,
        help="its place in the endpoint's queue: high calls are taken before normal ones "
        "(the default), and low ones after",
    )
    parser.add_argument(
        "--affinity",
        metavar="KEY",
        help="calls with the same KEY (a session, a user) go to the same replica while it "
        "has room, which keeps what it cached for them",
    )
    parser.add_argument(
        "--timeout",
        type=positive_number,
        metavar="S",
        help="the call's own limit: past S seconds (waiting and running) the platform "
        "stops it and answers 504",
    )
    parser.add_argument(
        "--webhook",
        metavar="URL",
        help="with --spawn: the platform POSTs the call's end to URL, signed (see `ember "
        "calls webhook-secret`)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    typed, _, method = args.label.partition("/")
    label = meant_label(typed)
    if label != typed:
        print(f"ember call: {typed} is labelled {label}", file=sys.stderr)
    kwargs = call_arguments(args)
    config = load_config()
    endpoint = Endpoint(label_in(config.workspace, label), config, method or FUNCTION_METHOD)
    for flag, value in (("--idempotency-key", args.idempotency_key), ("--webhook", args.webhook)):
        if value is not None and not args.spawn:
            raise InvalidError(f"{flag} goes with --spawn")
    if args.spawn:
        handle = endpoint.spawn(
            _idempotency_key=args.idempotency_key,
            _webhook=args.webhook,
            _priority=args.priority,
            _affinity=args.affinity,
            _timeout=args.timeout,
            **kwargs,
        )
        print(handle.call_id)
        return 0
    with output_file(args.output) as output:
        if args.stream:
            stream = endpoint.stream(
                _priority=args.priority, _affinity=args.affinity, _timeout=args.timeout, **kwargs
            )
            write_stream(stream, output)
        else:
            result = endpoint.call(
                _priority=args.priority, _affinity=args.affinity, _timeout=args.timeout, **kwargs
            )
            write_result(result, output)
    return 0


def add_file_options(parser: argparse.ArgumentParser, file_flag: str) -> None:
    """-f NAME=PATH (as `file_flag`) and -o PATH, as `ember call` and `ember run` take them."""
    parser.add_argument(
        "-f",
        file_flag,
        dest="files",
        action="append",
        default=[],
        type=file_argument,
        metavar="NAME=PATH",
        help="send the file at PATH as argument NAME, for a bytes parameter (repeatable)",
    )
    parser.add_argument(
        "-o",
        "--output",
        metavar="PATH",
        help="write the result there: the bytes of a file result, or the JSON",
    )


def call_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON object of keyword arguments, with the files -f names."""
    kwargs = json_object(argument_text(args.arguments), "the arguments", '{"text": "hi"}')
    for name, data in args.files:
        if name in kwargs:
            raise InvalidError(f"argument {name!r} is given twice (in the JSON and by --file)")
        kwargs[name] = data
    return kwargs


def argument_text(given: str) -> str:
    """The JSON as given, or read from @FILE or from standard input (-), as curl's -d."""
    if given == "-":
        try:
            return sys.stdin.read()
        except UnicodeDecodeError:
            raise not_text("standard input") from None
    if given.startswith("@"):
        path = Path(given[1:])
        try:
            return path.read_text(encoding="utf-8")
        except OSError as exc:
            raise InvalidError(f"cannot read the arguments from {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise not_text(str(path)) from None
    return given


def not_text(source: str) -> InvalidError:
    # A file of other bytes (an image) is sent to a bytes parameter, not as the JSON.
    return InvalidError(
        f"the arguments in {source} are not UTF-8 text: give a JSON object, and send a "
        "file to a bytes parameter with -f NAME=PATH"
    )


def file_argument(text: str) -> tuple[str, bytes]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    try:
        return name, Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror}") from None


def write_stream(items: Iterator[Any], output: OutputFile | None) -> None:
    """A JSON line per event, or a file's bytes chunk by chunk, to --output or stdout."""
    for item in items:
        if not isinstance(item, bytes):
            item = json.dumps(item).encode() + b"\n"
        elif output is None and sys.stdout.isatty():
            raise InvalidError("the stream is a file: write it with -o PATH, or pipe it")
        if output is not None:
            output.write(item)
        else:
            sys.stdout.buffer.write(item)
            sys.stdout.flush()
