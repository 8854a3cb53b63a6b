"""What the suite needs from the machine, and the one place a test may skip for its lack.

A test that needs CRIU, root, a namespace, a cgroup or a GPU calls `need(what, why)` when
the machine lacks it: the test fails, naming the switch, unless $EMBER_TEST_ALLOW_SKIP (a
comma-separated list, e.g. `criu,cgroups`) says this machine is known to lack it; then it
skips. A missing feature cannot hide behind a green run that way. `gpu` is allowed by
default: no CI machine has one.

Run as a script (infra/test.sh does, before pytest), it checks that a Linux machine
running as root can take snapshots: CRIU >= 4.1, pycriu in this environment and a passing
`criu check`; it exits 1 naming what is missing, unless `criu` is allowed to be.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import pytest

ALLOW_SKIP_ENV = "EMBER_TEST_ALLOW_SKIP"
# What a machine may lack, for the switch above.
KNOWN = frozenset(
    {
        "criu",
        "lazy-restores",
        "huge-pages",
        "root",
        "cgroups",
        "gpu",
        "packages",
        "node",
        "postgres",  # a throwaway PostgreSQL (tests/postgres_cluster.py)
        "sandbox",  # replicas' mount namespaces, seccomp, egress rules (test_isolation)
    }
)
ALLOWED_BY_DEFAULT = frozenset({"gpu"})  # no CI machine has one


def allowed_to_lack() -> frozenset[str]:
    names = {n.strip() for n in os.environ.get(ALLOW_SKIP_ENV, "").split(",") if n.strip()}
    unknown = names - KNOWN
    if unknown:
        raise ValueError(f"{ALLOW_SKIP_ENV} names {sorted(unknown)}; known: {sorted(KNOWN)}")
    return ALLOWED_BY_DEFAULT | names


def may_lack(what: str) -> bool:
    if what not in KNOWN:
        raise ValueError(f"unknown need {what!r}; known: {sorted(KNOWN)}")
    return what in allowed_to_lack()


def need(what: str, why: str) -> NoReturn:
    """This machine lacks `what` (one of KNOWN), for the reason `why`: skip the test if the
    run was told it may, else fail it saying how to tell it."""
    if may_lack(what):
        default = " (allowed by default)" if what in ALLOWED_BY_DEFAULT else ""
        pytest.skip(f"{why} [{ALLOW_SKIP_ENV} allows lacking {what}{default}]")
    pytest.fail(
        f"{why}. This machine should have {what}; if it is known to lack it, run with "
        f"{ALLOW_SKIP_ENV}={what}",
        pytrace=False,
    )


def snapshots_on(problem: str | None) -> bool:
    """Whether a test's snapshot part runs, given the worker's snapshot problem: yes when
    there is none; no (the test goes on without that part) when the run allows lacking
    criu; otherwise the test fails."""
    if problem is None:
        return True
    if may_lack("criu"):
        return False
    need("criu", f"snapshots are off on this machine: {problem}")


def snapshot_problem() -> str | None:
    """Why this machine cannot take snapshots (as a worker would find it), or None."""
    from ember_worker.snapshots.support import detect_support

    return detect_support(None).problem


def main() -> int:
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        print("snapshots: not checked (they need Linux and root; the tests that need them say)")
        return 0
    if may_lack("criu"):
        print(f"snapshots: not checked ({ALLOW_SKIP_ENV} allows lacking criu)")
        return 0
    problem = snapshot_problem()
    if problem is None:
        print("snapshots: CRIU >= 4.1, pycriu and `criu check` are fine")
        return 0
    print(
        f"error: this machine runs as root on Linux, so the tests need snapshots, but: {problem}."
        f"\nRun `bash infra/criu.sh` to install CRIU, or set {ALLOW_SKIP_ENV}=criu if this "
        "machine is known to lack it.",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
