"""The apps' leases in PostgreSQL: which control-plane process owns each deployed app,
spread over the live processes (`peers/app_spread.py`) and moved when one dies, joins or
stops in order.

They are rows of the platform lease's table, by name: `member:<holder>` says a process
is live (renewed each round, as a lease is), `app:<the app's key>` that it owns an app.
As with the platform lease, times are on the database's clock, and a holder counts its
own from *before* it sent a renewal, less a margin (`AppRound.valid_until`): it stops
acting for its apps before anyone may take them over. A lease changing hands bumps its
term, which a new owner's writes can carry to fence the old one's.

One round (`AppLeases.round`) renews and reads in one statement, then takes what the
spread says; what it says to give up is given up (`give_up`) once the process stopped
acting for it. All on the leases' own connection (`peers/lease_connection.py`)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from ember_platform.peers.app_spread import AppsView, moves
from ember_platform.peers.lease_connection import LeaseConnection, LeaseUnavailable

MEMBER = "member:"
APP = "app:"
NOW = "EXTRACT(EPOCH FROM clock_timestamp())"
# Rows of processes dead this long are removed (their apps' rows are reused by the next).
FORGET_MEMBERS_AFTER_S = 3600

# One statement a round: this process said live, its apps renewed, and what every process
# reads to spread the apps: the live leases and the deployed apps. (Its parts share one
# snapshot: the leases read are as they were before this round's renewals.)
ROUND = f"""
WITH beat AS (
    INSERT INTO leases (name, holder, holder_url, expires_at, term)
    VALUES (%(member)s, %(holder)s, %(url)s, {NOW} + %(ttl)s, 1)
    ON CONFLICT (name) DO UPDATE SET holder_url = EXCLUDED.holder_url,
        expires_at = EXCLUDED.expires_at
), renewed AS (
    UPDATE leases SET expires_at = {NOW} + %(ttl)s
    WHERE holder = %(holder)s AND name LIKE 'app:%%' AND expires_at > 0
    RETURNING name, term
)
SELECT 'renewed', name, '', '', term, 0 FROM renewed
UNION ALL
SELECT 'lease', name, holder, holder_url, term, expires_at - {NOW} FROM leases
WHERE name LIKE 'app:%%' OR name LIKE 'member:%%'
UNION ALL
SELECT DISTINCT 'deployed', app, '', '', 0, 0 FROM deployments
WHERE stopped = 0 AND withdrawn = 0"""

TAKE = f"""
INSERT INTO leases (name, holder, holder_url, expires_at, term)
SELECT name, %(holder)s, %(url)s, {NOW} + %(ttl)s, 1 FROM unnest(%(names)s::text[]) AS name
ON CONFLICT (name) DO UPDATE SET
    holder = EXCLUDED.holder,
    holder_url = EXCLUDED.holder_url,
    expires_at = EXCLUDED.expires_at,
    term = CASE WHEN leases.holder = EXCLUDED.holder THEN leases.term ELSE leases.term + 1 END
WHERE leases.holder = EXCLUDED.holder OR leases.expires_at < {NOW}
RETURNING name, term"""

# Given up (an app past this process's share, or no longer deployed), its row kept with
# its term for the next holder: a term never goes back while anyone may still act on it.
GIVE = "UPDATE leases SET expires_at = 0 WHERE holder = %(holder)s AND name = ANY(%(names)s)"
LEAVE = (
    "UPDATE leases SET expires_at = 0 WHERE holder = %(holder)s "
    "AND (name LIKE 'app:%%' OR name = %(member)s)"
)
# Rows of processes, and of apps, that ended long ago (an app's, whoever held it).
FORGET = (
    "DELETE FROM leases WHERE (name LIKE 'member:%%' OR name LIKE 'app:%%') "
    f"AND expires_at < {NOW} - %(after)s"
)
FORGET_EVERY_ROUNDS = 100


@dataclass(frozen=True)
class AppRound:
    """What one round found: the apps this process owns until `valid_until` (monotonic),
    with their terms, and where every owned app's owner serves."""

    owned: dict[str, int]  # app -> its lease's term
    owners: dict[str, str]  # app -> its live owner's URL (this process's apps too)
    members: int  # live processes
    valid_until: float
    # Apps to give up (past its share, or no longer deployed): no longer in `owned`, and
    # given up once this process stopped acting for them (`AppLeases.give_up`).
    to_give: frozenset[str] = field(default_factory=frozenset)


class AppLeases:
    def __init__(
        self, database_url: str, holder: str, holder_url: str, *, ttl: float, margin: float
    ) -> None:
        if not 0 < margin < ttl:
            raise ValueError(f"the lease's margin ({margin} s) must be within its ttl ({ttl} s)")
        self.holder = holder
        self.holder_url = holder_url
        self.ttl = ttl
        self.margin = margin
        self.db = LeaseConnection(database_url, timeout=ttl, name="ember-app-leases")
        self._rounds = 0

    def _params(self, **more: Any) -> dict[str, Any]:
        return {
            "holder": self.holder,
            "url": self.holder_url,
            "member": MEMBER + self.holder,
            "ttl": self.ttl,
            **more,
        }

    def round(self) -> AppRound:
        """Say this process is live, renew its apps, and take apps as the spread says
        (and say which to give up). LeaseUnavailable when the database cannot be asked:
        then this process owns nothing once its last `valid_until` passes."""
        sent = time.monotonic()
        owned: dict[str, int] = {}
        members: set[str] = {self.holder}
        holders: dict[str, str] = {}
        urls: dict[str, str] = {}
        deployed: list[str] = []
        for kind, name, holder, url, term, left in self.db.run(ROUND, self._params()):
            if kind == "deployed":
                deployed.append(str(name))
            elif kind == "renewed":
                owned[str(name)[len(APP) :]] = int(term)
            elif float(left) <= 0:
                continue
            elif name.startswith(MEMBER):
                members.add(str(holder))
            else:
                holders[name[len(APP) :]] = str(holder)
                urls[name[len(APP) :]] = str(url)
        for app in owned:  # renewed now, whatever the snapshot said of them
            holders[app] = self.holder
        plan = moves(AppsView(sorted(members), deployed, holders), self.holder)
        if plan.take:
            names = [APP + app for app in sorted(plan.take)]
            for name, term in self.db.run(TAKE, self._params(names=names)):
                owned[str(name)[len(APP) :]] = int(term)
        for app in plan.drop | plan.give:
            owned.pop(app, None)
            urls.pop(app, None)
        for app in owned:
            urls[app] = self.holder_url
        self._rounds += 1
        if self._rounds % FORGET_EVERY_ROUNDS == 0:
            self.db.run(FORGET, {"after": FORGET_MEMBERS_AFTER_S})
        return AppRound(
            owned,
            urls,
            len(members),
            valid_until=sent + self.ttl - self.margin,
            to_give=plan.drop | plan.give,
        )

    def give_up(self, apps: frozenset[str]) -> None:
        """Give these apps' leases up now: once this process no longer acts for them (the
        round that found them past its share left them out of what it owns)."""
        self.db.run(GIVE, self._params(names=[APP + app for app in apps]))

    def leave(self) -> None:
        """Give up every app and say this process is gone (an orderly stop)."""
        # Not reached: its leases run out by themselves within their ttl.
        with contextlib.suppress(LeaseUnavailable):
            self.db.run(LEAVE, self._params())

    def close(self) -> None:
        self.db.close()
