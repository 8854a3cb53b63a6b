"""Channels over a Unix socket: the node-local way to reach the control plane.

The control plane's local worker, and its replicas, open their WebSocket channels over a
Unix socket the control plane listens on, instead of loopback TCP with TLS: the frames
then skip the TCP stack and the encryption, which cost the control plane more CPU per
input than anything else it does. Channels still present their bearer tokens.

A name that starts with "@" is in Linux's abstract namespace (no file to leave behind,
no path length limit of the state dir); any other name is a path.
"""

from __future__ import annotations

import contextlib
import os
import socket

ABSTRACT_PREFIX = "@"
# What the WebSocket handshake names as host: the socket, not a URL, says where it goes.
CHANNEL_HOST = "ws://localhost"


def socket_address(name: str) -> str:
    """The address `bind` and `connect` take for a socket name."""
    return "\0" + name.removeprefix(ABSTRACT_PREFIX) if name.startswith(ABSTRACT_PREFIX) else name


def new_abstract_name() -> str:
    """A name no other control plane on this machine (or network namespace) holds."""
    return f"{ABSTRACT_PREFIX}ember-channels-{os.getpid()}-{os.urandom(6).hex()}"


def listen(name: str, backlog: int = 2048, mode: int = 0o600) -> socket.socket:
    """A listening socket at `name`. A path is made afresh (an earlier run's file goes),
    with `mode` (0600: only this user's processes may connect), bound through its
    folder's descriptor, whatever the length of the folder's path."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if name.startswith(ABSTRACT_PREFIX):
            sock.bind(socket_address(name))
        else:
            folder = os.open(os.path.dirname(name) or ".", os.O_RDONLY | os.O_DIRECTORY)
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.basename(name), dir_fd=folder)
                sock.bind(f"/proc/self/fd/{folder}/{os.path.basename(name)}")
                os.chmod(os.path.basename(name), mode, dir_fd=folder)
            finally:
                os.close(folder)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def connected(name: str) -> socket.socket:
    """A socket connected to the control plane's, for a WebSocket client to take over.

    The connect of a local socket does not wait on anything remote, so it is done here
    (blocking) rather than through the event loop: uvloop does not take abstract names.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_address(name))
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock
