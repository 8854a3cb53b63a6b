"""`ember worker --server URL --token T`: join this machine to a control plane."""

from __future__ import annotations

import argparse

from ember.errors import ConfigError


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "worker",
        help="join this machine as a worker node",
        description="Run a worker agent that registers with the control plane at --server and "
        "runs replicas on its command.",
    )
    try:
        from ember_worker.cli import add_arguments
    except ImportError:
        parser.set_defaults(run=_missing)
        return
    add_arguments(parser)
    parser.set_defaults(run=_run)


def _missing(args: argparse.Namespace) -> int:
    raise ConfigError("the worker is not installed: pip install 'ember[worker]'")


def _run(args: argparse.Namespace) -> int:
    from ember_worker.cli import run

    return run(args)
