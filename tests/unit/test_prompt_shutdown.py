"""Which connections a stopping server drops at once: idle (or closing) HTTP ones with
nothing left to send, never a request in flight or a WebSocket."""

from __future__ import annotations

from dataclasses import dataclass

from ember_platform.http.https_server import drop_idle_connections


@dataclass
class Transport:
    buffered: int = 0
    closing: bool = False
    aborted: bool = False

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def abort(self) -> None:
        self.aborted = True


@dataclass
class Cycle:
    response_complete: bool


class HttpConnection:
    def __init__(self, cycle: Cycle | None, transport: Transport) -> None:
        self.cycle = cycle
        self.transport = transport


class WebSocketConnection:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport


def test_only_idle_http_connections_with_nothing_to_send_are_dropped() -> None:
    never_used = HttpConnection(None, Transport())
    answered = HttpConnection(Cycle(response_complete=True), Transport())
    in_flight = HttpConnection(Cycle(response_complete=False), Transport())
    still_sending = HttpConnection(Cycle(response_complete=True), Transport(buffered=10))
    already_closing = HttpConnection(None, Transport(closing=True))
    websocket = WebSocketConnection(Transport())
    connections = {never_used, answered, in_flight, still_sending, already_closing, websocket}
    assert drop_idle_connections(connections) == 3
    assert never_used.transport.aborted and answered.transport.aborted
    assert already_closing.transport.aborted  # it only waits for the peer's close_notify
    for kept in (in_flight, still_sending, websocket):
        assert not kept.transport.aborted
