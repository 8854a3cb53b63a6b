"""Gangs started: one replica over several nodes, a member on each (cluster_model.Gang).
From then on the replica lifecycle runs each member as a replica, and keeps a gang's
rules: rank 0 serves once every member is ready, and one member's end is the gang's."""

from __future__ import annotations

import secrets

from ember.wire.gangs import GangMember
from ember.wire.labels import split_app_key
from ember_platform.core.replicas import ReplicaLifecycle
from ember_platform.observability.logs import LogSink
from ember_platform.runtime.cluster_model import EndpointRuntime, Gang, Replica, Worker
from ember_platform.runtime.live_state import LiveState
from ember_platform.scaling.gang_ports import GANG_PORTS_PER_WORKSPACE, free_block
from ember_platform.scaling.scheduler import GpuChoice
from ember_platform.security.secrets import env_digest
from ember_platform.snapshots.registry import SnapshotRegistry

LOOPBACK = "127.0.0.1"  # where a gang's members reach each other (nodes sharing one)


class GangStarts:
    def __init__(
        self,
        state: LiveState,
        logs: LogSink,
        replicas: ReplicaLifecycle,
        snapshots: SnapshotRegistry,
    ) -> None:
        self.state = state
        self.logs = logs
        self.replicas = replicas
        self.snapshots = snapshots

    def start(
        self, runtime: EndpointRuntime, workers: list[Worker], gpu: GpuChoice | None
    ) -> Replica | None:
        """Start a replica as a gang, a member on each of `workers` (rank 0 on the
        first, which takes its inputs), each holding `gpu`; None where the platform's
        gang ports are all taken (said in the endpoint's log)."""
        each, size = runtime.settings.gang_ports, len(workers)
        workspace = split_app_key(runtime.app)[0]
        held = sum(count for _, count in self.state.gang_ports_taken(workspace))
        first = free_block(size * each, self.state.gang_ports_taken())
        if held + size * each > GANG_PORTS_PER_WORKSPACE:
            why = (
                f"its workspace's gangs hold {held} of the {GANG_PORTS_PER_WORKSPACE} gang "
                f"ports a workspace may hold, and it needs {size} x {each}"
            )
        elif first is None:
            why = f"{size} x {each} ports in a row are not free among the platform's gang ports"
        else:
            why = ""
        if why or first is None:
            wait = f"no room for a gang: {why}"
            if wait != runtime.placement_wait:  # said once, not at every tick
                self.logs.system(runtime.app, runtime.spec.name, wait)
            runtime.placement_wait = wait
            return None
        gang = Gang(
            id="g-" + secrets.token_hex(6),
            members=[],
            first_port=first,
            ports_each=each,
            size=size,
            every_rank=runtime.settings.gang_inputs == "every_rank",
        )
        for worker in workers:
            member = self.replicas.new(runtime, worker, gpu)
            member.gang = gang
            gang.members.append(member)
            gang.running[member.id] = worker.id
        self.state.gangs[gang.id] = gang
        runtime.replicas[gang.lead.id] = gang.lead  # the others are not the endpoint's
        env = self.replicas.replica_env(runtime)
        size = len(workers)
        for rank, (worker, member) in enumerate(zip(workers, gang.members, strict=True)):
            # Each rank its own image, taken at its quiet point (before its enter() hooks,
            # where its process group forms) and restored on any node.
            snapshot, note = self.snapshots.plan(
                runtime, worker, member.id, env_digest(env), gpu, (rank, size)
            )
            if snapshot is not None and snapshot.action == "restore":
                member.restoring_from = (snapshot.key, snapshot.image_id)
            place = GangMember(
                gang_id=gang.id,
                rank=rank,
                size=size,
                master_addr=LOOPBACK,
                first_port=first,
                ports_each=each,
            )
            self.replicas.send_start(runtime, worker, member, env, snapshot, note, place)
        return gang.lead
