"""A throwaway PostgreSQL for the tests: Debian's `postgresql` package (infra/install.sh
--test installs it), a cluster made by `initdb` in a temporary folder and started by
`pg_ctl` on a free loopback port, once per test session, and a fresh database per test.

PostgreSQL refuses to run as root, and the tests run as root in CI: there the cluster
belongs to `nobody`, in a folder of its own."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

USER = "nobody"  # the cluster's owner when the tests run as root
ROLE = "ember"  # the database role the tests connect as (trusted: loopback only)
START_TIMEOUT_S = 60


class ClusterError(Exception):
    """PostgreSQL could not be started here; the message says why."""


def postgres_bin() -> Path:
    """The newest installed PostgreSQL's programs."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: [int(n) for n in re.findall(r"\d+", p.parent.parent.name)],
    )
    if not found:
        raise ClusterError(
            "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb): "
            "run `bash infra/install.sh --test`, or apt-get install postgresql"
        )
    return found[-1].parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PostgresCluster:
    def __init__(self) -> None:
        self.bin = postgres_bin()
        self.root = Path(tempfile.mkdtemp(prefix="ember-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self._as_user: list[str] = []
        self._names = itertools.count(1)
        if os.geteuid() == 0:
            if shutil.which("runuser") is None:
                raise ClusterError("running as root, and there is no runuser to start it as nobody")
            shutil.chown(self.root, USER)
            self._as_user = ["runuser", "-u", USER, "--"]
        self.root.chmod(0o700)

    def _run(self, *args: str) -> None:
        command = [*self._as_user, str(self.bin / args[0]), *args[1:]]
        done = subprocess.run(
            command, cwd=self.root, capture_output=True, text=True, timeout=START_TIMEOUT_S
        )
        if done.returncode != 0:
            log = self.root / "server.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise ClusterError(
                f"{args[0]} failed ({done.returncode}): {done.stderr.strip()[-2000:]}\n{tail}"
            )

    def start(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", ROLE, "-A", "trust", "-E", "UTF8")
        self.start_server()

    def start_server(self) -> None:
        """The server on the cluster's data (again, after `stop_server`)."""
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root}"
            # Throwaway data: no need to reach the disk.
            " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-w",
            "-t", str(START_TIMEOUT_S), "-o", options, "start",
        )  # fmt: skip

    def url(self, database: str) -> str:
        return f"postgresql://{ROLE}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A database of its own for one test: its URL."""
        import psycopg

        name = f"test_{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop_server(self, mode: str = "fast") -> None:
        """The server stopped, its connections cut (`fast` keeps what was committed;
        `immediate` is a crash, and this cluster's commits are not synchronous)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self.stop_server("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def start_cluster() -> PostgresCluster:
    """A running cluster (ClusterError, saying why, if it cannot start)."""
    cluster = PostgresCluster()
    try:
        cluster.start()
    except (ClusterError, OSError, subprocess.TimeoutExpired) as error:
        cluster.stop()
        raise ClusterError(f"PostgreSQL did not start: {error}") from None
    return cluster
