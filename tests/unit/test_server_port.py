"""A server started from code with a port no socket can have is refused plainly."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ember.errors import ConfigError
from ember_platform.config import ServerConfig
from ember_platform.server import Server


@pytest.mark.parametrize("port", [70000, 65536, -1])
def test_a_port_outside_0_to_65535_is_a_config_error_naming_it(tmp_path: Path, port: int) -> None:
    server = Server(ServerConfig(state_dir=tmp_path, port=port, local_worker=False))
    with pytest.raises(ConfigError, match=f"port {port} is not a TCP port"):
        asyncio.run(server.serve())
