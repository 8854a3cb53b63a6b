"""A call's own time limit (X-Ember-Timeout, `_timeout=`): past it the call is taken off
the queue or stopped in its replica, its slot freed, and the caller gets 504."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from harness import Platform, wait_for

import ember

APP = "deadlines"


@pytest.fixture(scope="module")
def endpoints(platform: Platform, apps_dir: Path) -> dict[str, ember.Endpoint]:
    platform.deploy(apps_dir / "deadlines.py", APP)
    config = platform.config()
    return {name: ember.Endpoint.lookup(APP, name, config=config) for name in ("wait", "ticks")}


def test_a_running_call_past_its_limit_is_stopped_and_frees_its_slot(
    endpoints: dict[str, ember.Endpoint],
) -> None:
    wait = endpoints["wait"]
    assert wait.call(seconds=0.05, _timeout=30) == 0.05  # within its limit: as usual
    with pytest.raises(ember.CallTimeoutError, match="deadline_exceeded") as caught:
        wait.call(seconds=30, _timeout=0.5)  # the platform's 504, not the client giving up
    assert "it was running" in caught.value.message
    # The only slot is free again at once: the code was stopped, not left to run for
    # 30 s (a call behind it would run past its own limit of 5 s).
    assert wait.call(seconds=0.01, _timeout=5) == 0.01


def test_a_queued_call_past_its_limit_leaves_the_queue(
    platform: Platform, endpoints: dict[str, ember.Endpoint]
) -> None:
    wait = endpoints["wait"]
    wait.call(seconds=0.01)  # a replica is up
    # Held for long enough that the call below, on a loaded machine, still waits out its
    # limit behind it rather than being served once it ends.
    holder = threading.Thread(target=wait.call, kwargs={"seconds": 4.0})
    holder.start()
    wait_for(lambda: platform.endpoint_status(f"{APP}--wait")["running"] == 1, 10)
    with pytest.raises(ember.CallTimeoutError, match="waiting for a replica"):
        wait.call(seconds=0.01, _timeout=0.5)
    holder.join()


def test_a_stream_past_its_limit_ends_with_the_error(endpoints: dict[str, ember.Endpoint]) -> None:
    # Its replica is up first: a cold boot slower than the limit would leave no items.
    assert list(endpoints["ticks"].stream(n=1, every=0)) == [0]
    items = []
    with pytest.raises(ember.CallTimeoutError) as caught:
        for item in endpoints["ticks"].stream(n=100, every=0.1, _timeout=1.0):
            items.append(item)
    assert caught.value.error_type == "deadline_exceeded"
    assert 1 <= len(items) < 100 and items == list(range(len(items)))


def test_a_spawned_call_past_its_limit_fails(endpoints: dict[str, ember.Endpoint]) -> None:
    handle = endpoints["wait"].spawn(seconds=30, _timeout=0.5)
    with pytest.raises(ember.RemoteError, match="deadline_exceeded"):
        handle.get(timeout=20)


def test_bad_limits_are_refused(platform: Platform, endpoints: dict[str, ember.Endpoint]) -> None:
    with pytest.raises(ember.InvalidError, match="above 0"):
        endpoints["wait"].call(seconds=0.01, _timeout=0)  # before anything is sent
    with platform.client() as client:
        for bad in ("-1", "soon", "nan", "1e9"):
            answer = client.post(
                f"/{APP}--wait/", json={"seconds": 0.01}, headers={"X-Ember-Timeout": bad}
            )
            assert answer.status_code == 400, bad
            assert "X-Ember-Timeout" in answer.json()["error"]["message"]
    called = platform.ember(
        "call", f"{APP}--wait", '{"seconds": 30}', "--timeout", "0.5", check=False
    )
    assert called.returncode != 0 and "deadline_exceeded" in called.stderr


def test_map_limits_each_call_on_the_platform(endpoints: dict[str, ember.Endpoint]) -> None:
    # The third waits behind the second on the only slot: it is served because the
    # second was stopped at its limit, not left to run.
    inputs = [{"seconds": 0.01}, {"seconds": 30}, {"seconds": 0.02}]
    results = list(
        endpoints["wait"].map(inputs, concurrency=1, timeout=1.0, return_exceptions=True)
    )
    assert results[0] == 0.01 and results[2] == 0.02
    assert isinstance(results[1], ember.CallTimeoutError)
    assert results[1].error_type == "deadline_exceeded"  # stopped by the platform
