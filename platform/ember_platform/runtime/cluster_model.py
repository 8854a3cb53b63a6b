"""The control plane's live objects: an endpoint's runtime (one version's spec, queue,
replicas and calls' outcomes), its replicas, the workers they run on, the states a replica
goes through. `LiveState` (live_state.py) holds them; the cluster's parts change them.
What they say to each other is `ember.wire.messages`.
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import time
from collections import deque
from collections.abc import Container
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ember.declarations.schedules import Schedule
from ember.declarations.settings import EndpointSettings
from ember.wire import messages as wire
from ember.wire.labels import make_label, split_app_key
from ember.wire.spec import EndpointSpec, MethodSpec
from ember_platform.runtime.affinity import HomeSlots
from ember_platform.runtime.inputs import Input
from ember_platform.scaling.prefix_routing import PrefixIndex
from ember_platform.scaling.scheduler import Demand, GpuChoice
from ember_platform.security.tokens import TOKEN_PREFIX


class ReplicaState(StrEnum):
    STARTING = "starting"  # asked of a worker, not yet ready
    READY = "ready"  # takes inputs
    DRAINING = "draining"  # finishes its inputs, takes no new ones
    STOPPING = "stopping"  # told to stop; its exit hooks run


# What a replica says about one of its inputs: its events and its end.
AboutInput = wire.Event | wire.Result | wire.ResultPart | wire.End | wire.Error | wire.Cancelled

LATENCY_SAMPLES = 1000  # the newest calls' latencies kept per version, for percentiles


@dataclass
class VersionOutcomes:
    """A version's synchronous calls since it began serving: how many, how many failed
    on the platform's or the code's side (5xx), and the newest ones' latencies. A canary
    is judged by its own beside the serving version's over the same time."""

    calls: int = 0
    errors: int = 0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_SAMPLES))

    def note(self, status: int, seconds: float) -> None:
        self.calls += 1
        if status >= 500:
            self.errors += 1
        self.latencies.append(seconds)

    def summary(self) -> dict[str, float | int | None]:
        ordered = sorted(self.latencies)
        return {
            "calls": self.calls,
            "errors": self.errors,
            "error_rate": self.errors / self.calls if self.calls else None,
            "p50_s": statistics.median(ordered) if ordered else None,
            "p95_s": ordered[int(0.95 * (len(ordered) - 1))] if ordered else None,
        }


@dataclass(eq=False)
class EndpointRuntime:
    app: str
    spec: EndpointSpec
    version: int
    bundle_digest: str
    entry: str
    pending: deque[Input] = field(default_factory=deque)
    replicas: dict[str, Replica] = field(default_factory=dict)
    startup_failures: int = 0
    last_startup_error: str = ""
    backoff_until: float = 0.0
    removed: bool = False
    last_start: dict[str, Any] = field(default_factory=dict)
    snapshot_note: str | None = None  # why snapshots are off, said once
    last_unhealthy: dict[str, Any] | None = None  # the last replica its health check failed
    deployed_at: float = 0.0  # when its version was deployed (a Period counts from it)
    schedule_version: int = -1  # the version `schedule` was read from
    schedule: Schedule | None = None
    next_run_at: float | None = None  # a scheduled endpoint's next due time
    last_run: dict[str, Any] | None = None  # a scheduled endpoint's last started run
    home_slots: HomeSlots = field(default_factory=HomeSlots)  # keyed inputs' replicas
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)  # what replicas' caches hold
    canary_percent: int | None = None  # a canary's share of its endpoint's calls
    # Its calls' outcomes while its endpoint has a canary, since the canary began: what
    # the canary is judged by, beside the serving version's over the same time.
    outcomes: VersionOutcomes = field(default_factory=VersionOutcomes)
    # Autoscaling settings changed without a deploy (`ember scale`), and the settings
    # they give; None when there is no override.
    scaling_override: dict[str, Any] = field(default_factory=dict)
    overridden: EndpointSettings | None = None
    # Why a gang of it waits to be placed (None: it is not waiting), for `ember ls`.
    placement_wait: str | None = None

    @property
    def label(self) -> str:
        return make_label(self.app, self.spec.name)

    @property
    def is_canary(self) -> bool:
        return self.canary_percent is not None

    def take_version(
        self, spec: EndpointSpec, version: int, bundle_digest: str, entry: str, deployed_at: float
    ) -> None:
        """Serve another version from now on (its replicas start as the controller asks;
        the older ones drain once they are no longer needed)."""
        if version != self.version:
            self.scaling_override, self.overridden = {}, None  # the old version's
            self.outcomes = VersionOutcomes()
        self.spec = spec
        self.version = version
        self.bundle_digest = bundle_digest
        self.entry = entry
        self.deployed_at = deployed_at
        self.startup_failures = 0
        self.last_startup_error = ""  # the new version's, from now on
        self.backoff_until = 0.0

    @property
    def settings(self) -> EndpointSettings:
        """What the deployed version asks for, with any override's changes in place."""
        return self.overridden or self.spec.settings

    def demand(self) -> Demand:
        return settings_demand(self.settings, self.bundle_digest, self.label)


