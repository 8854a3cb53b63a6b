"""The control plane's live picture, shared by the cluster's parts: the endpoints (and
their canaries) with their queues, the workers, the replicas, the inputs on their way,
and the nodes drained.

Plain data with read-only views. The parts in core/ change it, each its own share, all on
the event loop's thread: their methods are synchronous, so every change is atomic
between awaits.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from ember.wire.gangs import GangMember
from ember.wire.labels import split_app_key
from ember.wire.limits import MAX_RESULT_BYTES, MIB
from ember_platform.limits.held_bytes import HeldBytes
from ember_platform.runtime.cluster_model import (
    AboutInput,
    EndpointRuntime,
    Gang,
    Replica,
    ReplicaState,
    Worker,
)
from ember_platform.runtime.inputs import Input, release_body, release_for
from ember_platform.scaling.scheduler import NodeCapacity

# What a lazily restored replica may send about its inputs before its memory is all in
# (held until then): a result's worth. Past it, it is lost (its inputs retried).
MAX_HELD_MIB = MAX_RESULT_BYTES // MIB

# How long a node that refused a replica for want of a free GPU (or of CPUs or memory) is
# offered none: past its next heartbeat (2 s), which says which of its GPUs are fenced
# and what its replicas booked.
REFUSAL_SECONDS = 2.5

ENDED_REPLICA_MEMORY_S = 600.0


@dataclass(eq=False)
class LiveState:
    # Nodes by name that take no new replicas (`ember node drain`), across the node's
    # reconnects and this process's restarts (in the store).
    draining_nodes: set[str] = field(default_factory=set)
    endpoints: dict[str, EndpointRuntime] = field(default_factory=dict)
    canaries: dict[str, EndpointRuntime] = field(default_factory=dict)  # by label: on trial
    workers: dict[str, Worker] = field(default_factory=dict)
    replicas: dict[str, Replica] = field(default_factory=dict)
    # Replicas this process knew and let go (stopped, given up as lost), by id, with
    # when: a worker's hello that still names one is not adopting it back.
    ended_replicas: dict[str, float] = field(default_factory=dict)
    inputs: dict[str, Input] = field(default_factory=dict)
    # Synchronous calls made by the code of a live input, by that input's id.
    children: dict[str, set[Input]] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # the controller is needed now
    # Bytes in memory of inputs' bodies, and of their answers (results, stream events),
    # each within budgets per workspace and in all: new calls wait for room for their
    # bodies, replicas' channels for room for their answers.
    bodies: HeldBytes = field(default_factory=HeldBytes)
    answers: HeldBytes = field(default_factory=HeldBytes)
    # Gangs whose ports are held, by id: from their start until every member's process
    # is known to have ended (its worker said so, or left), however long after the
    # control plane let the gang go: a member killed may listen a while yet, and a new
    # gang (another workspace's) given its ports would reach it.
    gangs: dict[str, Gang] = field(default_factory=dict)

    def replica_ended(self, replica_id: str, now: float) -> None:
        """Note a replica let go, and forget those let go long ago: a replica without its
        channel exits by itself within seconds, so no hello names one later than this."""
        ended = self.ended_replicas
        ended.pop(replica_id, None)
        ended[replica_id] = now  # the dict stays in the order they ended
        while ended:
            oldest, at = next(iter(ended.items()))
            if now - at < ENDED_REPLICA_MEMORY_S:
                break
            del ended[oldest]

    def release_held(self, inp: Input) -> None:
        """The input is answered (or its caller left): nothing of it is held any more."""
        release_body(self.bodies, inp)
        release_for(self.answers, inp)

    def hold_early(self, replica: Replica, message: AboutInput, body: str) -> bool:
        """Keep a lazily restored replica's message about an input until its memory is in,
        counted in its workspace's answers held (so its channel pauses past the budget);
        False, keeping none, past MAX_HELD_MIB (a result's pieces are read on past the
        budget: bounded here)."""
        assert replica.held is not None
        if replica.held_bytes + len(body) > MAX_HELD_MIB * MIB:
            self.take_early(replica)
            return False
        replica.held.append((message, body))
        replica.held_bytes += len(body)
        self.answers.hold(split_app_key(replica.endpoint.app)[0], len(body))
        return True

    def take_early(self, replica: Replica) -> list[tuple[AboutInput, str]]:
        """What `hold_early` kept of the replica's, no longer held; it keeps no more."""
        held, replica.held = replica.held or [], None
        self.answers.release(split_app_key(replica.endpoint.app)[0], replica.held_bytes)
        replica.held_bytes = 0
        return held

    def runtimes(self) -> list[EndpointRuntime]:
        """Every endpoint's serving runtime, and the canaries beside them."""
        return [*self.endpoints.values(), *self.canaries.values()]

    def runtime_of(self, inp: Input) -> EndpointRuntime | None:
        """The runtime an input is for: its endpoint's canary if it was sent there and
        the canary still runs (else the serving version, which a promoted canary is)."""
        if inp.canary:
            canary = self.canaries.get(inp.label)
            if canary is not None:
                return canary
        return self.endpoints.get(inp.label)

    def load_of(self, workspace: str) -> tuple[int, int]:
        """(inputs queued, inputs on replicas) of the workspace's endpoints, canaries too:
        what its admission limits bound (`limits/admission.py`)."""
        queued = running = 0
        for runtime in self.runtimes():
            if split_app_key(runtime.app)[0] != workspace:
                continue
            queued += len(runtime.pending)
            for replica in runtime.replicas.values():
                running += len(replica.inflight)
        return queued, running

    def replicas_by_worker(self) -> dict[str, int]:
        """How many replicas (in any state) each worker holds, by worker id."""
        counts: dict[str, int] = {}
        for replica in self.replicas.values():
            counts[replica.worker_id] = counts.get(replica.worker_id, 0) + 1
        return counts

    def takes_no_replicas(self, worker: Worker) -> bool:
        """Whether the worker's node is drained, or the worker itself is leaving."""
        return worker.leaving or worker.name in self.draining_nodes

    def gang_ports_taken(self, workspace: str | None = None) -> list[tuple[int, int]]:
        """(first, count) of the ports each gang holds (of `workspace`'s gangs alone)."""
        return [
            (gang.first_port, gang.port_count)
            for gang in self.gangs.values()
            if workspace is None or gang.workspace == workspace
        ]

    def gang_member_ended(self, replica_id: str, worker_id: str) -> None:
        """A member's process on worker `worker_id` has ended: its gang's ports go once
        all of them have."""
        for gang_id, gang in list(self.gangs.items()):
            if gang.running.get(replica_id) == worker_id:
                del gang.running[replica_id]
            if not gang.running:
                del self.gangs[gang_id]

    def gang_members_gone(self, worker_id: str) -> None:
        """A worker left: its members' processes end with it (a worker stops its replicas
        when its channel closes)."""
        for gang in list(self.gangs.values()):
            for replica_id, where in list(gang.running.items()):
                if where == worker_id:
                    self.gang_member_ended(replica_id, worker_id)

    def gang_member_held(self, held: GangMember, replica_id: str, worker_id: str) -> None:
        """A worker's hello names a gang member this process did not start (another did,
        or this one before a restart): stopped, its gang's ports stay taken until it ends."""
        gang = self.gangs.get(held.gang_id)
        if gang is None:
            gang = self.gangs[held.gang_id] = Gang(
                id=held.gang_id,
                members=[],
                first_port=held.first_port,
                ports_each=held.ports_each,
                size=held.size,
            )
        gang.running[replica_id] = worker_id

    def capacities(self) -> list[NodeCapacity]:
        """Each worker's resources, what its replicas hold of them, and its live replicas
        by endpoint: what the scheduler places by."""
        nodes = []
        for worker in self.workers.values():
            cpu_used = 0.0
            memory_used = 0
            gpus_used: dict[str, int] = {}
            live: dict[str, int] = {}
            for replica in self.replicas.values():
                if replica.worker_id != worker.id:
                    continue
                settings = replica.endpoint.settings
                cpu_used += settings.cpu
                memory_used += settings.memory
                if replica.gpu is not None:
                    kind, count = replica.gpu
                    gpus_used[kind] = gpus_used.get(kind, 0) + count
                if replica.state in (ReplicaState.STARTING, ReplicaState.READY):
                    label = replica.endpoint.label
                    live[label] = live.get(label, 0) + 1
            # A GPU fenced for its health is held by no one new: counted as used (while
            # a replica this process tracks holds it, that replica's count covers it).
            for kind, fenced in worker.fenced_gpus(self.replicas).items():
                gpus_used[kind] = gpus_used.get(kind, 0) + fenced
            refused = worker.gpus_refused_at
            if refused is not None and time.time() - refused < REFUSAL_SECONDS:
                gpus_used = dict(worker.gpus)  # until its next heartbeat says what is fenced
            if worker.booked is not None and len(worker.booked) == 2:  # with unknown ones
                cpu_used = max(cpu_used, worker.booked[0])
                memory_used = max(memory_used, int(worker.booked[1]))
            refused = worker.room_refused_at
            if refused is not None and time.time() - refused < REFUSAL_SECONDS:
                cpu_used, memory_used = worker.cpu, worker.memory  # it said it is full
            nodes.append(
                NodeCapacity(
                    worker.id,
                    worker.cpu,
                    worker.memory,
                    worker.gpus,
                    cpu_used,
                    memory_used,
                    gpus_used,
                    frozenset(worker.bundles),
                    live,
                    worker.labels,
                    self.takes_no_replicas(worker),
                    worker.loopback,
                )
            )
        return nodes
