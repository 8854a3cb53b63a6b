"""The platform's lease in PostgreSQL: which control-plane process owns the platform (every
endpoint's queue and dispatch, scheduling, schedules, webhook retries, garbage) and where
the others reach it.

One statement takes or renews it, atomically and on the database's clock: a row that is
this process's, or whose time is up, becomes this process's until `now() + ttl`; any
other row stays as it is and is read back to say who owns it. Machines' clocks never
meet. The holder counts its own time from *before* it sent the renewal, on its monotonic
clock, and stops acting as owner a margin before that time is up (`PlatformLease.valid_for`),
so it has stopped before the database lets anyone else take over.

Its connection is the leases' own (`peers/lease_connection.py`)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from ember_platform.peers.lease_connection import LeaseConnection, LeaseUnavailable

PLATFORM = "platform"  # its row in the leases table, keyed by name (the apps' are there too)

TAKE = """
INSERT INTO leases (name, holder, holder_url, expires_at, term)
VALUES (%(name)s, %(holder)s, %(url)s, EXTRACT(EPOCH FROM clock_timestamp()) + %(ttl)s, 1)
ON CONFLICT (name) DO UPDATE SET
    holder = EXCLUDED.holder,
    holder_url = EXCLUDED.holder_url,
    expires_at = EXCLUDED.expires_at,
    term = CASE WHEN leases.holder = EXCLUDED.holder THEN leases.term ELSE leases.term + 1 END
WHERE leases.holder = EXCLUDED.holder
   OR leases.expires_at < EXTRACT(EPOCH FROM clock_timestamp())
RETURNING term"""

READ = """
SELECT holder, holder_url, term,
       expires_at - EXTRACT(EPOCH FROM clock_timestamp())
FROM leases WHERE name = %(name)s"""

# Ends this holder's lease at once (an orderly stop): the next taker need not wait it out.
RELEASE = "UPDATE leases SET expires_at = 0 WHERE name = %(name)s AND holder = %(holder)s"


@dataclass(frozen=True)
class LeaseState:
    held: bool  # by this process, until `valid_until` (monotonic)
    holder: str | None  # the holder's id (None: nobody's, or the database unread)
    holder_url: str | None  # where the holder serves (its advertised URL)
    term: int  # bumped each time the lease changes hands
    expired: bool = False  # the holder's time is up (it died, or stopped in order)
    valid_until: float = 0.0  # for the holder: when it must stop acting (monotonic)


class PlatformLease:
    """Takes, renews, reads and releases one named lease for one holder."""

    def __init__(
        self,
        database_url: str,
        holder: str,
        holder_url: str,
        *,
        ttl: float,
        margin: float,
        name: str = PLATFORM,
    ) -> None:
        if not 0 < margin < ttl:
            raise ValueError(f"the lease's margin ({margin} s) must be within its ttl ({ttl} s)")
        self.holder = holder
        self.holder_url = holder_url
        self.ttl = ttl
        self.margin = margin
        self.name = name
        self.db = LeaseConnection(database_url, timeout=ttl, name="ember-lease")

    def take(self) -> LeaseState:
        """Take the lease or renew it; else who holds it. LeaseUnavailable when the
        database cannot be asked (then this process must count itself as not holding it
        once its last `valid_until` passes)."""
        sent = time.monotonic()
        params = {"name": self.name, "holder": self.holder, "url": self.holder_url}
        taken = self.db.run(TAKE, {**params, "ttl": self.ttl})
        if taken:
            valid_until = sent + self.ttl - self.margin
            return LeaseState(
                True, self.holder, self.holder_url, int(taken[0][0]), valid_until=valid_until
            )
        found = self.db.run(READ, params)
        current = found[0] if found else None
        if current is None:  # released and deleted meanwhile: nobody's
            return LeaseState(False, None, None, 0)
        holder, url, term, left = current
        return LeaseState(False, str(holder), str(url), int(term), expired=float(left) < 0)

    def release(self) -> None:
        """Give the lease up now, if this holder has it (an orderly stop)."""
        # Not reached: it ends by itself within its ttl.
        with contextlib.suppress(LeaseUnavailable):
            self.db.run(RELEASE, {"name": self.name, "holder": self.holder})

    def close(self) -> None:
        self.db.close()
