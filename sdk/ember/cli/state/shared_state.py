"""`ember dict APP/NAME [KEY [VALUE]]` and `ember queue APP/NAME`: look at and change an
app's ember.Dict and ember.Queue from the shell."""

from __future__ import annotations

import argparse
import json
import queue
from typing import Any

from ember.cli.common import app_and_name, positive_number, seconds_or_zero
from ember.errors import InvalidError
from ember.state.shared_state import Dict, Queue


def register(commands: argparse._SubParsersAction) -> None:
    dicts = commands.add_parser(
        "dict",
        help="read or change an app's ember.Dict",
        description="With APP/NAME alone, list the dict's keys (all of them); with a KEY, "
        "print its value; with a KEY and a JSON VALUE, set it (--ttl: it expires); "
        "KEY --delete removes it; --clear alone removes every key.",
    )
    dicts.add_argument("target", metavar="APP/NAME")
    dicts.add_argument("key", nargs="?", metavar="KEY")
    dicts.add_argument("value", nargs="?", metavar="JSON", help="the value to set, as JSON")
    dicts.add_argument("--ttl", type=positive_number, metavar="S", help="it expires after S s")
    dicts.add_argument("--delete", action="store_true", help="remove KEY")
    dicts.add_argument("--clear", action="store_true", help="remove every key")
    dicts.set_defaults(run=run_dict)
    queues = commands.add_parser(
        "queue",
        help="read or change an app's ember.Queue",
        description="With APP/NAME alone, print the queue's length.",
    )
    queues.add_argument("target", metavar="APP/NAME")
    action = queues.add_mutually_exclusive_group()
    action.add_argument("--put", metavar="JSON", help="append a value")
    action.add_argument("--get", action="store_true", help="take the oldest value and print it")
    action.add_argument("--clear", action="store_true", help="remove every value")
    queues.add_argument(
        "--timeout",
        type=seconds_or_zero,
        default=0.0,
        metavar="S",
        help="--get waits up to S s for a value (default: 0, no wait)",
    )
    queues.set_defaults(run=run_queue)


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidError(f"{text!r} is not JSON ({exc}); quote a string: '\"text\"'") from None


class _Missing:
    """No value: unlike None, which a key may hold."""


def _check_dict_arguments(args: argparse.Namespace) -> None:
    """Flags that would otherwise be ignored, or do more than asked, are refused."""
    if args.clear and (args.key is not None or args.delete or args.ttl is not None):
        raise InvalidError("--clear removes every key: give it alone, with APP/NAME")
    if args.delete and (args.key is None or args.value is not None or args.ttl is not None):
        raise InvalidError("--delete removes one KEY: give the KEY and no value")
    if args.ttl is not None and args.value is None:
        raise InvalidError("--ttl is for setting a KEY to a VALUE")


def run_dict(args: argparse.Namespace) -> int:
    _check_dict_arguments(args)
    app, name = app_and_name(args.target)
    shared = Dict(name, app=app)
    if args.clear:
        print(f"removed {shared.clear()} keys from {app}/{name}")
    elif args.key is None:
        for key in shared:
            print(key)
    elif args.delete:
        if shared.pop(args.key, _Missing) is _Missing:
            raise InvalidError(f"{app}/{name} has no key {args.key!r}")
        print(f"removed {args.key!r}")
    elif args.value is not None:
        shared.put(args.key, _parse(args.value), ttl=args.ttl)
    else:
        value = shared.get(args.key, _Missing)
        if value is _Missing:
            raise InvalidError(f"{app}/{name} has no key {args.key!r}")
        print(json.dumps(value))
    return 0


def run_queue(args: argparse.Namespace) -> int:
    app, name = app_and_name(args.target)
    shared = Queue(name, app=app)
    if args.put is not None:
        shared.put(_parse(args.put))
    elif args.get:
        try:
            print(json.dumps(shared.get(timeout=args.timeout)))
        except queue.Empty:
            raise InvalidError(f"{app}/{name} is empty") from None
    elif args.clear:
        print(f"removed {shared.clear()} values from {app}/{name}")
    else:
        print(len(shared))
    return 0