def settings_demand(settings: EndpointSettings, bundle_digest: str = "", label: str = "") -> Demand:
    """What one replica of an endpoint with `settings` needs of the nodes."""
    return Demand(
        cpu=settings.cpu,
        memory=settings.memory,
        gpus=settings.gpu_choices,
        bundle_digest=bundle_digest,
        label=label,
        spread=settings.spread,
        nodes=settings.nodes,
        node_labels=tuple(sorted(settings.node_labels.items())),
    )


@dataclass(eq=False)
class Replica:
    id: str
    endpoint: EndpointRuntime
    version: int
    worker_id: str
    token: str  # opens its channel; never given to user code
    gpu: GpuChoice | None = None  # the GPU type and count it holds (one of its choices)
    state: ReplicaState = ReplicaState.STARTING
    created_at: float = field(default_factory=time.time)  # placed (or adopted) by this process
    # When its node was told to run it: created_at, or earlier for an adopted replica.
    placed_at: float = field(default_factory=time.time)
    ready_at: float | None = None
    last_seen: float = field(default_factory=time.time)
    idle_since: float | None = None
    inflight: dict[str, Input] = field(default_factory=dict)
    outbox: asyncio.Queue[str] | None = None  # set while its channel is connected
    start: dict[str, Any] = field(default_factory=dict)  # kind and phase durations
    served: int = 0  # inputs finished
    assigned: int = 0  # inputs handed to it, retries included (what max_inputs counts)
    # An invoke token for the replica's own code (one endpoint calling another), valid
    # while its channel is connected: see Channels.replica.
    call_token: str = field(default_factory=lambda: TOKEN_PREFIX + secrets.token_urlsafe(32))
    # A lazily restored replica's messages about its inputs (header, body), held until
    # its worker says all of its memory is in (None: passed on at once). See
    # `ReplicaLifecycle.ready`.
    held: list[tuple[AboutInput, str]] | None = None
    held_bytes: int = 0  # of `held`'s bodies: bounded (live_state.MAX_HELD_MIB)
    # Its channel closed while it had work: lost for that when this fires, unless its
    # worker reports the process's end first.
    disconnect_timer: asyncio.TimerHandle | None = None
    # Whether the last message it sent was a piece of a result (`ResultPart`): its
    # channel is then read on past its workspace's budget, until the next other message.
    mid_result: bool = False
    memory_bytes: int | None = None  # its process tree's use, from its worker's heartbeats
    cpu_throttled_seconds: float | None = None  # its wait under cpu_limit=, likewise
    # Its version's methods and concurrency: after a redeploy it may still serve inputs
    # whose method the new version has unchanged (`previous_version_replica`).
    methods: dict[str, MethodSpec] = field(default_factory=dict)
    concurrency: int = 1
    restoring_from: tuple[str, str] | None = None  # (key, image id) it is restored from
    gang: Gang | None = None  # the gang it is a member of (None: a replica of its own)

    @property
    def rank(self) -> int:
        """Its rank in its gang (0 where it has none: it takes the inputs)."""
        return 0 if self.gang is None else self.gang.members.index(self)

    def send(self, header: wire.ToReplica, body: bytes | str = b"") -> None:
        """A message on its channel, if connected (else dropped)."""
        if self.outbox is not None:
            self.outbox.put_nowait(wire.frame(header, body))


