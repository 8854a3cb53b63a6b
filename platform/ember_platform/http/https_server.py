"""uvicorn's HTTPS server, less a needless wait when it stops.

At shutdown uvicorn closes each idle keep-alive connection, and closing a TLS connection
waits for the peer's close_notify: a client whose pool merely holds the connection (an
SDK process, a worker between bundle fetches) never sends it, so every stop waited out
`timeout_graceful_shutdown` in full. Connections uvicorn closed earlier, for idling past
its keep-alive timeout, wait the same way (asyncio gives up after 30 s). Idle or closing
HTTP connections whose answers have all left are dropped instead; requests in flight keep
their graceful end, as do WebSockets.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import uvicorn


def drop_idle_connections(connections: Iterable[Any]) -> int:
    """Abort the HTTP connections with no request in flight and nothing left to send;
    how many there were."""
    dropped = 0
    for connection in list(connections):
        if not hasattr(connection, "cycle"):  # a WebSocket: its close handshake is kept
            continue
        cycle = connection.cycle
        transport = getattr(connection, "transport", None)
        if transport is None or (cycle is not None and not cycle.response_complete):
            continue
        # One closing already waits for the peer's close_notify too (uvicorn closes a
        # connection idle past its keep-alive timeout the same way): dropped as well.
        if transport.get_write_buffer_size():
            continue
        transport.abort()
        dropped += 1
    return dropped


class PromptShutdownServer(uvicorn.Server):
    async def shutdown(self, sockets: Any = None) -> None:
        drop_idle_connections(self.server_state.connections)
        await super().shutdown(sockets)
