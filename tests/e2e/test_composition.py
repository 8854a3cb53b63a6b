"""Who may call what. Endpoints calling endpoints: a replica's code uses the SDK
(`square.deployed()`, `Endpoint.lookup`) with the platform's address and an invoke token
of its own, which ends with the replica. App tokens: an invoke token made with `--app`
calls that app's endpoints and reads its calls, and sees nothing of other apps."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from harness import Platform, replicas_ready, wait_for

import ember

APP = "composed"


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> dict[str, str]:
    return platform.deploy(apps_dir / "composed.py", APP)


def _endpoint(platform: Platform, name: str) -> ember.Endpoint:
    return ember.Endpoint.lookup(APP, name, config=platform.config())


def test_an_endpoint_maps_and_streams_over_another_of_its_app(
    platform: Platform, deployed: dict[str, str]
) -> None:
    result = _endpoint(platform, "sum-of-squares").call(n=20)
    assert result == {"total": sum(i * i for i in range(20)), "counted": [0, 1, 2]}


def test_calls_made_for_an_input_are_logged_with_it_and_end_with_it(
    platform: Platform, deployed: dict[str, str]
) -> None:
    assert _endpoint(platform, "sum-of-squares").call(n=3)["total"] == 5
    # Both replicas up first (without calls, which the logs below would show): the 3 s
    # the caller waits cover the child call, not two cold boots on a loaded machine.
    with (
        replicas_ready(platform, _endpoint(platform, "waits-on-slow"), 1),
        replicas_ready(platform, _endpoint(platform, "slow-square"), 1),
        platform.client(timeout=3) as client,
        pytest.raises(httpx.TimeoutException),
    ):
        client.post(f"/{APP}--waits-on-slow/", json={"x": 4})  # and the caller leaves

    def entries() -> list[dict]:
        out = platform.ember("logs", APP, "--json", "-n", "1000").stdout
        return [json.loads(line) for line in out.splitlines()]

    def child_stopped() -> list[dict] | None:
        seen = entries()
        stopped = any("slow_square(4) stopped" in e.get("text", "") for e in seen)
        return seen if stopped else None

    # The parent was cancelled when its caller left, and the call its code was waiting
    # on was cancelled with it: the child stopped long before its minute was up.
    seen = wait_for(child_stopped, 30)
    requests = {e["request_id"]: e for e in seen if e.get("stream") == "request"}
    parent = next(e for e in requests.values() if e["endpoint"] == "waits-on-slow")
    child = next(e for e in requests.values() if e["endpoint"] == "slow-square")
    assert child["parent_id"] == parent["request_id"] and child["status"] == 499
    assert f"called by {parent['request_id']}" in child["text"]
    squares = [e for e in requests.values() if e["endpoint"] == "square"]
    sums = {e["request_id"] for e in requests.values() if e["endpoint"] == "sum-of-squares"}
    assert len(squares) >= 3 and all(e["parent_id"] in sums for e in squares)


def test_a_callers_trace_continues_through_the_calls_an_endpoint_makes(
    platform: Platform, deployed: dict[str, str]
) -> None:
    trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with platform.client() as client:
        answer = client.post(
            f"/{APP}--sum-of-squares/",
            json={"n": 3},
            headers={"traceparent": f"00-{trace}-{caller_span}-01"},
        )
        assert answer.status_code == 200 and answer.headers["x-ember-trace-id"] == trace
        fresh = client.post(f"/{APP}--square/", json={"x": 2}, headers={"traceparent": "junk"})
        assert len(fresh.headers["x-ember-trace-id"]) == 32  # a new trace, not an error
        assert fresh.headers["x-ember-trace-id"] != trace

    def traced() -> list[dict] | None:
        out = platform.ember("logs", APP, "--trace", trace, "--json", "-n", "100").stdout
        lines = [json.loads(line) for line in out.splitlines()]
        return lines if len(lines) >= 4 else None  # the call and its 3 squares

    lines = wait_for(traced, 10)
    parent = next(e for e in lines if e["endpoint"] == "sum-of-squares")
    assert parent["parent_span_id"] == caller_span and parent["span_id"] != caller_span
    children = [e for e in lines if e["endpoint"] == "square"]
    assert len(children) == 3
    assert {e["parent_span_id"] for e in children} == {parent["span_id"]}
    assert len({e["span_id"] for e in children}) == 3


def test_async_code_awaits_another_endpoint(platform: Platform, deployed: dict[str, str]) -> None:
    assert _endpoint(platform, "square-async").call(x=7) == 49


def test_an_app_token_reaches_its_app_only(
    platform: Platform, apps_dir: Path, deployed: dict[str, str]
) -> None:
    platform.deploy(apps_dir / "composed.py", "elsewhere")
    made = platform.ember("token", "create", "--app", APP, "--name", "frontend")
    token = made.stdout.strip()
    listed = platform.ember("token", "ls").stdout.splitlines()
    assert listed[0].split()[:6] == ["ID", "SCOPE", "WORKSPACE", "APP", "RATE", "NAME"]
    assert any(line.split()[1:6] == ["invoke", "main", APP, "-", "frontend"] for line in listed)
    with platform.client() as admin:
        theirs = admin.post(
            "/elsewhere--square/", json={"x": 2}, headers={"Prefer": "respond-async"}
        ).json()["call_id"]
    with platform.client(token=token) as client:
        assert client.post(f"/{APP}--square/", json={"x": 4}).json() == 16
        mine = client.post(
            f"/{APP}--square/", json={"x": 5}, headers={"Prefer": "respond-async"}
        ).json()["call_id"]
        assert client.get(f"/v1/calls/{mine}", params={"wait": "30"}).json() == 25
        assert client.get(f"/v1/endpoints/{APP}--square").status_code == 200
        refused = client.post("/elsewhere--square/", json={"x": 3})
        assert refused.status_code == 403
        assert (
            refused.json()["error"]["message"]
            == f"this token calls the endpoints of app {APP} only"
        )
        # Other apps' endpoints and calls look absent, as they do to a stranger.
        assert client.get("/v1/endpoints/elsewhere--square").status_code == 404
        assert client.get(f"/v1/calls/{theirs}").status_code == 404
        assert client.delete(f"/v1/calls/{theirs}").status_code == 404
        assert client.get("/v1/apps").status_code == 403  # and it is no admin
    config = platform.config()
    scoped = type(config)(config.server_url, token, config.ca_cert)
    assert ember.Endpoint.lookup(APP, "square", config=scoped).call(x=6) == 36
    with pytest.raises(ember.NotFoundError):
        ember.Endpoint.lookup("elsewhere", "square", config=scoped)
    wrong = platform.ember("token", "create", "--scope", "worker", "--app", APP, check=False)
    assert wrong.returncode == 1 and "--app goes with --scope invoke" in wrong.stderr
    platform.ember("stop", "elsewhere")


def test_a_replica_token_invokes_only_and_ends_with_the_replica(
    platform: Platform, deployed: dict[str, str]
) -> None:
    seen = _endpoint(platform, "credentials").call()
    assert seen["app"] == APP
    # Not the admin token the node's own client config holds: an invoke token.
    assert seen["token"] != platform.token and seen["admin_only_status"] == 403
    with platform.client(token=seen["token"]) as client:
        answer = client.post(f"/{APP}--square/", json={"x": 3})
        assert (answer.status_code, answer.json()) == (200, 9)
        assert client.get("/v1/tokens").status_code == 403
    platform.ember("stop", APP)

    def refused() -> bool:
        with platform.client(token=seen["token"]) as client:
            return client.get(f"/v1/endpoints/{APP}--square").status_code == 401

    wait_for(refused, 30)


def test_a_rate_limited_token_gets_429_past_its_burst_and_then_goes_at_its_rate(
    platform: Platform, apps_dir: Path
) -> None:
    platform.deploy(apps_dir / "composed.py", "limited")  # other tests stop theirs
    with platform.client() as admin:  # a replica ready first: the burst must not wait on it
        assert admin.post("/limited--square/", json={"x": 1}).json() == 1
    # 12 a minute: the 13 calls below, all at once, are let in well within the 5 s that
    # brings a call back, even on a loaded machine.
    token = platform.ember("token", "create", "--rate-limit", "12/min").stdout.strip()
    listed = platform.ember("token", "ls").stdout
    assert " 12/min " in listed
    with platform.client(token=token) as client:
        with ThreadPoolExecutor(max_workers=13) as pool:
            answers = list(
                pool.map(lambda _: client.post("/limited--square/", json={"x": 3}), range(13))
            )
        assert sorted(a.status_code for a in answers) == [200] * 12 + [429]
        limited = next(a for a in answers if a.status_code == 429)
        assert 1 <= int(limited.headers["Retry-After"]) <= 5
        assert limited.json()["error"]["type"] == "rate_limited"
        assert "this token may make 12/min calls" in limited.json()["error"]["message"]

        # Five seconds bring one call back, at 12 a minute.
        def status() -> int:
            return client.post("/limited--square/", json={"x": 3}).status_code

        assert wait_for(lambda: status() == 200, 30, interval=0.5)
        assert status() == 429  # and only one
    # Other tokens are not held back by it.
    with platform.client() as admin:
        assert admin.post("/limited--square/", json={"x": 2}).json() == 4
    bad = platform.ember("token", "create", "--rate-limit", "2/day", check=False)
    assert bad.returncode == 1 and "such as 10/s, 600/min or 10000/h" in bad.stderr
    worker = platform.ember(
        "token", "create", "--scope", "worker", "--rate-limit", "2/s", check=False
    )
    assert worker.returncode == 1 and "makes no calls to limit" in worker.stderr


def test_a_token_with_an_expiry_works_until_then_and_then_says_it_expired(
    platform: Platform, apps_dir: Path
) -> None:
    platform.deploy(apps_dir / "composed.py", "expiring")
    # 10 s: time for `ember token ls` and a call (each a process or a cold boot, slow on a
    # loaded machine) before it expires.
    token = platform.ember("token", "create", "--expires", "10s", "--name", "brief").stdout.strip()
    listed = next(
        line for line in platform.ember("token", "ls").stdout.splitlines() if "brief" in line
    )
    assert re.search(r" in ([0-9]|10)s$", listed.rstrip()), listed
    with platform.client(token=token) as client:
        assert client.post("/expiring--square/", json={"x": 3}).json() == 9
        wait_for(
            lambda: client.post("/expiring--square/", json={"x": 3}).status_code == 401,
            20,
            interval=0.2,
        )
        refused = client.post("/expiring--square/", json={"x": 3})
        assert "the token expired at" in refused.json()["error"]["message"]
        api = client.get("/v1/endpoints/expiring--square")  # the API says the same
        assert api.status_code == 401 and "expired" in api.json()["error"]["message"]
    listed = next(
        line for line in platform.ember("token", "ls").stdout.splitlines() if "brief" in line
    )
    assert "expired" in listed
    bad = platform.ember("token", "create", "--expires", "0s", check=False)
    assert bad.returncode == 1 and "--expires" in bad.stderr
