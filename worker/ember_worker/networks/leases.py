"""The networks the agent's replicas hold, by replica id: taken when a replica starts
(a spare its workspace had, else a new one), their pasta moved into the replica's
cgroups while it starts, ended with it, and a spare made for the workspace's next
replica once one has started or ended (in the background)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

from ember_worker.networks.gang_ports import GangPorts
from ember_worker.networks.namespaces import HeldNetwork, ReplicaNetworks

log = logging.getLogger("ember.worker")


class NetworkLeases:
    def __init__(self, networks: ReplicaNetworks) -> None:
        self.networks = networks
        self.held: dict[str, HeldNetwork] = {}  # by replica id, until it ends
        self._joins: dict[str, asyncio.Future[None]] = {}  # pastas moving, by replica id
        self._spares_in_making: set[asyncio.Future[None]] = set()

    async def take(
        self,
        replica_id: str,
        uid: int,
        cgroup_procs: tuple[Path, ...],
        gang: GangPorts | None = None,
    ) -> HeldNetwork:
        """The replica's network (a gang member's forwards `gang`), held until it ends (a
        restore's that failed: the cold boot takes it over)."""
        held = self.held.get(replica_id)
        if held is not None:
            return held
        network = await asyncio.to_thread(self.networks.take, uid, time.monotonic(), gang)
        self.held[replica_id] = network
        # Its pasta joins the replica's cgroups: the socket buffers it fills for the
        # replica from now on are charged to the replica's memory limit, its work to
        # the replica's CPU. A move takes some 10 ms: made while the replica starts.
        self._joins[replica_id] = asyncio.ensure_future(
            asyncio.to_thread(network.join, cgroup_procs)
        )
        return network

    async def started(self, replica_id: str, uid: int) -> None:
        """The replica has started: its pasta has joined it; a spare for the next."""
        if (joining := self._joins.pop(replica_id, None)) is not None:
            await joining
        self._spare(uid)

    async def release(self, replica_id: str, uid: int) -> None:
        """The replica has ended: its network ends too; a spare for the next."""
        if (joining := self._joins.pop(replica_id, None)) is not None:
            with contextlib.suppress(OSError):  # a start that failed: its cgroups may be gone
                await joining
        network = self.held.pop(replica_id, None)
        if network is not None:
            await asyncio.to_thread(network.close)
            self._spare(uid)

    def _spare(self, uid: int) -> None:
        """A namespace made ahead, in the background, for the uid's next replica."""
        made = asyncio.ensure_future(
            asyncio.to_thread(self.networks.make_spare, uid, time.monotonic())
        )
        self._spares_in_making.add(made)
        made.add_done_callback(self._spare_made)

    def _spare_made(self, made: asyncio.Future[None]) -> None:
        self._spares_in_making.discard(made)
        if not made.cancelled() and (error := made.exception()) is not None:
            log.warning("a spare network namespace could not be made: %s", error)
