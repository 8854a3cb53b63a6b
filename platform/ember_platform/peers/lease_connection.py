"""The leases' own connection to PostgreSQL (not the state store's), used from one
thread, a keeper's (`peers/leadership.py`, `peers/app_ownership.py`): made again after a
failure, and every failure said as `LeaseUnavailable`, so that a slow or lost database
delays renewals, never the event loop."""

from __future__ import annotations

from typing import Any

import psycopg

from ember_platform.storage.postgres.dialect import shown


class LeaseUnavailable(Exception):
    """The database could not be asked (the message says why)."""


class LeaseConnection:
    def __init__(self, url: str, *, timeout: float, name: str) -> None:
        self.url = url
        self.timeout = timeout
        self.name = name  # its application_name, as the database's sessions show it
        self._conn: psycopg.Connection[Any] | None = None

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            if self._conn is not None:
                self._conn.close()
            try:
                self._conn = psycopg.connect(
                    self.url,
                    autocommit=True,
                    connect_timeout=max(1, round(self.timeout)),
                    application_name=self.name,
                )
            except psycopg.OperationalError as error:
                raise LeaseUnavailable(
                    f"cannot reach {shown(self.url)}: {str(error).strip()}"
                ) from None
        return self._conn

    def run(self, query: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        """The statement's rows (none for one that returns none)."""
        try:
            cursor = self._connection().execute(query, params)
            return cursor.fetchall() if cursor.description is not None else []
        except psycopg.Error as error:
            if self._conn is not None and not self._conn.closed:
                self._conn.close()  # made again next time: a statement may be half-sent
            raise LeaseUnavailable(
                f"{shown(self.url)}: {str(error).strip().splitlines()[0]}"
            ) from None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
