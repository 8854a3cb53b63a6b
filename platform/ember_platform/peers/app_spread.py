"""How the deployed apps spread over the live control-plane processes: a pure policy, from
one view of the database's app leases to what this process takes and gives up.

Every process reads the same view and runs the same sums, so they agree without talking:
the apps are shared out evenly (any difference at most one app, the extra ones to the
processes whose ids sort first), and each process moves only its own leases: one that
holds more than its share gives the excess up, one that holds fewer takes apps nobody
holds. It never takes an app a live process holds: a joining process gets its share as
the others give theirs up, not by a race. Two processes taking the same free app are
settled by the database (one statement: only a free or expired lease is taken)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class AppsView:
    """One read of the leases: who is live and who holds what."""

    members: Sequence[str]  # the live processes' holder ids (this one among them)
    apps: Sequence[str]  # the deployed apps, each of which needs an owner
    holders: Mapping[str, str]  # app -> its live holder's id (expired leases left out)


@dataclass(frozen=True)
class Moves:
    take: frozenset[str]  # free apps to take now
    give: frozenset[str]  # held apps past this process's share, to give up
    drop: frozenset[str]  # held leases of apps no longer deployed


def shares(app_count: int, members: Sequence[str]) -> dict[str, int]:
    """Each member's share of `app_count` apps: equal, the remainder one each to the
    members whose ids sort first."""
    ordered = sorted(set(members))
    if not ordered:
        return {}
    base, extra = divmod(app_count, len(ordered))
    return {member: base + (1 if i < extra else 0) for i, member in enumerate(ordered)}


def _order_for(member: str, app: str) -> bytes:
    # Each member tries free apps in an order of its own, so that processes under their
    # shares at once seldom reach for the same app.
    return hashlib.sha256(f"{member}\0{app}".encode()).digest()


def moves(view: AppsView, me: str) -> Moves:
    deployed = set(view.apps)
    held = {app for app, holder in view.holders.items() if holder == me}
    drop = frozenset(held - deployed)
    held &= deployed
    share = shares(len(deployed), [*view.members, me])[me]
    if len(held) > share:
        # The apps given up are those this member would try last: a stable choice.
        excess = sorted(held, key=lambda app: _order_for(me, app))[share:]
        return Moves(frozenset(), frozenset(excess), drop)
    free = sorted(
        (app for app in deployed if app not in view.holders), key=lambda app: _order_for(me, app)
    )
    return Moves(frozenset(free[: share - len(held)]), frozenset(), drop)
