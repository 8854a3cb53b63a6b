"""Where the worker's channels connect: the control plane's Unix socket when this node
has one (`--channel-socket`), else its HTTPS address."""

from __future__ import annotations

import sys
from typing import Any

from websockets.asyncio.client import connect

from ember.calling import unix_channel
from ember.calling.tlsclient import client_context


def websocket_url(server_url: str, path: str) -> str:
    base = server_url.rstrip("/")
    if base.startswith("https://"):
        base = "wss://" + base.removeprefix("https://")
    elif base.startswith("http://"):
        base = "ws://" + base.removeprefix("http://")
    return base + path


def open_channel(
    server_url: str,
    path: str,
    *,
    channel_socket: str | None,
    ca_cert: str | None,
    **options: Any,
) -> connect:
    """A WebSocket connection to `path`, ready to be entered (`async with`).

    A socket that cannot be reached (the control plane restarted meanwhile under a new
    name) falls back to the HTTPS address, with a line on stderr saying so.
    """
    if channel_socket:
        try:
            sock = unix_channel.connected(channel_socket)
        except OSError as exc:
            print(
                f"ember: the control plane's socket {channel_socket} is unreachable "
                f"({exc.strerror}); connecting over {server_url}",
                file=sys.stderr,
            )
        else:
            return connect(unix_channel.CHANNEL_HOST + path, sock=sock, **options)
    url = websocket_url(server_url, path)
    tls = client_context(ca_cert) if url.startswith("wss://") else None
    return connect(url, ssl=tls, **options)
