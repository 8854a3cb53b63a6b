"""`ember`: the command line. Each command lives in its own module."""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
from collections.abc import Sequence

import httpx

from ember.cli import server, worker
from ember.cli.apps import canary, deploy, history, logs, ls, openapi, run_once, scale, serve, stop
from ember.cli.calling import bench, call, calls, map_inputs
from ember.cli.ops import (
    dashboard,
    image,
    node,
    profile,
    replica,
    secret,
    snapshot,
    token,
    usage,
    workspace,
)
from ember.cli.state import shared_state, volume
from ember.errors import EmberError

COMMANDS = (
    server,
    deploy,
    canary,
    serve,
    ls,
    logs,
    call,
    calls,
    map_inputs,
    run_once,
    bench,
    scale,
    stop,
    history,
    openapi,
    secret,
    shared_state,
    token,
    workspace,
    usage,
    volume,
    worker,
    node,
    replica,
    profile,
    snapshot,
    image,
    dashboard,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ember",
        description="Ember: serverless model endpoints that start from snapshots.",
        epilog="Start with `ember server`, then `ember deploy app.py`. "
        "`ember COMMAND --help` explains each command.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        module.register(commands)
    return parser


EXIT_BROKEN_PIPE = 128 + 13  # as a shell reports a command ended by SIGPIPE


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush at exit finds no
    closed pipe to complain of."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status = int(args.run(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the exit
        return status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Its reader went away (`ember logs app | head`): stop quietly, as other tools do.
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except EmberError as exc:
        print(f"ember: {exc}", file=sys.stderr)
        return 1
    except httpx.TransportError as exc:  # e.g. the server stopped in the middle of a stream
        print(
            f"ember: the connection to the Ember server failed: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    status = main()
    # Left is the interpreter's teardown, whose collections walk every object the
    # imports made (a tenth of a second of CPU, on each command's and the server's
    # exit); frozen, they are skipped, and what they would free, the exit frees.
    gc.freeze()
    sys.exit(status)
