"""`ember map LABEL inputs.jsonl`: one call per line of a file, results as JSON lines."""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ember.calling.client import Endpoint
from ember.cli.common import OutputFile, output_file, positive_number
from ember.errors import InvalidError, RemoteError
from ember.files import ReceivedFile
from ember.progress import Progress
from ember.wire.labels import checked_label

# Bad lines named in one error, before the rest are counted.
BAD_LINES_SHOWN = 5


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "map",
        help="call an endpoint once per line of a JSONL file",
        description="Call APP--ENDPOINT (or APP--ENDPOINT/METHOD) once for each line of "
        "INPUTS (a JSON object of keyword arguments per line; '-' reads stdin), many at "
        'once, and write one JSON line per input: {"index": N, "result": ...} or '
        '{"index": N, "error": {"status": ..., "type": ..., "message": ...}}; a file result '
        '(bytes or an ember.File) as {"index": N, "file": {"base64": ..., "size": BYTES, '
        '"media_type": ..., "filename": ... (when it has one)}}. '
        "Every line is checked before anything is sent. A full queue is waited out. The "
        "exit status is 1 when any input failed.",
    )
    parser.add_argument("label", metavar="APP--ENDPOINT[/METHOD]")
    parser.add_argument("inputs", metavar="INPUTS", help="a .jsonl file, or - for stdin")
    parser.add_argument(
        "-o", "--output", type=Path, metavar="FILE", help="write the results here, not stdout"
    )
    parser.add_argument(
        "-c",
        "--concurrency",
        type=int,
        default=32,
        metavar="N",
        help="calls in flight at once (default 32)",
    )
    parser.add_argument(
        "--unordered",
        action="store_true",
        help="write each result as it comes, not in input order",
    )
    parser.add_argument(
        "--timeout", type=positive_number, metavar="S", help="give up on one call after S s"
    )
    parser.set_defaults(run=run)


def read_inputs(stream: TextIO, name: str) -> list[dict[str, Any]]:
    """Every non-blank line as a JSON object; InvalidError naming the bad lines."""
    inputs: list[dict[str, Any]] = []
    bad: list[str] = []
    for number, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as exc:
            bad.append(f"line {number}: not JSON ({exc})")
            continue
        if not isinstance(value, dict):
            bad.append(f"line {number}: a JSON {type(value).__name__}, not an object")
            continue
        inputs.append(value)
    if bad:
        more = f" and {len(bad) - BAD_LINES_SHOWN} more" if len(bad) > BAD_LINES_SHOWN else ""
        raise InvalidError(
            f"{name}: each line must be a JSON object of keyword arguments; "
            + "; ".join(bad[:BAD_LINES_SHOWN])
            + more
            + ". Nothing was sent."
        )
    return inputs


def result_line(index: int, result: Any) -> dict[str, Any]:
    if isinstance(result, RemoteError):
        error = {"status": result.status, "type": result.error_type, "message": result.message}
        return {"index": index, "error": error}
    if isinstance(result, bytes):  # a file result (bytes, ember.File) has no JSON form
        encoded = base64.b64encode(result).decode("ascii")
        file: dict[str, Any] = {"base64": encoded, "size": len(result)}
        if isinstance(result, ReceivedFile):
            file["media_type"] = result.media_type
            if result.filename is not None:
                file["filename"] = result.filename
        return {"index": index, "file": file}
    return {"index": index, "result": result}


def run(args: argparse.Namespace) -> int:
    label, _, method = args.label.partition("/")
    app_and_endpoint = checked_label(label)
    if args.concurrency < 1:
        raise InvalidError(f"--concurrency must be at least 1, not {args.concurrency}")
    if args.inputs == "-":
        inputs = read_inputs(sys.stdin, "stdin")
    else:
        try:
            with open(args.inputs, encoding="utf-8") as stream:
                inputs = read_inputs(stream, args.inputs)
        except OSError as exc:
            raise InvalidError(f"cannot read {args.inputs}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise InvalidError(f"{args.inputs} is not UTF-8 text") from None
    with output_file(args.output) as output:
        # Unknown endpoints and bad tokens fail here once, not once per input.
        endpoint = Endpoint.lookup(*app_and_endpoint, method=method or None)
        began = time.monotonic()
        failed = write_results(endpoint, inputs, args, output)
    seconds = time.monotonic() - began
    print(
        f"ember map: {len(inputs)} inputs, {len(inputs) - failed} done, {failed} failed, "
        f"in {seconds:.1f} s ({len(inputs) / max(seconds, 1e-9):.1f}/s)",
        file=sys.stderr,
    )
    return 1 if failed else 0


def write_results(
    endpoint: Endpoint,
    inputs: list[dict[str, Any]],
    args: argparse.Namespace,
    output: OutputFile | None,
) -> int:
    """Call once per input and write a line per result; how many inputs failed."""
    progress = Progress(len(inputs), "map")
    results = endpoint.map(
        inputs,
        concurrency=args.concurrency,
        order_outputs=not args.unordered,
        return_exceptions=True,
        with_index=True,
        timeout=args.timeout,
    )
    failed = 0
    try:
        for index, result in results:
            ok = not isinstance(result, RemoteError)
            failed += 0 if ok else 1
            progress.update(ok)
            line = json.dumps(result_line(index, result))
            if output is not None:
                output.write(line.encode() + b"\n")
            else:
                print(line, flush=args.unordered)
    finally:
        progress.close()
    return failed
