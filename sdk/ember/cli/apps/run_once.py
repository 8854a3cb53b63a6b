"""`ember run FILE.py ENDPOINT '{json}'` (or `FILE.py::ENDPOINT`, Modal's form, or just
`FILE.py` when it has one endpoint): deploy the file as an app of its own, call one
endpoint once with the replicas' output shown as it comes, print the result, and stop
the app: a one-off job (a data pass, an evaluation) on the platform's nodes."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import secrets
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx

from ember.calling.client import Endpoint
from ember.cli.apps.deploy import default_app_name, deploy
from ember.cli.apps.logs import format_entry
from ember.cli.calling.call import add_file_options, call_arguments, write_stream
from ember.cli.common import admin_client, check, output_file, stop_on_signals, write_result
from ember.config import ClientConfig, load_config
from ember.declarations.settings import check_name, normalize_name
from ember.errors import InvalidError
from ember.helper_threads import start_helper_thread
from ember.wire.labels import make_label
from ember.wire.spec import FUNCTION_METHOD

# Replica output, not the platform's notes about starting and stopping replicas.
SHOWN_STREAMS = ("stdout", "stderr")
# Replicas' output reaches the platform in batches, a tenth of a second apart: lines
# printed just before the answer are waited for this long.
LAST_LINES_SECONDS = 0.5
STOP_TIMEOUT_SECONDS = 15.0


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "run",
        help="deploy a file, call one endpoint once, stop it",
        description="Deploy FILE.py as an app of its own (named after the file, with a "
        "random suffix), call ENDPOINT (or ENDPOINT/METHOD) once with the keyword "
        "arguments given as a JSON object, show what its replicas print while it runs, "
        "print the result, and stop the app (Ctrl+C stops it too). The endpoint may be "
        "named as FILE.py::ENDPOINT too (Modal's form), or left out when the file has one.",
    )
    parser.add_argument("file", metavar="FILE.py[::ENDPOINT]")
    parser.add_argument("endpoint", nargs="?", metavar="ENDPOINT[/METHOD]")
    parser.add_argument("arguments", nargs="?", metavar="'{json}'")
    parser.add_argument("--stream", action="store_true", help="read it as a stream")
    add_file_options(parser, "--file-argument")  # --file would read as the FILE.py
    parser.add_argument(
        "--keep", action="store_true", help="leave the app deployed afterwards (and say its name)"
    )
    parser.set_defaults(run=run)


def run_target(
    file: str, endpoint: str | None, arguments: str | None
) -> tuple[Path, str | None, str, str]:
    """(file, endpoint or None for the file's only one, method, JSON arguments) from the
    command's words: `FILE.py ENDPOINT[/METHOD] ARGS`, `FILE.py::ENDPOINT[.METHOD] ARGS` or
    `FILE.py ARGS` (a second word that is a JSON object, @FILE or - is the arguments)."""
    path, found, named = file.partition("::")
    if found:
        if endpoint is not None and arguments is not None:
            raise InvalidError(
                f"{file} names the endpoint already: give only the arguments after it"
            )
        arguments = endpoint if arguments is None else arguments
        endpoint = named.replace(".", "/", 1) if named else None
    elif endpoint is not None and arguments is None and _is_arguments(endpoint):
        endpoint, arguments = None, endpoint
    name, method = None, ""
    if endpoint is not None:
        name, _, method = endpoint.partition("/")
        # A Python spelling (`round_trip`) is the endpoint deployed as `round-trip`.
        check_name("endpoint", name if re.search(r"[^\w-]", name) else normalize_name(name))
    return Path(path), name, method, "{}" if arguments is None else arguments


def _is_arguments(word: str) -> bool:
    """A JSON object, @FILE or - (standard input): never an endpoint's name."""
    return word.lstrip().startswith(("{", "@")) or word == "-"


def chosen_endpoint(file: Path, name: str | None, names: set[str]) -> str:
    """The deployed endpoint the run calls: the one named (in its Python spelling too,
    `round_trip` for `round-trip`), or the file's only one."""
    listed = ", ".join(sorted(names))
    if name is None:
        if len(names) == 1:
            return next(iter(names))
        first = sorted(names)[0] if names else "ENDPOINT"
        raise InvalidError(
            f"{file} has {len(names)} endpoints ({listed}): name one, as in "
            f"`ember run {file}::{first}`"
        )
    for spelling in (name, normalize_name(name)):
        if spelling in names:
            return spelling
    raise InvalidError(f"{file} has no endpoint {name!r} (it has: {listed})")


def run(args: argparse.Namespace) -> int:
    file, name, method, args.arguments = run_target(args.file, args.endpoint, args.arguments)
    kwargs = call_arguments(args)
    # A suffix keeps two runs of one file, and a deployed app of that name, apart.
    app = check_name("app", f"{default_app_name(file)[:38].rstrip('-')}-{secrets.token_hex(4)}")
    config = load_config()
    stop_on_signals()  # Ctrl+C and `kill` stop the app
    deployed = False
    # -o is opened before the deploy: a path that cannot be written fails before anything runs.
    with output_file(args.output) as output:
        try:
            names = {e["name"] for e in deploy(file, app, config)["endpoints"]}
            deployed = True
            chosen = chosen_endpoint(file, name, names)
            endpoint = Endpoint(make_label(app, chosen), config, method or FUNCTION_METHOD)
            with _replica_output(app, config):
                if args.stream:
                    write_stream(endpoint.stream(**kwargs), output)
                else:
                    write_result(endpoint.call(**kwargs), output)
        except KeyboardInterrupt:
            # The call's connection closes with the command, which cancels it.
            what = f"stopping app {app}" if deployed and not args.keep else "the call is cancelled"
            print(f"\ninterrupted: {what}", file=sys.stderr)
            raise
        finally:
            if deployed and not args.keep:
                _stop_app(app, config)
            elif deployed:
                print(f"app {app} is still deployed (`ember stop {app}` stops it)", file=sys.stderr)
    return 0


def _stop_app(app: str, config: ClientConfig) -> None:
    """Stop the run's app, or say how to, without hiding the run's own outcome."""
    try:
        # Bounded: after Ctrl+C the command should end soon, whatever the platform does.
        with admin_client(config, timeout=STOP_TIMEOUT_SECONDS) as client:
            check(client.delete(f"/v1/apps/{app}"))
    except KeyboardInterrupt:  # a second Ctrl+C: leave at once, saying what is left
        print(f"app {app} may still be deployed; `ember stop {app}` stops it", file=sys.stderr)
        raise
    except Exception as exc:  # the run's own result or error matters more
        print(f"could not stop app {app} ({exc}); `ember stop {app}` stops it", file=sys.stderr)


@contextlib.contextmanager
def _replica_output(app: str, config: ClientConfig) -> Iterator[None]:
    """Print the app's replica output to stderr while the body runs."""
    follower = _LogFollower(app, config)
    thread = start_helper_thread(follower.run, "ember-run-logs")
    try:
        yield
    finally:
        follower.stop(wait=LAST_LINES_SECONDS)
        thread.join(timeout=5)


class _LogFollower:
    """Follows an app's log stream on a helper thread until stopped. Closing a client
    does not wake a thread blocked reading its socket; shutting the socket down does."""

    def __init__(self, app: str, config: ClientConfig) -> None:
        self.app = app
        self.client = admin_client(config, timeout=None)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._socket: socket.socket | None = None

    def run(self) -> None:
        # The app is new: all of its history is this run's, from before the follow began.
        params = {"tail": "100000", "follow": "1"}
        # Whatever ends the read (stop() shutting the socket, the platform going away),
        # this thread only shows output: the command's own calls report failures.
        with (
            contextlib.suppress(httpx.HTTPError, OSError, ValueError),
            self.client,
            self.client.stream("GET", f"/v1/apps/{self.app}/logs", params=params) as response,
        ):
            stream = response.extensions.get("network_stream")
            with self._lock:
                if self._stopped.is_set():
                    return
                if stream is not None:
                    self._socket = stream.get_extra_info("socket")
            for line in response.iter_lines():
                if self._stopped.is_set():
                    return
                if line.strip():
                    entry = json.loads(line)
                    if entry.get("stream") in SHOWN_STREAMS:
                        print(format_entry(entry), file=sys.stderr, flush=True)

    def stop(self, wait: float) -> None:
        """Stop after `wait` seconds, for the lines still on their way."""
        self._stopped.wait(wait)
        with self._lock:
            self._stopped.set()
            if self._socket is not None:
                with contextlib.suppress(OSError):
                    self._socket.shutdown(socket.SHUT_RDWR)
