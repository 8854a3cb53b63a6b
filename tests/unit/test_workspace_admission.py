"""Admission per workspace: the pure decision (queued, running, rate on a given clock), and
each workspace's limits as an admin sets them, kept in the state store across a restart
on both backends, and removed with the workspace."""

from __future__ import annotations

from pathlib import Path

import pytest
from cluster_harness import LABEL, Env, run
from store_backends import StoreOpener

from ember.wire.spec import FUNCTION_METHOD
from ember_platform.edge.errors import http_error
from ember_platform.errors import InvalidRequest, WorkspaceLimitReached
from ember_platform.limits.admission import Admission, WorkspaceLimits, load_needed
from ember_platform.limits.workspace_limits import WorkspaceLimitRegistry
from ember_platform.runtime.inputs import Input
from ember_platform.security.rate_limits import RateLimit
from ember_platform.storage.records import WorkspaceRecord
from ember_platform.storage.sqlite_store import SqliteStateStore

LIMITS = WorkspaceLimits(max_queued=3, max_running=2, rate=RateLimit(2, 1.0))
DEFAULTS = WorkspaceLimits(max_queued=10_000, max_running=1_000)


def test_below_every_limit_a_call_is_admitted() -> None:
    assert Admission().admit("acme", LIMITS, queued=2, running=1, now=0.0) is None


def test_at_the_queue_limit_the_refusal_names_the_workspace_and_the_limit() -> None:
    refusal = Admission().admit("acme", LIMITS, queued=3, running=0, now=0.0)
    assert refusal is not None and refusal.limit == "max_queued"
    assert refusal.message == (
        "workspace acme has 3 inputs queued, its limit (max_queued); retry later"
    )
    assert refusal.retry_after > 0


def test_at_the_running_limit_the_refusal_names_it() -> None:
    refusal = Admission().admit("acme", LIMITS, queued=0, running=2, now=0.0)
    assert refusal is not None and refusal.limit == "max_running"
    assert "workspace acme has 2 calls running" in refusal.message


def test_the_rate_is_a_bucket_per_workspace_on_the_given_clock() -> None:
    admission = Admission()
    assert admission.admit("acme", LIMITS, 0, 0, now=0.0) is None
    assert admission.admit("acme", LIMITS, 0, 0, now=0.0) is None
    refusal = admission.admit("acme", LIMITS, 0, 0, now=0.0)
    assert refusal is not None and refusal.limit == "rate"
    assert refusal.retry_after == pytest.approx(0.5)
    assert "workspace acme may start 2/s calls, its limit (rate)" in refusal.message
    # Another workspace has a bucket of its own; time refills this one.
    assert admission.admit("other", LIMITS, 0, 0, now=0.0) is None
    assert admission.admit("acme", LIMITS, 0, 0, now=0.5) is None


def test_a_call_refused_for_its_queue_does_not_spend_the_rate() -> None:
    admission = Admission()
    for _ in range(5):
        assert admission.admit("acme", LIMITS, queued=3, running=0, now=0.0) is not None
    assert admission.admit("acme", LIMITS, 0, 0, now=0.0) is None


def test_the_load_is_counted_only_when_the_live_inputs_could_reach_a_limit() -> None:
    assert not load_needed(LIMITS, live_inputs=1)
    assert load_needed(LIMITS, live_inputs=2)  # the running limit could be reached
    assert not load_needed(DEFAULTS, live_inputs=999)


def test_settings_outlive_a_restart_and_default_back(open_store: StoreOpener) -> None:
    store = open_store()
    store.put_workspace(WorkspaceRecord("acme", 1.0))
    limits = WorkspaceLimitRegistry(store, DEFAULTS)
    assert limits.of("acme") == DEFAULTS
    limits.change("acme", {"max_queued": 50, "rate": "10/s"})
    limits.change("main", {"max_running": 7})
    assert limits.of("acme") == WorkspaceLimits(50, 1_000, RateLimit(10, 1.0))

    again = WorkspaceLimitRegistry(open_store(), DEFAULTS)  # another process, or a restart
    assert again.of("acme") == WorkspaceLimits(50, 1_000, RateLimit(10, 1.0))
    assert again.of("main") == WorkspaceLimits(10_000, 7)
    assert again.of("other") == DEFAULTS
    # null: back to the default; "none": no rate limit whatever the default.
    again.change("acme", {"max_queued": None, "rate": "none"})
    with_rate = WorkspaceLimits(10_000, 1_000, RateLimit(100, 1.0))
    assert WorkspaceLimitRegistry(open_store(), with_rate).of("acme").rate is None
    again.change("acme", {"rate": None})
    assert WorkspaceLimitRegistry(open_store(), DEFAULTS).settings("acme").empty

    # A workspace removed takes its settings with it.
    store.put_workspace(WorkspaceRecord("gone", 2.0))
    limits.change("gone", {"max_queued": 5})
    assert store.delete_workspace("gone")
    assert WorkspaceLimitRegistry(open_store(), DEFAULTS).of("gone") == DEFAULTS


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"max_queued": 0}, "max_queued is a whole number from 1"),
        ({"max_running": "5"}, "max_running is a whole number from 1"),
        ({"max_running": True}, "max_running is a whole number from 1"),
        ({"rate": "10 per second"}, "such as 10/s, 600/min or 10000/h"),
        ({"rate": 10}, "rate is text such as 100/s"),
        ({"max_queue": 5}, "no workspace limit named max_queue"),
    ],
)
def test_what_cannot_be_a_limit_is_refused(
    tmp_path: Path, changes: dict[str, object], said: str
) -> None:
    limits = WorkspaceLimitRegistry(SqliteStateStore(tmp_path / "state.db"), DEFAULTS)
    with pytest.raises(InvalidRequest, match=said):
        limits.change("acme", changes)
    assert limits.of("acme") == DEFAULTS


def test_the_control_plane_refuses_past_the_default_and_never_drops_an_accepted_call(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=1)
        env.submit(), env.submit(is_async=True)
        with pytest.raises(WorkspaceLimitReached) as caught:
            env.submit(is_async=True)
        answer = http_error(caught.value)
        assert (answer.status, answer.headers) == (429, {"Retry-After": "1"})
        assert "workspace main has 2 inputs queued" in answer.message
        # One a previous process accepted is queued whatever the load: it was admitted.
        recovered = Input("c-old", LABEL, FUNCTION_METHOD, b"{}", False, is_async=True)
        env.cluster.input_lifecycle.submit(recovered, recovered=True)
        assert len(env.runtime.pending) == 3
        # A workspace's own setting stands over the default.
        env.cluster.workspace_limits.change("main", {"max_queued": 4})
        env.submit()

    run(tmp_path, scenario, workspace_max_queued=2)


def test_a_rate_refusal_says_when_to_come_back(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy()
        env.submit()
        with pytest.raises(WorkspaceLimitReached) as caught:
            env.submit()
        assert caught.value.limit == "rate"
        assert http_error(caught.value).headers == {"Retry-After": "60"}

    run(tmp_path, scenario, workspace_rate="1/min")
