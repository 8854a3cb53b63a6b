"""The client's failover between the servers of one platform, against real HTTP(S)
servers on loopback: a server that refuses connections is skipped (and stays skipped), a
connection closed during the TLS handshake is tried again, and a connection cut before
the answer is sent again only for requests that may run twice."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ember.calling.connections import platform_client
from ember.calling.failover import closed_in_handshake
from ember.config import ClientConfig
from ember.errors import ConnectionCutError, ServerUnreachableError
from ember_platform.security.tls import ensure_tls


def read_method(conn: socket.socket) -> str:
    """The method of the request that arrives on `conn` ("" if none came), its body read
    too: a close with part of the request unread would send a reset, not the answer (on
    a loaded machine the body may come after the head)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length and (chunk := conn.recv(65536)):
        body += chunk
    return head.split(b" ", 1)[0].decode()


def answer(conn: socket.socket, status: bytes, body: bytes) -> None:
    conn.sendall(
        b"HTTP/1.1 "
        + status
        + b"\r\nConnection: close\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


class CuttingServer:
    """Answers 200 with the request's method, after cutting the first `cuts` connections
    as soon as their request arrived (a process killed mid-call)."""

    def __init__(self, cuts: int = 0) -> None:
        self.cuts = cuts
        self.handovers = 0  # requests answered 503 control_plane_stopping first
        self.truncate = 0  # answers cut inside their body
        self.requests: list[str] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                method = read_method(conn)
                if not method:
                    continue
                self.requests.append(method)
                if self.cuts > 0:
                    self.cuts -= 1
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                    continue  # closed with a reset, unanswered
                status, body = b"200 OK", method.encode()
                if self.handovers > 0:
                    self.handovers -= 1
                    status = b"503 Service Unavailable"
                    body = b'{"error": {"type": "control_plane_stopping", "message": "retry"}}'
                if self.truncate > 0:
                    self.truncate -= 1
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{")
                    continue
                answer(conn, status, body)

    def close(self) -> None:
        self.sock.close()


def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"  # closed: connections refused


@pytest.fixture
def server() -> Iterator[CuttingServer]:
    live = CuttingServer()
    yield live
    live.close()


def config(*urls: str) -> ClientConfig:
    return ClientConfig(urls[0], "token", server_urls=urls if len(urls) > 1 else ())


def test_a_server_that_cannot_be_reached_is_skipped_for_the_next(server: CuttingServer) -> None:
    dead = dead_url()
    with platform_client(config(dead, server.url), timeout=10) as client:
        assert client.post("/a", json={}).text == "POST"  # nothing was sent to the dead one
        assert client.get("/b").text == "GET"
    assert server.requests == ["POST", "GET"]
    with (
        platform_client(config(dead), timeout=10) as client,
        pytest.raises(ServerUnreachableError, match="cannot reach the Ember server"),
    ):
        client.get("/c")


def test_a_cut_call_is_sent_again_only_when_it_may_run_twice() -> None:
    cutting = CuttingServer(cuts=1)
    try:
        with platform_client(config(cutting.url), timeout=10) as client:
            with pytest.raises(ConnectionCutError, match="may or may not have run"):
                client.post("/call", json={})
            assert cutting.requests == ["POST"]
            cutting.cuts = 1
            keyed = client.post("/spawn", json={}, headers={"Idempotency-Key": "job-1"})
            assert keyed.text == "POST" and cutting.requests == ["POST", "POST", "POST"]
            cutting.cuts = 2
            assert client.get("/v1/calls/x").text == "GET"
            assert cutting.requests[-3:] == ["GET", "GET", "GET"]
            # A process that stopped in order answers the calls it held 503: sent again
            # the same way.
            cutting.handovers = 1
            assert client.get("/v1/calls/y").text == "GET"
            cutting.handovers = 1
            assert client.post("/call", json={}).status_code == 503
            # Cut inside the answer's body: the same error.
            cutting.truncate = 1
            with pytest.raises(ConnectionCutError):
                client.post("/call", json={})
    finally:
        cutting.close()


def _read_record(conn: socket.socket) -> None:
    """One whole TLS record (a ClientHello): a close with part of it unread would send a
    reset, not the end of the stream a process that lost its lease sends (on a loaded
    machine the hello may come in two segments)."""
    head = b""
    while len(head) < 5 and (got := conn.recv(5 - len(head))):
        head += got
    left = int.from_bytes(head[3:5], "big") if len(head) == 5 else 0
    while left > 0 and (got := conn.recv(left)):
        left -= len(got)


class HandshakeCuttingServer:
    """A TLS server that closes the first `cuts` connections after reading the client's
    first handshake bytes (a process that lost its lease as the connection came), then
    answers 200 with the request's method."""

    def __init__(self, state_dir: Path, cuts: int) -> None:
        tls = ensure_tls(state_dir, hosts=["127.0.0.1"])
        self.ca = str(tls.ca_cert)
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(tls.server_cert, tls.server_key)
        self.cuts = cuts
        self.connections = 0
        self.requests: list[str] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"https://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            if self.cuts > 0:
                self.cuts -= 1
                with conn:
                    _read_record(conn)  # the ClientHello, unanswered
                continue
            try:
                with self.context.wrap_socket(conn, server_side=True) as tls:
                    method = read_method(tls)
                    self.requests.append(method)
                    answer(tls, b"200 OK", method.encode())
            except (OSError, ssl.SSLError):
                continue

    def close(self) -> None:
        self.sock.close()


def test_a_connection_closed_in_the_tls_handshake_is_tried_again_whatever_the_call(
    tmp_path: Path,
) -> None:
    server = HandshakeCuttingServer(tmp_path, cuts=2)
    try:
        tls_config = ClientConfig(server.url, "token", ca_cert=server.ca)
        with platform_client(tls_config, timeout=10) as client:
            # A POST without an idempotency key: none of it was sent, so it goes again.
            assert client.post("/call", json={}).text == "POST"
            assert server.connections == 3 and server.requests == ["POST"]
            server.cuts = 10  # a server that never finishes a handshake: said so, soon
            with pytest.raises(ServerUnreachableError, match=f"cannot reach .*{server.url}"):
                client.get("/v1/apps")
    finally:
        server.close()


def test_a_handshake_cut_is_told_from_a_refusal_and_other_tls_errors() -> None:
    eof = ssl.SSLEOFError(8, "EOF occurred in violation of protocol")
    wrapped = httpx.ConnectError("[SSL: UNEXPECTED_EOF_WHILE_READING]")
    wrapped.__cause__ = eof
    assert closed_in_handshake(wrapped)
    assert closed_in_handshake(httpx.ConnectError("reset")) is False
    refused = httpx.ConnectError("refused")
    refused.__cause__ = ConnectionRefusedError(111, "Connection refused")
    assert not closed_in_handshake(refused)
    untrusted = httpx.ConnectError("certificate verify failed")
    untrusted.__cause__ = ssl.SSLCertVerificationError(1, "certificate verify failed")
    assert not closed_in_handshake(untrusted)
