"""The control plane's local worker: its process, kept running, and stopped with it.

Started as soon as the control plane's socket, TLS files and channel socket exist,
before the rest of the control plane is loaded: its own start (imports, node checks)
then runs beside the control plane's instead of after it. Its channel waits in the
channel socket's backlog until the control plane serves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ember.calling import unix_channel
from ember_platform.config import ServerConfig

log = logging.getLogger("ember.server")

# How long a local worker that exited waits before it is restarted, for a signal that
# stops this server too to arrive.
WORKER_EXIT_GRACE_SECONDS = 0.2
REPLICA_SOCKET = "replica-channels.sock"  # in the state dir


class LocalWorker:
    """One `python -m ember_worker` at a time, with the token and channel socket it uses."""

    def __init__(self, config: ServerConfig, url: str, ca_cert: Path) -> None:
        self.config = config
        self.url = url
        self.ca_cert = ca_cert
        # Known to this control plane only; its token registry takes it before serving.
        self.token = "emb_local_" + os.urandom(24).hex()
        # The local worker's channels, and its replicas', skip TCP and TLS.
        self.channel_socket = unix_channel.new_abstract_name()
        self.listening: socket.socket = unix_channel.listen(self.channel_socket)
        # Sandboxed replicas have networks of their own, where the abstract socket is
        # out of reach: theirs is a file the worker mounts into each sandbox (open to
        # every uid there; the state dir keeps it from the node's other users).
        self.replica_socket = str(config.state_dir / REPLICA_SOCKET)
        self.replica_listening = unix_channel.listen(self.replica_socket, mode=0o666)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.config.worker_dir.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "ember_worker",
            "--server",
            self.url,
            "--ca-cert",
            str(self.ca_cert),
            "--work-dir",
            str(self.config.worker_dir),
            "--name",
            "local",
            "--channel-socket",
            self.channel_socket,
            "--replica-channel-socket",
            self.replica_socket,
            "--lifeline",
        ]
        if self.config.lazy_restore:
            command.append("--lazy-restore")
        if self.config.local_worker_gpus is not None:
            command += ["--gpus", self.config.local_worker_gpus]
        command += self.config.local_worker_options
        env = {**os.environ, "EMBER_WORKER_TOKEN": self.token}
        # stdin is the lifeline: the worker exits when this process goes away.
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, env=env)

    async def supervise(self, stopping: Callable[[], bool]) -> None:
        """Keep the local worker running: restart it (with backoff) if it dies, unless
        the server is stopping (a Ctrl+C in the terminal stops the worker too)."""
        backoff = 0.2
        started = time.monotonic()
        while True:
            if self.process is None:
                started = time.monotonic()
                self.start()
            process = self.process
            assert process is not None
            while process.poll() is None:
                await asyncio.sleep(0.1)
            # The worker may see the terminal's SIGINT before this process does.
            await asyncio.sleep(WORKER_EXIT_GRACE_SECONDS)
            if stopping():
                return
            log.error("the local worker exited with code %s; restarting it", process.returncode)
            backoff = 0.2 if time.monotonic() - started > 30 else min(backoff * 2, 10.0)
            await asyncio.sleep(backoff)
            if stopping():
                return
            self.process = None

    def stop(self) -> None:
        self.listening.close()
        self.replica_listening.close()
        worker = self.process
        if worker is None or worker.poll() is not None:
            return
        if worker.stdin is not None:
            with contextlib.suppress(OSError):
                worker.stdin.close()
        worker.terminate()
        try:
            worker.wait(timeout=15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