@dataclass(eq=False)
class Gang:
    """One replica over several nodes: a member process on each, placed, started and
    ended together. The first (rank 0) is the replica the endpoint counts and sends
    inputs to; the others live in the picture (their channels, heartbeats and the
    resources they hold) but not among the endpoint's replicas."""

    id: str
    members: list[Replica]  # by rank
    first_port: int  # member r listens on ports first_port + r * ports_each onwards
    ports_each: int
    size: int  # members (a gang a restarted control plane only knows of: none of them here)
    lead_ready: wire.StartReport | None = None  # rank 0 said ready before the others
    # gang_inputs="every_rank" of the version it started as: each member but rank 0 runs
    # a copy of each of rank 0's inputs. The copies each member has not ended yet, by
    # member id: rank 0 takes no more inputs than that member could run beside them.
    every_rank: bool = False
    copies: dict[str, set[str]] = field(default_factory=dict)
    # Members whose processes may still run (their end not yet reported): the gang's
    # ports stay its own until none does (LiveState.gangs).
    running: dict[str, str] = field(default_factory=dict)  # replica id -> its worker's id

    @property
    def lead(self) -> Replica:
        return self.members[0]

    @property
    def port_count(self) -> int:
        return self.ports_each * self.size

    @property
    def workspace(self) -> str:
        return split_app_key(self.lead.endpoint.app)[0] if self.members else ""

    def echoed(self) -> list[Replica]:
        """The members that run a copy of each of the lead's inputs: every one but rank 0
        where the endpoint said gang_inputs="every_rank", else none."""
        return self.members[1:] if self.every_rank else []

    def behind(self) -> bool:
        """A member still runs as many copies as rank 0 may run inputs: rank 0 waits for
        it (so nothing piles up for a member that does not keep up)."""
        limit = self.lead.concurrency
        return any(len(self.copies.get(m.id, ())) >= limit for m in self.echoed())

    def all_ready(self) -> bool:
        """Every member but the lead is ready (the lead turns ready after them)."""
        return all(m.state is ReplicaState.READY for m in self.members[1:])


@dataclass(eq=False)
class Worker:
    id: str
    name: str
    cpu: float
    memory: int
    gpus: dict[str, int]
    outbox: asyncio.Queue[str] = field(default_factory=asyncio.Queue)
    last_seen: float = field(default_factory=time.time)
    bundles: set[str] = field(default_factory=set)
    snapshots: dict[str, Any] = field(default_factory=dict)  # {"problem", "env_key", "criu"}
    memory_limits_problem: str | None = None  # why it cannot enforce memory_limit=
    cpu_limits_problem: str | None = None  # why it cannot enforce cpu_limit=
    gpu_samples: list[dict[str, Any]] = field(default_factory=list)  # NVML, last heartbeat
    gpu_health: list[wire.GpuHealth] = field(default_factory=list)  # last heartbeat's
    gpus_refused_at: float | None = None  # when it last had no GPU free for a placement
    room_refused_at: float | None = None  # likewise, no CPUs or memory (booked by others)
    booked: list[float] | None = None  # [CPUs, MiB] its replicas were placed for, by its word
    channel: str = "https"  # or "unix socket": the control plane's, on the worker's machine
    labels: dict[str, str] = field(default_factory=dict)  # `ember worker --label KEY=VALUE`
    leaving: bool = False  # it was asked to stop and lets its replicas finish first
    cached_snapshots: set[tuple[str, str]] = field(default_factory=set)  # (key, image id)
    cached_weights: dict[str, int] = field(default_factory=dict)  # object URL -> bytes on disk
    instance: str = ""  # the agent process's own random id: tells a reconnect from a namesake
    pid: int | None = None  # the agent's, on its machine: for a namesake's refusal
    loopback: str = ""  # the loopback its replicas' forwards reach (Hello.loopback)

    def send(self, message: wire.ToAgent) -> None:
        self.outbox.put_nowait(wire.encode(message))

    def fenced_gpus(self, tracked: Container[str]) -> dict[str, int]:
        """GPUs fenced for their health, by type, less those held by replicas in `tracked`
        (the control plane's: their own GPU counts cover them). A fenced GPU whose holder
        the control plane has let go of (lost, or drained while starting) still counts,
        until its process ends, if ever: none is placed on it meanwhile."""
        fenced: dict[str, int] = {}
        for gpu in self.gpu_health:
            if gpu.fenced and not any(holder in tracked for holder in gpu.replicas):
                fenced[gpu.kind] = fenced.get(gpu.kind, 0) + 1
        return fenced


def rollout_status(runtime: EndpointRuntime) -> dict[str, int]:
    """How far the serving version has replaced older ones: its replicas ready and
    starting, and those of older versions not gone yet (serving or draining)."""
    status = {"ready": 0, "starting": 0, "previous": 0}
    for replica in runtime.replicas.values():
        if replica.version != runtime.version:
            status["previous"] += 1
        elif replica.state is ReplicaState.READY:
            status["ready"] += 1
        elif replica.state is ReplicaState.STARTING:
            status["starting"] += 1
    return status


def replica_states(runtime: EndpointRuntime) -> dict[str, int]:
    """How many of the runtime's replicas are in each state."""
    states: dict[str, int] = {}
    for replica in runtime.replicas.values():
        states[replica.state.value] = states.get(replica.state.value, 0) + 1
    return states
