"""The Unix socket that node-local channels take, and the fallback to HTTPS."""

from __future__ import annotations

import asyncio
import socket
import stat
from pathlib import Path

import pytest
from websockets.asyncio.server import ServerConnection, serve

from ember.calling import unix_channel
from ember_worker.channel_url import open_channel, websocket_url


def test_abstract_names_map_to_a_leading_nul_and_paths_stay_paths() -> None:
    assert unix_channel.socket_address("@ember-x") == "\0ember-x"
    assert unix_channel.socket_address("/run/ember.sock") == "/run/ember.sock"
    first, second = unix_channel.new_abstract_name(), unix_channel.new_abstract_name()
    assert first.startswith("@ember-channels-") and first != second


@pytest.mark.parametrize("abstract", [True, False])
def test_a_listening_socket_takes_connections(tmp_path: Path, abstract: bool) -> None:
    name = unix_channel.new_abstract_name() if abstract else str(tmp_path / "channels.sock")
    with unix_channel.listen(name) as listening:
        if not abstract:  # only this user's processes may connect
            assert stat.S_IMODE(Path(name).stat().st_mode) == 0o600
        with unix_channel.connected(name) as client:
            listening.setblocking(True)
            accepted, _ = listening.accept()
            with accepted:
                client.setblocking(True)
                client.sendall(b"ping")
                assert accepted.recv(4) == b"ping"


def test_a_name_nobody_listens_on_cannot_be_connected_to() -> None:
    with pytest.raises(OSError):
        unix_channel.connected(unix_channel.new_abstract_name())


def test_listening_twice_on_one_name_fails() -> None:
    name = unix_channel.new_abstract_name()
    with unix_channel.listen(name), pytest.raises(OSError):
        unix_channel.listen(name)


def test_websocket_urls_follow_the_server_scheme() -> None:
    assert websocket_url("https://cp:8443/", "/v1/x") == "wss://cp:8443/v1/x"
    assert websocket_url("http://cp:80", "/v1/x") == "ws://cp:80/v1/x"


async def _echo_path(connection: ServerConnection) -> None:
    assert connection.request is not None
    await connection.send(connection.request.path)


def test_a_channel_goes_over_the_socket_when_it_is_there() -> None:
    async def scenario() -> str:
        name = unix_channel.new_abstract_name()
        # The HTTPS address is unreachable: only the socket can answer.
        async with (
            serve(_echo_path, sock=unix_channel.listen(name)),
            open_channel(
                "https://127.0.0.1:9", "/v1/workers/channel", channel_socket=name, ca_cert=None
            ) as connection,
        ):
            return str(await connection.recv())

    assert asyncio.run(scenario()) == "/v1/workers/channel"


def test_an_unreachable_socket_falls_back_to_the_server_url(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def scenario() -> str:
        listening = socket.create_server(("127.0.0.1", 0))
        port = listening.getsockname()[1]
        async with (
            serve(_echo_path, sock=listening),
            open_channel(
                f"http://127.0.0.1:{port}",
                "/v1/replicas/r-1/channel",
                channel_socket=unix_channel.new_abstract_name(),  # nobody listens there
                ca_cert=None,
            ) as connection,
        ):
            return str(await connection.recv())

    assert asyncio.run(scenario()) == "/v1/replicas/r-1/channel"
    assert "unreachable" in capsys.readouterr().err
