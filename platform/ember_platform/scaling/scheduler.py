"""Placement: which worker node runs a new replica. Pure functions over capacities."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ember.declarations.node_labels import format_labels

GpuChoice = tuple[str, int]  # (type, count)
ZONE_LABEL = "zone"  # a node label replicas spread over (`ember worker --label zone=...`)


@dataclass(frozen=True)
class Demand:
    cpu: float
    memory: int  # MiB
    gpus: tuple[GpuChoice, ...]  # choices in order of preference; () for none
    bundle_digest: str
    label: str = ""  # the endpoint's, whose replicas are spread over the nodes
    node_labels: tuple[tuple[str, str], ...] = ()  # (name, value) a node must carry
    # (worker id, GPU choice) where a replica would restore from an image that node
    # already holds: no download before the restore.
    images_at: frozenset[tuple[str, GpuChoice | None]] = frozenset()
    # (worker id, bytes) of the endpoint's weights= that node's disk cache holds: a cold
    # boot there reads them from disk, not from their origin.
    weights_at: frozenset[tuple[str, int]] = frozenset()
    spread: bool = True  # over zones and nodes (False: packed onto the fewest nodes)
    nodes: int = 1  # a gang's members, each on a node of its own with all of the above


@dataclass(frozen=True)
class Placement:
    worker_id: str
    gpu: GpuChoice | None  # the choice it runs with


@dataclass(frozen=True)
class NodeCapacity:
    worker_id: str
    cpu: float
    memory: int
    gpus: dict[str, int]  # type -> count on the node
    cpu_used: float = 0.0
    memory_used: int = 0
    gpus_used: dict[str, int] = field(default_factory=dict)
    bundles: frozenset[str] = frozenset()  # bundle digests already on the node
    # Live replicas (starting or ready) on the node, by endpoint label.
    replicas: dict[str, int] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)  # `ember worker --label`
    draining: bool = False  # `ember node drain`: keeps what runs there, takes nothing new
    # The loopback its replicas' forwarded ports reach (nodes sharing one may run one
    # gang's members: they meet there); "" stands for a loopback of its own.
    loopback: str = ""

    @property
    def meeting_place(self) -> str:
        return self.loopback or f"node {self.worker_id}"

    def carries(self, demand: Demand) -> bool:
        return all(self.labels.get(key) == value for key, value in demand.node_labels)

    def fits(self, demand: Demand, gpu: GpuChoice | None = None) -> bool:
        """Room for the demand now, with GPU choice `gpu` (None: any of its choices), on
        a node that carries its labels and is not draining."""
        if self.draining or not self.carries(demand):
            return False
        if self.cpu - self.cpu_used < demand.cpu - 1e-9:
            return False
        if self.memory - self.memory_used < demand.memory:
            return False
        choices = demand.gpus if gpu is None else (gpu,)
        return not choices or any(
            self.gpus.get(kind, 0) - self.gpus_used.get(kind, 0) >= count for kind, count in choices
        )

    def could_ever_fit(self, demand: Demand) -> bool:
        """Whether it could run the replica once empty (and no longer draining: a drain is
        for maintenance, so calls wait for it to end or for another node)."""
        empty = NodeCapacity(self.worker_id, self.cpu, self.memory, self.gpus, labels=self.labels)
        return empty.fits(demand)


def place(demand: Demand, nodes: Sequence[NodeCapacity]) -> Placement | None:
    """Where to start a replica, and with which GPU choice; None if every node is full
    right now (a gang's first member: `place_gang` places them all)."""
    placed = place_gang(dataclasses.replace(demand, nodes=1), nodes)
    return placed[0] if placed else None


def place_gang(demand: Demand, nodes: Sequence[NodeCapacity]) -> list[Placement] | None:
    """Where to start each of a replica's `demand.nodes` members (one: a replica of its
    own), each on a node of its own, all with one GPU choice and all on nodes sharing
    one loopback (where they meet); None if they do not all fit right now (a gang holds
    nothing until all of it can start).

    GPU choices go in the endpoint's order: a later one only when the nodes lack room
    for the earlier ones. Among the nodes that fit, those in the zone (the `zone` label;
    nodes without one are a zone together) running the fewest of the endpoint's replicas
    come first, then those running the fewest themselves, so that one zone or node
    failing does not take them all (a node's first download of a bundle and image is
    paid once; an outage of every replica is paid by every caller); with `spread` off,
    those running the most, packed. Then one that already holds the snapshot image the
    replica would restore from (a download of hundreds of MB saved: the restore starts
    at once), then one that holds more of the endpoint's weights (a cold boot reads them
    from disk: GBs not downloaded), then one that holds the bundle, then the one with
    the most free CPU.
    """
    weights_held = dict(demand.weights_at)
    in_zone: dict[str, int] = {}
    for node in nodes:
        zone = node.labels.get(ZONE_LABEL, "")
        in_zone[zone] = in_zone.get(zone, 0) + node.replicas.get(demand.label, 0)
    sign = -1 if demand.spread else 1
    for gpu in demand.gpus or (None,):
        candidates = [n for n in nodes if n.fits(demand, gpu)]
        if len(candidates) < demand.nodes:
            continue
        ranked = sorted(
            candidates,
            key=lambda n: (
                sign * in_zone[n.labels.get(ZONE_LABEL, "")],
                sign * n.replicas.get(demand.label, 0),
                (n.worker_id, gpu) in demand.images_at,
                weights_held.get(n.worker_id, 0),
                demand.bundle_digest in n.bundles,
                n.cpu - n.cpu_used,
                n.worker_id,
            ),
            reverse=True,
        )
        together: dict[str, list[NodeCapacity]] = {}
        for node in ranked:  # the best-ranked loopback with enough nodes first
            together.setdefault(node.meeting_place, []).append(node)
        for group in together.values():
            if len(group) >= demand.nodes:
                return [Placement(node.worker_id, gpu) for node in group[: demand.nodes]]
    return None


def member_needs(demand: Demand) -> str:
    """What one member of a gang needs, as a sentence's part."""
    gpus = " or ".join(f"{count} x {gpu}" for gpu, count in demand.gpus)
    return f"cpu={demand.cpu:g}, memory={demand.memory} MiB" + (f", {gpus} GPU" if gpus else "")


def weights_bytes_held(urls: Iterable[str], holdings: Mapping[str, int]) -> int:
    """Bytes of the weights at `urls` (as in `weights=`) among a node's `holdings` (bytes
    by object URL): a file's own URL, or the objects of a sharded checkpoint, under a
    folder URL ending in "/" or beside its index (`....json`)."""
    held = 0
    for url in set(urls):
        if url.endswith("/"):
            folder = url
        elif url.endswith(".json"):
            folder = url.rsplit("/", 1)[0] + "/"
        else:
            held += holdings.get(url, 0)
            continue
        held += sum(size for object_url, size in holdings.items() if object_url.startswith(folder))
    return held


def unservable_reason(demand: Demand, nodes: Sequence[NodeCapacity]) -> str | None:
    """Why no registered nodes could ever run this replica (a gang: as many nodes as it
    has members), or None if they could."""
    able: dict[str, int] = {}
    for node in nodes:
        if node.could_ever_fit(demand):
            able[node.meeting_place] = able.get(node.meeting_place, 0) + 1
    most = max(able.values(), default=0)
    if most >= demand.nodes:
        return None
    if most:
        return (
            f"the replica is a gang of {demand.nodes} members, each on a node of its own, "
            "all on nodes of one machine (they meet on its loopback), and at most "
            f"{most} nodes of one machine could run one ({member_needs(demand)}); join "
            f"{demand.nodes - most} more to the same machine"
        )
    if not nodes:
        return "no worker nodes are registered; start one with `ember worker --server URL`"
    kind = ""
    if demand.node_labels:
        wanted_labels = format_labels(dict(demand.node_labels))
        registered = sorted({format_labels(n.labels) for n in nodes if n.labels})
        nodes = [n for n in nodes if n.carries(demand)]
        if not nodes:
            listed = "; ".join(registered) if registered else "none"
            flags = " ".join(f"--label {key}={value}" for key, value in demand.node_labels)
            return (
                f"no worker has the labels {wanted_labels} (workers' labels: {listed}); "
                f"join one with `ember worker {flags}`"
            )
        kind = f" with labels {wanted_labels}"
    if demand.gpus:
        have = sorted({g for n in nodes for g in n.gpus})
        wanted = " or ".join(f"{count} x {gpu}" for gpu, count in demand.gpus)
        nodes = [n for n in nodes if any(n.gpus.get(gpu, 0) >= count for gpu, count in demand.gpus)]
        if not nodes:
            listed = ", ".join(have) if have else "none"
            return f"no worker{kind} has {wanted} GPU (GPU types registered: {listed})"
        kind += f" with {wanted}"
    return (
        f"no worker{kind} is large enough for cpu={demand.cpu:g}, memory={demand.memory} MiB "
        f"(largest: cpu={max(n.cpu for n in nodes):g}, "
        f"memory={max(n.memory for n in nodes)} MiB)"
    )


@dataclass(frozen=True)
class Held:
    """What one replica holds on its node, as making room sees it."""

    replica_id: str
    worker_id: str
    cpu: float
    memory: int
    gpu: GpuChoice | None
    idle_since: float | None  # None: it is stopping already, its room is coming back


def _without(node: NodeCapacity, held: Held) -> NodeCapacity:
    gpus_used = dict(node.gpus_used)
    if held.gpu is not None:
        kind, count = held.gpu
        gpus_used[kind] = gpus_used.get(kind, 0) - count
    return NodeCapacity(
        node.worker_id,
        node.cpu,
        node.memory,
        node.gpus,
        node.cpu_used - held.cpu,
        node.memory_used - held.memory,
        gpus_used,
        node.bundles,
        node.replicas,
        node.labels,
        node.draining,
        node.loopback,
    )


def _helps(node: NodeCapacity, demand: Demand, held: Held) -> bool:
    """Whether `held` gives back some of what `node` lacks for `demand`."""
    if held.cpu > 0 and node.cpu - node.cpu_used < demand.cpu - 1e-9:
        return True
    if held.memory > 0 and node.memory - node.memory_used < demand.memory:
        return True
    gpus_short = demand.gpus and not any(
        node.gpus.get(kind, 0) - node.gpus_used.get(kind, 0) >= count for kind, count in demand.gpus
    )
    return bool(gpus_short and held.gpu and any(held.gpu[0] == kind for kind, _ in demand.gpus))


def room_by_stopping(
    demand: Demand, nodes: Sequence[NodeCapacity], evictable: Sequence[Held]
) -> list[str] | None:
    """Idle replicas to stop so that `demand` fits on a node: on the node where the
    fewest are needed, the longest idle first. Replicas already stopping count as room
    that is coming (so [] means: wait, do not stop more). None if stopping every idle
    replica would not make room anywhere."""
    best: list[str] | None = None
    for node in nodes:
        chosen = _room_on(demand, node, [h for h in evictable if h.worker_id == node.worker_id])
        if chosen is not None and (best is None or len(chosen) < len(best)):
            best = chosen
    return best


def _room_on(demand: Demand, node: NodeCapacity, here: list[Held]) -> list[str] | None:
    freed = node
    for leaving in (h for h in here if h.idle_since is None):
        freed = _without(freed, leaving)
    if freed.fits(demand):
        return []
    idle = sorted((h for h in here if h.idle_since is not None), key=lambda h: h.idle_since or 0.0)
    for held in idle:  # one alone, if one will do
        if _without(freed, held).fits(demand):
            return [held.replica_id]
    chosen = []
    for held in idle:
        if _helps(freed, demand, held):  # skip those holding only what is not short
            freed = _without(freed, held)
            chosen.append(held.replica_id)
            if freed.fits(demand):
                return chosen
    return None
