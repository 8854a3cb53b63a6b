"""`ember scale`: autoscaling settings changed without a deploy, checked, applied by the
controller, kept in the store for the version they were set on, ended by a deploy."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from cluster_harness import LABEL, Env, run

from ember.declarations.settings import EndpointSettings
from ember.errors import InvalidError
from ember_platform.runtime.cluster_model import ReplicaState
from ember_platform.scaling.overrides import effective_settings, merged, parse_override


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ([], "JSON object"),
        ({"concurrency": 4}, "'concurrency' cannot be changed without a deploy"),
        ({"min_replicas": True}, "must be a number"),
        ({"max_replicas": "8"}, "must be a number"),
    ],
)
def test_a_bad_change_is_refused(payload: Any, message: str) -> None:
    with pytest.raises(InvalidError, match=message):
        parse_override(payload)


def test_changes_merge_and_null_resets_a_setting() -> None:
    current = merged({}, parse_override({"min_replicas": 2, "max_replicas": 8}))
    assert current == {"min_replicas": 2, "max_replicas": 8}
    assert merged(current, {"min_replicas": None}) == {"max_replicas": 8}


def test_the_result_is_checked_as_a_deploy_would_be() -> None:
    deployed = EndpointSettings(min_replicas=1, max_replicas=4)
    assert effective_settings(deployed, {}) is deployed
    assert effective_settings(deployed, {"min_replicas": 3}).min_replicas == 3
    with pytest.raises(InvalidError, match="max_replicas=4 is below min_replicas=6"):
        effective_settings(deployed, {"min_replicas": 6})
    with pytest.raises(InvalidError, match="whole number"):
        effective_settings(deployed, {"min_replicas": 1.5})


def test_a_buffer_that_max_replicas_leaves_no_room_for_is_refused() -> None:
    with pytest.raises(InvalidError, match="buffer_replicas=3 leaves no room under max_replicas=3"):
        EndpointSettings(max_replicas=3, buffer_replicas=3)
    deployed = EndpointSettings(max_replicas=4, buffer_replicas=2)
    with pytest.raises(InvalidError, match="ember scale --buffer"):
        effective_settings(deployed, {"max_replicas": 2})
    assert effective_settings(deployed, {"max_replicas": 2, "buffer_replicas": 1}).max_replicas == 2


def live(env: Env) -> list[Any]:
    return [
        r
        for r in env.runtime.replicas.values()
        if r.state in (ReplicaState.STARTING, ReplicaState.READY)
    ]


def test_a_higher_min_starts_replicas_and_a_reset_lets_them_scale_down(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=4, scaledown_window=10.0)
        env.tick()
        assert live(env) == []
        env.cluster.deployments.set_scaling(env.runtime, {"min_replicas": 2})
        replicas = env.start_ready()
        assert len(replicas) == 2 and env.runtime.settings.min_replicas == 2
        assert env.runtime.spec.settings.min_replicas == 0  # the deployed value is kept
        (stored,) = env.store.list_scaling_overrides()
        assert (stored.label, stored.version, stored.settings) == (LABEL, 1, {"min_replicas": 2})
        assert "scaling set: min_replicas=2 (deployed 0), max_replicas=4 (as deployed)" in (
            env.logs()
        )
        with pytest.raises(InvalidError, match="below min_replicas"):
            env.cluster.deployments.set_scaling(env.runtime, {"max_replicas": 1})
        assert env.runtime.settings.max_replicas == 4  # a refused change changes nothing
        env.cluster.deployments.set_scaling(env.runtime, {"min_replicas": None})
        assert env.runtime.scaling_override == {} and env.store.list_scaling_overrides() == []
        t0 = time.time()
        for replica in replicas:
            replica.idle_since = t0
        env.advance(t0 + 11.0)
        assert live(env) == []  # back to the deployed min of 0

    run(tmp_path, scenario)


def test_a_deploy_ends_the_override_and_a_restart_restores_only_the_serving_versions(
    tmp_path: Path,
) -> None:
    async def scenario(env: Env) -> None:
        env.deploy(max_replicas=4)
        env.cluster.deployments.set_scaling(env.runtime, {"max_replicas": 2, "buffer_replicas": 1})
        env.cluster.endpoints.clear()  # as a restart finds it: the store, no runtime
        env.deploy(max_replicas=4)
        assert env.cluster.deployments.restore_scaling() == 1
        assert env.runtime.settings.max_replicas == 2
        assert env.runtime.settings.buffer_replicas == 1
        env.deploy(2, max_replicas=4)  # a new version: its code decides again
        assert env.runtime.scaling_override == {} and env.runtime.settings.max_replicas == 4
        env.cluster.endpoints.clear()
        env.deploy(2, max_replicas=4)
        assert env.cluster.deployments.restore_scaling() == 0  # it was version 1's
        assert env.store.list_scaling_overrides() == []

    run(tmp_path, scenario)


def test_stopping_an_app_drops_its_overrides(tmp_path: Path) -> None:
    async def scenario(env: Env) -> None:
        env.deploy()
        env.cluster.deployments.set_scaling(env.runtime, {"scaledown_window": 5})
        env.store.delete_app("demo")
        assert env.store.list_scaling_overrides() == []

    run(tmp_path, scenario)
