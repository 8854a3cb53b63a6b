"""The node's heartbeat to the control plane, every two seconds: its GPUs' telemetry and
health, its replicas' memory use and CPU throttling, and, when they change, the snapshot
images and the weights this node holds."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from ember.wire import messages as wire
from ember_worker.agent.config import AgentConfig
from ember_worker.agent.log_shipping import SendText
from ember_worker.agent.replicas.node_room import booked
from ember_worker.agent.replicas.resource_limits import ResourceLimits
from ember_worker.agent.running_replica import RunningReplica
from ember_worker.gpu_slots import GpuSlots
from ember_worker.gpus.health import GpuHealthWatch
from ember_worker.gpus.telemetry import GpuTelemetry
from ember_worker.snapshots.snapshotter import Snapshotter
from ember_worker.weights.cache.workspace_caches import NodeWeights

HEARTBEAT_SECONDS = 2.0


class Heartbeats:
    def __init__(
        self,
        config: AgentConfig,
        replicas: Mapping[str, RunningReplica],
        limits: ResourceLimits,
        snapshotter: Snapshotter | None,
        gpu_telemetry: GpuTelemetry,
        gpu_health: GpuHealthWatch,
        gpu_slots: GpuSlots,
    ) -> None:
        self.config = config
        self.replicas = replicas
        self.limits = limits
        self.snapshotter = snapshotter  # None where snapshots are off
        self.gpu_telemetry = gpu_telemetry
        self.gpu_health = gpu_health
        self.gpu_slots = gpu_slots

    async def send_to(self, send: SendText) -> None:
        """Beat for as long as the channel's session lasts (it cancels this); a new
        session hears of the node's images and weights at once."""
        sent_cached: list[tuple[str, str]] | None = None
        sent_weights: dict[str, int] | None = None
        weights_cache = NodeWeights(self.config.weights_dir, self.config.weights_cache_bytes)
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            gpus = await asyncio.to_thread(self.gpu_telemetry.sample)
            health = await asyncio.to_thread(self.gpu_health.check, self.gpu_slots.holders())
            memory = {
                replica_id: record.memory_bytes
                for replica_id, record in self.replicas.items()
                if record.memory_bytes is not None
            }
            throttled = self.limits.cpu_throttled_seconds()
            images: list[list[str]] | None = None  # the images this node holds, when they change
            if self.snapshotter is not None:
                cached = await asyncio.to_thread(self.snapshotter.cached)
                if cached != sent_cached:
                    images = [list(pair) for pair in cached]
                    sent_cached = cached
            # Every workspace's cache within the node's budget (--weights-cache-gb).
            await asyncio.to_thread(weights_cache.enforce)
            weights = await asyncio.to_thread(weights_cache.holdings)
            changed_weights = weights if weights != sent_weights else None  # bytes by URL
            sent_weights = weights
            beat = wire.AgentHeartbeat(  # what is empty is left out (None)
                gpus=[sample.to_dict() for sample in gpus] or None,
                gpu_health=health or None,
                replica_memory=memory or None,
                replica_cpu_throttled=throttled or None,
                cached_snapshots=images,
                cached_weights=changed_weights,
                booked=list(booked(self.replicas.values())),
            )
            await send(wire.encode(beat))
