"""The control plane's image builds (platform/ember_platform/images/builds.py): one
build per image at a time in the cluster, sent to a node that takes replicas, its
output kept for every follower from its first line, and failed when its node leaves."""

from __future__ import annotations

import asyncio

import pytest

import ember
from ember.wire import messages as wire
from ember_platform.images import builds
from ember_platform.images.builds import ImageBuilds
from ember_platform.runtime.cluster_model import Worker
from ember_platform.runtime.live_state import LiveState

IMAGE = ember.Image.debian_slim().run_commands("true").to_dict()


def _worker(name: str, cpu: float) -> Worker:
    return Worker(id="w-" + name, name=name, cpu=cpu, memory=1 << 30, gpus={})


def _sent(worker: Worker) -> list[wire.ToAgent]:
    found = []
    while not worker.outbox.empty():
        found.append(wire.to_agent(worker.outbox.get_nowait()))
    return found


async def _follow(runs: ImageBuilds, build: builds.Build) -> list[str]:
    return [line async for line in runs.follow(build)]


def test_one_build_per_image_on_the_node_with_room_and_its_output_for_every_follower() -> None:
    async def scenario() -> None:
        small, big, drained = _worker("small", 2), _worker("big", 8), _worker("drained", 64)
        state = LiveState(draining_nodes={"drained"})
        state.workers = {w.id: w for w in (small, big, drained)}
        runs = ImageBuilds(state)
        build = runs.start(IMAGE, {}, {"reg": {"REGISTRY_USERNAME": "u"}})
        assert build.worker_name == "big"  # the most CPUs among nodes taking work
        again = runs.start(IMAGE, {}, {})
        assert again is build  # the second deploy follows the first's build
        [command] = _sent(big)
        assert isinstance(command, wire.BuildImage) and command.build_id == build.id
        assert command.secrets == {"reg": {"REGISTRY_USERNAME": "u"}}
        assert _sent(small) == [] and _sent(drained) == []
        # Another image goes to the node with fewer builds under way.
        other = runs.start(ember.Image.debian_slim().to_dict(), {}, {})
        assert other.worker_name == "small"

        first = asyncio.ensure_future(_follow(runs, build))
        runs.message(big, wire.ImageBuildOutput(build_id=build.id, lines=["[1/2] a", "x"]))
        runs.message(small, wire.ImageBuildOutput(build_id=build.id, lines=["not its"]))
        await asyncio.sleep(0)
        late = asyncio.ensure_future(_follow(runs, build))  # joins mid-build
        runs.message(big, wire.ImageBuildDone(build_id=build.id, error="step 2 failed"))
        assert await first == ["[1/2] a", "x"] and await late == ["[1/2] a", "x"]
        assert build.error == "step 2 failed"
        assert runs.start(IMAGE, {}, {}) is not build  # ended: a new deploy builds anew

    asyncio.run(scenario())


def test_a_build_whose_node_leaves_fails_saying_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(builds, "WORKER_CHECK_SECONDS", 0.01)

    async def scenario() -> None:
        node = _worker("node-1", 4)
        state = LiveState()
        state.workers = {node.id: node}
        runs = ImageBuilds(state)
        build = runs.start(IMAGE, {}, {})
        del state.workers[node.id]
        assert await asyncio.wait_for(_follow(runs, build), 5) == []
        assert build.error is not None and "worker node-1 left during the build" in build.error
        state.workers.clear()
        with pytest.raises(ValueError, match="no worker node is connected"):
            runs.start(IMAGE, {}, {})

    asyncio.run(scenario())
