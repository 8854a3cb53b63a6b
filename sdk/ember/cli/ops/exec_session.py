"""`ember replica exec -i` and `-t`: a command typed at while it runs, over a WebSocket.

What this process reads is sent as it comes (a helper thread reads standard input); with
`-t` the local terminal is put in raw mode, so every key (Ctrl+C, Ctrl+D, arrows) goes to
the command's pseudo-terminal, and a change of the window's size follows it there. The
command's output is written as it arrives, and its exit status is returned.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator
from typing import Any

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from ember.calling.tlsclient import client_context
from ember.config import ClientConfig
from ember.errors import ServerUnreachableError
from ember.helper_threads import start_helper_thread

READ_BYTES = 16 * 1024
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
OPEN_ATTEMPTS = 3


def _websocket_url(config: ClientConfig, replica_id: str) -> str:
    base = config.server_url.rstrip("/")
    scheme, _, rest = base.partition("://")
    return f"{'wss' if scheme == 'https' else 'ws'}://{rest}/v1/replicas/{replica_id}/exec"


@contextlib.contextmanager
def _raw_terminal(fd: int) -> Iterator[None]:
    """The local terminal in raw mode (keys go through as typed), restored after."""
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd, termios.TCSANOW)  # not TCSAFLUSH: keys typed ahead are kept
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _window_size() -> list[int]:
    """The size of the terminal keys come from, as ssh reads it: of the terminal itself,
    not $LINES and $COLUMNS, which a parent may have set for its own (shutil's first
    choice); those, or 24x80, only when standard input is not a terminal."""
    try:
        size = os.get_terminal_size(sys.stdin.fileno())
    except (OSError, ValueError):
        size = shutil.get_terminal_size()
    return [size.lines, size.columns]


def _forward_input(connection: ClientConnection) -> None:
    """Standard input to the command, as it comes, then the end of it."""
    with contextlib.suppress(ConnectionClosed, OSError):
        while chunk := os.read(sys.stdin.fileno(), READ_BYTES):
            connection.send(chunk)
        connection.send(json.dumps({"eof": True}))


def open_session(
    connect_once: Callable[[], ClientConnection],
    server_url: str,
    sleep: Callable[[float], None] = time.sleep,
) -> ClientConnection:
    """The WebSocket, tried again when a try is cut off before the server answered (seen:
    a TLS connection closed as the upgrade request went out). Nothing runs before the
    first message, so a try that failed started nothing; an HTTP answer (a refusal) is
    not tried again."""
    attempt = 1
    while True:
        try:
            return connect_once()
        except (OSError, ConnectionClosed) as exc:
            if attempt == OPEN_ATTEMPTS:
                raise ServerUnreachableError(f"cannot reach {server_url}: {exc}") from None
        sleep(0.25 * attempt)
        attempt += 1


def run_interactive(
    config: ClientConfig,
    replica_id: str,
    command: list[str],
    timeout: float | None,
    terminal: bool,
) -> int:
    """Run `command` beside the replica, typed at from here; its exit status."""
    request: dict[str, Any] = {"command": command, "timeout": timeout, "interactive": True}
    if terminal:
        request["terminal"] = _window_size()
    connection = open_session(
        lambda: connect(
            _websocket_url(config, replica_id),
            ssl=client_context(config.ca_cert) if config.server_url.startswith("https") else None,
            additional_headers={"Authorization": f"Bearer {config.token}"},
            max_size=MAX_MESSAGE_BYTES,
            open_timeout=30,
        ),
        config.server_url,
    )
    with connection:
        with contextlib.suppress(ConnectionClosed):  # a refusal says why, read below
            connection.send(json.dumps(request))
        previous_winch = None
        if terminal:
            previous_winch = signal.signal(
                signal.SIGWINCH,
                lambda *_: connection.send(json.dumps({"resize": _window_size()})),
            )
        raw = _raw_terminal(sys.stdin.fileno()) if terminal else contextlib.nullcontext()
        try:
            with raw:
                start_helper_thread(lambda: _forward_input(connection), "ember-exec-input")
                return _show_output(connection)
        finally:
            if previous_winch is not None:
                signal.signal(signal.SIGWINCH, previous_winch)


def show_event(event: dict[str, Any], line_end: str = "\n") -> int | None:
    """Write one event of a command's answer where it belongs; once it is the end, the
    exit status to give (1 when the command could not run or was stopped)."""
    if "data" in event:
        out = sys.stderr if event.get("stream") == "stderr" else sys.stdout
        out.flush()
        out.buffer.write(base64.b64decode(event["data"]))
        out.buffer.flush()
        return None
    if event.get("error"):
        print(f"ember replica exec: {event['error']}", end=line_end, file=sys.stderr)
    code = event.get("exit_code")
    return 1 if code is None else int(code)


def _show_output(connection: ClientConnection) -> int:
    try:
        for message in connection:
            code = show_event(json.loads(message), "\r\n")  # the terminal may be raw
            if code is not None:
                return code
    except ConnectionClosed:
        pass
    print("ember replica exec: the connection ended before the command did", file=sys.stderr)
    return 1
