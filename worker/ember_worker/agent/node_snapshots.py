"""Snapshots on this node, as the agent sees them: whether it can take and restore them
(and why not, said once at start), the image cache, and the control plane's commands
about them: fetch a published image ahead, forget one, answer a retake."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ember.wire import messages as wire
from ember_worker.agent.config import AgentConfig
from ember_worker.agent.control_channel import Send
from ember_worker.agent.log_shipping import EndpointNote, Note
from ember_worker.agent.replicas.launch import Spawn
from ember_worker.agent.replicas.provisioning import ReplicaProvisioning
from ember_worker.agent.replicas.replica_images import ReplicaSnapshots
from ember_worker.agent.running_replica import RunningReplica
from ember_worker.snapshots.huge_pages import huge_pages_problem
from ember_worker.snapshots.snapshotter import Snapshotter
from ember_worker.snapshots.support import SnapshotSupport
from ember_worker.weights.cache.disk_cache import objects_dir
from ember_worker.weights.cache.workspace_caches import NodeWeights

log = logging.getLogger("ember.worker")


class NodeSnapshots:
    def __init__(
        self,
        config: AgentConfig,
        support: SnapshotSupport,
        *,
        provisioning: ReplicaProvisioning,
        note: Note,
        endpoint_note: EndpointNote,
        send: Send,
        spawn: Spawn,
    ) -> None:
        self.config = config
        self.endpoint_note = endpoint_note  # for fetches ahead
        self.support = support  # ember_worker.node_probes found it
        self.snapshotter: Snapshotter | None = None
        if not self.support.problem:
            try:
                self.snapshotter = Snapshotter(
                    self.support,
                    config.work_dir / "snapshots",
                    config.server_url,
                    config.token,
                    config.ca_cert,
                    config.snapshot_budget_bytes,
                    # Bundles unpack at the same path, environments are made there, an
                    # image's root is made there before a restore; a replica's working
                    # area (replicas/<id>, its TMPDIR) is its own: files it made there
                    # travel with its snapshot.
                    same_on_every_node=[
                        config.work_dir / name
                        for name in (
                            "bundles",
                            "environments",
                            "weights",
                            "volumes",
                            "snapshots",
                            "images",
                        )
                    ],
                    weights_objects=objects_dir(config.weights_dir),
                )
            except ValueError as exc:  # a bad setting: said where snapshots-off reasons are
                self.support = replace(self.support, problem=str(exc))
        if self.support.problem:
            log.warning("snapshots are off on this node: %s", self.support.problem)
        # Restores into huge pages, where asked for and the kernel has them.
        self.huge_pages = config.huge_pages and self.snapshotter is not None
        if self.huge_pages and (problem := huge_pages_problem()):
            log.warning("restores use 4 KiB pages: %s", problem)
            self.huge_pages = False
        # Takes and restores replicas' images: None where snapshots are off.
        self.replica_images: ReplicaSnapshots | None = None
        if self.snapshotter is not None:
            self.replica_images = ReplicaSnapshots(
                self.snapshotter,
                lazy_restore=config.lazy_restore,
                huge_pages=self.huge_pages,
                gpu_node=bool(config.gpus),
                note=note,
                send=send,
                spawn=spawn,
                take_gpus=provisioning.take_gpus,
                replica_env=lambda own: provisioning.replica_env(own, ()),
            )

    def hello(self) -> dict[str, Any]:
        """What the node's hello says of its snapshots."""
        return {
            **self.support.hello(),
            "lazy_restore": self.config.lazy_restore and self.support.lazy_pages,
            "huge_pages": self.huge_pages,
        }

    def abort_all(self) -> None:
        """Snapshots being taken or restored end with the channel's session."""
        if self.snapshotter is not None:
            self.snapshotter.abort_all()

    def forget(self, command: wire.ForgetSnapshot) -> None:
        """An image the control plane no longer keeps leaves this node's cache."""
        if self.snapshotter is not None:
            self.snapshotter.forget_key(command.key)

    def retake_answered(
        self, command: wire.RetakeSnapshot, replicas: Mapping[str, RunningReplica]
    ) -> None:
        """The control plane's answer to a replica that asked to take a new snapshot."""
        if self.replica_images is not None:
            record = replicas.get(command.replica_id)
            self.replica_images.retake_answered(record, command)

    async def prefetch(self, command: wire.PrefetchSnapshot) -> None:
        """Fetch a newly published image into this node's cache before a replica here
        needs it (`Snapshotter.fetch_ahead`), and say so in its endpoint's log."""
        if self.snapshotter is None or not self.config.fetch_ahead:
            return
        key, label = command.key, command.label
        seconds = await self.snapshotter.fetch_ahead(key, command.image_id, command.raw_size)
        if seconds is not None:
            self.endpoint_note(
                label,
                f"snapshot {key[:12]} fetched ahead onto worker {self.config.name} in "
                f"{seconds:.2f} s: replicas starting there restore without downloading it",
            )
        if self.replica_images is not None:  # and the weights it maps, had earlier or now
            cache = NodeWeights(self.config.weights_dir, self.config.weights_cache_bytes)
            weights = await self.replica_images.fetch_weights_ahead(command, cache.room_for)
            if weights is not None:
                self.endpoint_note(label, f"worker {self.config.name}: {weights}")
