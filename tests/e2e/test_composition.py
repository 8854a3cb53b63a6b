"""Endpoints calling endpoints: a replica's code uses the SDK (`square.deployed()`,
`Endpoint.lookup`) with the platform's address and an invoke token of its own, which ends
with the replica."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import Platform, wait_for

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


def test_async_code_awaits_another_endpoint(platform: Platform, deployed: dict[str, str]) -> None:
    assert _endpoint(platform, "square-async").call(x=7) == 49


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
