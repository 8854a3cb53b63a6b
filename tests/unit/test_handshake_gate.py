"""TLS handshakes in turn: a few at once, the waiting connections taken by address in
rotation, a connection that leaves while it waits passing its turn on; and through a
real TLS server: connections past the gate's width wait, their early bytes kept, and
every one is served."""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
from pathlib import Path
from typing import Any

import uvicorn

from ember.calling import eventloop
from ember_platform.http.handshake_gate import HandshakeGate
from ember_platform.http.https_server import GatewayLimits, PromptShutdownServer, limited_protocol


def test_a_few_at_once_then_addresses_in_rotation() -> None:
    async def scenario() -> None:
        gate = HandshakeGate(at_once=2)
        order: list[str] = []

        async def connection(name: str, address: str) -> None:
            await gate.turn(address)
            order.append(name)

        await connection("a1", "A")
        await connection("a2", "A")  # two at once: both go
        waiting = [
            asyncio.ensure_future(connection(name, name[0].upper()))
            for name in ("a3", "a4", "a5", "b1", "c1")
        ]
        await asyncio.sleep(0)
        assert order == ["a1", "a2"] and gate.waiting == 5
        gate.done()  # one handshake ended: the next in turn
        await asyncio.sleep(0)
        gate.done()
        await asyncio.sleep(0)
        gate.done()
        await asyncio.sleep(0)
        # A's third waited first; then B and C came before A's fourth.
        assert order == ["a1", "a2", "a3", "b1", "c1"]
        waiting[1].cancel()  # a4 leaves while it waits: a5 is next
        await asyncio.sleep(0)
        gate.done()
        await asyncio.sleep(0)
        assert order[-1] == "a5" and gate.waiting == 0
        assert gate.running == 2

    asyncio.run(scenario())


def _certificate(folder: Path) -> tuple[Path, Path]:
    key, cert = folder / "key.pem", folder / "cert.pem"
    command = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]
    command += ["-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=t"]
    command += ["-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(
        command,
        check=True,
        capture_output=True,
    )
    return key, cert


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        scheme = scope["scheme"].encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": scheme})


def test_connections_past_the_gate_wait_and_are_all_served(tmp_path: Path) -> None:
    key, cert = _certificate(tmp_path)

    async def scenario() -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            hello,
            ssl_certfile=str(cert),
            ssl_keyfile=str(key),
            http=limited_protocol(GatewayLimits()),
            lifespan="off",
            log_level="critical",
        )
        server = PromptShutdownServer(config)
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        client = ssl.create_default_context(cafile=str(cert))

        async def call() -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
            writer.write(b"GET / HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
            answer = await reader.read()
            writer.close()
            return answer

        answers = await asyncio.gather(*(call() for _ in range(40)))  # 8 at once, 40 in all
        assert all(a.startswith(b"HTTP/1.1 200") and b"https" in a for a in answers), answers[:1]
        # A client that connects and leaves before its turn costs nothing and breaks nothing.
        for _ in range(20):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"\x16\x03\x01")  # the start of a ClientHello, then gone
            writer.close()
        assert b"https" in await call()
        server.should_exit = True
        await serving

    eventloop.run(scenario())
