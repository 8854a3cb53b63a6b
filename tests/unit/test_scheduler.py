"""Placement of replicas on worker nodes."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from ember_platform.scaling.scheduler import (
    Demand,
    Held,
    NodeCapacity,
    Placement,
    room_by_stopping,
    unservable_reason,
    weights_bytes_held,
)
from ember_platform.scaling.scheduler import place as placement

BUNDLE = "sha256:abc"


def demand(
    cpu: float = 1.0,
    memory: int = 512,
    gpu_type: str | None = None,
    gpu_count: int = 0,
    bundle: str = BUNDLE,
    gpus: tuple[tuple[str, int], ...] | None = None,
) -> Demand:
    choices = gpus if gpus is not None else (((gpu_type, gpu_count),) if gpu_type else ())
    return Demand(cpu, memory, choices, bundle)


def place(wanted: Demand, nodes: list[NodeCapacity]) -> str | None:
    """The worker the replica goes to, or None."""
    found = placement(wanted, nodes)
    return None if found is None else found.worker_id


def node(
    worker_id: str,
    cpu: float = 8.0,
    memory: int = 16_384,
    gpus: dict[str, int] | None = None,
    cpu_used: float = 0.0,
    memory_used: int = 0,
    gpus_used: dict[str, int] | None = None,
    bundles: tuple[str, ...] = (),
) -> NodeCapacity:
    return NodeCapacity(
        worker_id,
        cpu,
        memory,
        gpus or {},
        cpu_used,
        memory_used,
        gpus_used or {},
        frozenset(bundles),
    )


# --- place ---------------------------------------------------------------------------------


def test_no_nodes() -> None:
    assert place(demand(), []) is None


def test_prefers_node_holding_the_bundle_over_free_cpu() -> None:
    nodes = [
        node("big", cpu=64),
        node("warm", cpu=4, cpu_used=2, bundles=("sha256:other", BUNDLE)),
        node("mid", cpu=16),
    ]
    assert place(demand(), nodes) == "warm"


def test_then_most_free_cpu() -> None:
    nodes = [
        node("a", cpu=16, cpu_used=12),  # 4 free
        node("b", cpu=8, cpu_used=1),  # 7 free
        node("c", cpu=32, cpu_used=30),  # 2 free
    ]
    assert place(demand(), nodes) == "b"


def test_most_free_cpu_among_bundle_holders() -> None:
    nodes = [
        node("a", cpu=8, cpu_used=6, bundles=(BUNDLE,)),
        node("b", cpu=8, cpu_used=2, bundles=(BUNDLE,)),
        node("c", cpu=64),
    ]
    assert place(demand(), nodes) == "b"


def test_bundle_holder_that_is_full_is_skipped() -> None:
    nodes = [node("warm", cpu=2, cpu_used=1.5, bundles=(BUNDLE,)), node("cold", cpu=4)]
    assert place(demand(cpu=1), nodes) == "cold"


def test_choice_does_not_depend_on_node_order() -> None:
    nodes = [node("a"), node("b"), node("c", cpu_used=1), node("d", cpu=4)]
    answers = {place(demand(), list(order)) for order in itertools.permutations(nodes)}
    assert len(answers) == 1


def test_spreads_replicas_when_used_capacity_is_updated() -> None:
    # Place four replicas one at a time, adding each to its node's usage, like the controller.
    nodes = {n.worker_id: n for n in (node("a", cpu=4), node("b", cpu=4))}
    placed = []
    for _ in range(4):
        chosen = place(demand(cpu=1), list(nodes.values()))
        assert chosen is not None
        placed.append(chosen)
        old = nodes[chosen]
        nodes[chosen] = node(chosen, cpu=old.cpu, cpu_used=old.cpu_used + 1)
    assert sorted(placed) == ["a", "a", "b", "b"]


def test_an_endpoints_replicas_spread_over_nodes_before_the_bundle_draws_them() -> None:
    label = "app--model"
    wanted = Demand(1.0, 512, (), BUNDLE, label)
    warm = node("warm", bundles=(BUNDLE,))
    cold = node("cold")
    assert place(wanted, [warm, cold]) == "warm"  # none running yet: the bundle decides
    warm = NodeCapacity("warm", 8.0, 16_384, {}, 1.0, 512, {}, frozenset([BUNDLE]), {label: 1})
    assert place(wanted, [warm, cold]) == "cold"  # one node failing would take them all
    # Other endpoints' replicas do not count against it.
    busy = NodeCapacity("warm", 8.0, 16_384, {}, 1.0, 512, {}, frozenset([BUNDLE]), {"x--y": 3})
    assert place(wanted, [busy, cold]) == "warm"


def test_replicas_spread_over_zones_before_nodes_and_pack_when_asked() -> None:
    label = "app--model"
    wanted = Demand(1.0, 512, (), BUNDLE, label)

    def zoned(worker_id: str, zone: str, running: int, cpu_used: float = 0.0) -> NodeCapacity:
        return NodeCapacity(
            worker_id,
            8.0,
            16_384,
            {},
            cpu_used,
            0,
            {},
            frozenset(),
            {label: running},
            labels={"zone": zone},
        )

    # Two nodes in zone a run one each, zone b's node none: b, though a-2 has more CPU.
    nodes = [zoned("a-1", "a", 1, 4.0), zoned("a-2", "a", 0), zoned("b-1", "b", 1, 6.0)]
    assert place(wanted, nodes) == "a-2"  # a holds 1, b holds 1: then the node's own count
    nodes = [zoned("a-1", "a", 1), zoned("a-2", "a", 1), zoned("b-1", "b", 0, 6.0)]
    assert place(wanted, nodes) == "b-1"  # zone a holds 2, b none
    nodes = [zoned("a-1", "a", 1), zoned("a-2", "a", 0), zoned("b-1", "b", 0, 6.0)]
    assert place(wanted, nodes) == "b-1"  # a-2 is empty, but its zone is not
    # Nodes without a zone label are one zone together.
    plain = [node("n-1"), NodeCapacity("n-2", 8.0, 16_384, {}, replicas={label: 1})]
    assert place(wanted, plain) == "n-1"
    # spread=False: packed onto the node (and zone) running the most.
    packed = dataclasses.replace(wanted, spread=False)
    nodes = [zoned("a-1", "a", 2), zoned("a-2", "a", 0), zoned("b-1", "b", 1)]
    assert place(packed, nodes) == "a-1"


def test_a_node_holding_the_snapshot_image_comes_before_bundle_holders_and_free_cpu() -> None:
    label = "app--model"
    wanted = Demand(1.0, 512, (), BUNDLE, label, images_at=frozenset({("image", None)}))
    nodes = [node("big", cpu=64), node("bundle", bundles=(BUNDLE,)), node("image", cpu=2)]
    assert place(wanted, nodes) == "image"
    assert place(Demand(1.0, 512, (), BUNDLE, label), nodes) == "bundle"  # no image anywhere
    # Spreading still comes first: a second replica goes where none runs yet.
    spread = NodeCapacity("image", 2.0, 16_384, {}, 1.0, 512, {}, frozenset(), {label: 1})
    assert place(wanted, [nodes[0], nodes[1], spread]) == "bundle"
    # A holder that is full is skipped.
    full = node("image", cpu=2, cpu_used=1.5)
    assert place(wanted, [nodes[1], full]) == "bundle"


def test_nodes_holding_more_of_the_weights_come_after_the_image_and_before_the_bundle() -> None:
    label = "app--model"
    some, most = ("some", 2 << 30), ("most", 9 << 30)
    wanted = Demand(1.0, 512, (), BUNDLE, label, weights_at=frozenset({some, most}))
    nodes = [node("big", cpu=64), node("bundle", bundles=(BUNDLE,)), node("some"), node("most")]
    assert place(wanted, nodes) == "most"
    # The image holds the weights too: its holder starts at once, with no reads at all.
    with_image = dataclasses.replace(wanted, images_at=frozenset({("big", None)}))
    assert place(with_image, nodes) == "big"
    # Spreading still comes first.
    spread = NodeCapacity("most", 2.0, 16_384, {}, 1.0, 512, {}, frozenset(), {label: 1})
    assert place(wanted, [*nodes[:3], spread]) == "some"
    assert place(Demand(1.0, 512, (), BUNDLE, label), nodes) == "bundle"  # no weights cached


@pytest.mark.parametrize(
    ("urls", "held"),
    [
        (["s3://m/model.safetensors"], 5),  # one file
        (["s3://m/sharded/"], 30),  # a folder's shards and index
        (["s3://m/sharded/model.safetensors.index.json"], 30),  # its index names them
        (["s3://m/model.safetensors", "s3://m/model.safetensors"], 5),  # listed twice: once
        (["s3://m/other.safetensors", "https://m/model.safetensors"], 0),
    ],
)
def test_weights_bytes_held_by_url(urls: list[str], held: int) -> None:
    holdings = {
        "s3://m/model.safetensors": 5,
        "s3://m/sharded/model.safetensors.index.json": 1,
        "s3://m/sharded/a.safetensors": 14,
        "s3://m/sharded/b.safetensors": 15,
        "s3://m/sharded-2/a.safetensors": 100,
    }
    assert weights_bytes_held(urls, holdings) == held


def test_the_image_counts_only_for_the_gpu_choice_it_was_taken_with() -> None:
    # An image of the H100 key on node "a" does not draw an A100 replica there: its key
    # differs, so that replica would not restore from it.
    h100, a100 = ("H100", 1), ("A100", 1)
    wanted = Demand(1.0, 512, (h100, a100), BUNDLE, images_at=frozenset({("a", h100)}))
    a = node("a", gpus={"H100": 1, "A100": 1}, gpus_used={"H100": 1})
    b = node("b", cpu=16, gpus={"A100": 1})
    assert placement(wanted, [a, b]) == Placement("b", a100)
    wanted = dataclasses.replace(wanted, images_at=frozenset({("a", a100)}))
    assert placement(wanted, [a, b]) == Placement("a", a100)


@pytest.mark.parametrize(
    "full",
    [
        node("x", cpu=4, cpu_used=3.5),  # cpu
        node("x", memory=1024, memory_used=700),  # memory
        node("x", cpu=0.5),  # too small
    ],
)
def test_none_when_all_full(full: NodeCapacity) -> None:
    assert place(demand(cpu=1, memory=512), [full, full]) is None
    # Full right now, but not unservable: it could fit once replicas leave.
    if full.cpu >= 1:
        assert unservable_reason(demand(cpu=1, memory=512), [full]) is None


def test_exact_fit_counts_as_fitting() -> None:
    assert (
        place(
            demand(cpu=2, memory=512), [node("x", cpu=4, cpu_used=2, memory=1024, memory_used=512)]
        )
        == "x"
    )
    # Float sums of used CPU must not make an exact fit fail.
    assert place(demand(cpu=0.2), [node("x", cpu=0.3, cpu_used=0.1)]) == "x"
    assert place(demand(cpu=0.3), [node("x", cpu=1.0, cpu_used=0.1 + 0.6)]) == "x"


def test_gpu_type_must_match() -> None:
    nodes = [
        node("cpu-only", cpu=64),
        node("a100", gpus={"A100": 8}),
        node("h100", gpus={"H100": 1}),
    ]
    assert place(demand(gpu_type="H100", gpu_count=1), nodes) == "h100"
    assert place(demand(gpu_type="L4", gpu_count=1), nodes) is None


def test_gpu_count_must_fit_free_gpus() -> None:
    nodes = [
        node("one", gpus={"H100": 8}, gpus_used={"H100": 7}),
        node("four", gpus={"H100": 4}),
        node("two", cpu=64, gpus={"H100": 2}),
    ]
    assert place(demand(gpu_type="H100", gpu_count=4), nodes) == "four"
    assert place(demand(gpu_type="H100", gpu_count=2), nodes) == "two"  # most free CPU
    assert place(demand(gpu_type="H100", gpu_count=8), nodes) is None


def test_gpu_usage_of_other_types_does_not_count() -> None:
    n = node("mixed", gpus={"H100": 2, "L4": 4}, gpus_used={"L4": 4})
    assert place(demand(gpu_type="H100", gpu_count=2), [n]) == "mixed"
    assert place(demand(gpu_type="L4", gpu_count=1), [n]) is None


def test_cpu_demand_may_land_on_gpu_node() -> None:
    assert place(demand(), [node("gpu", gpus={"H100": 8})]) == "gpu"


# --- unservable_reason --------------------------------------------------------------------


def test_servable_returns_none() -> None:
    nodes = [node("a", gpus={"H100": 2}, gpus_used={"H100": 2}, cpu_used=8)]
    # Fully used now, but an empty node of this size could run it.
    assert unservable_reason(demand(gpu_type="H100", gpu_count=2), nodes) is None
    assert unservable_reason(demand(), nodes) is None


def test_no_workers_registered() -> None:
    reason = unservable_reason(demand(), [])
    assert reason is not None
    assert "no worker nodes are registered" in reason
    assert "ember worker --server" in reason


def test_missing_gpu_type_named_and_registered_types_listed() -> None:
    nodes = [node("a", gpus={"L4": 2}), node("b", gpus={"A100": 8, "L4": 1}), node("c")]
    reason = unservable_reason(demand(gpu_type="H100", gpu_count=1), nodes)
    assert reason is not None
    assert "H100" in reason
    assert "GPU types registered: A100, L4" in reason


def test_missing_gpu_with_no_gpus_anywhere() -> None:
    reason = unservable_reason(demand(gpu_type="H100", gpu_count=1), [node("a")])
    assert reason is not None
    assert "H100" in reason
    assert "registered: none" in reason


def test_too_many_gpus_of_a_known_type() -> None:
    reason = unservable_reason(demand(gpu_type="H100", gpu_count=8), [node("a", gpus={"H100": 4})])
    assert reason is not None
    assert "8 x H100" in reason
    assert "H100" in reason.split("registered:")[1]


@pytest.mark.parametrize(
    ("d", "fragment"),
    [
        (demand(cpu=128), "cpu=128"),
        (demand(memory=1_000_000), "memory=1000000 MiB"),
    ],
)
def test_too_large_for_any_node(d: Demand, fragment: str) -> None:
    nodes = [node("a", cpu=8, memory=16_384), node("b", cpu=32, memory=4096)]
    reason = unservable_reason(d, nodes)
    assert reason is not None
    assert "no worker is large enough" in reason
    assert fragment in reason
    assert "largest: cpu=32, memory=16384 MiB" in reason


def test_reason_for_gpu_node_too_small_mentions_the_gpu() -> None:
    nodes = [node("gpu", cpu=2, gpus={"H100": 1}), node("big", cpu=64)]
    d = demand(cpu=8, gpu_type="H100", gpu_count=1)
    assert place(d, nodes) is None
    reason = unservable_reason(d, nodes)
    assert reason is not None
    assert "H100" in reason


def test_gpu_choices_go_in_order_of_preference() -> None:
    wanted = demand(gpus=(("H100", 1), ("A100", 2)))
    both = [node("a100s", gpus={"A100": 4}), node("h100s", cpu=2.0, gpus={"H100": 1})]
    # The first choice wherever a node has it free, even a smaller node.
    assert placement(wanted, both) == Placement("h100s", ("H100", 1))
    # It is taken: the second choice, with its own count.
    taken = [both[0], node("h100s", gpus={"H100": 1}, gpus_used={"H100": 1})]
    assert placement(wanted, taken) == Placement("a100s", ("A100", 2))
    # Two A100s are not free either: nowhere now, though it could be served.
    full = [node("a100s", gpus={"A100": 4}, gpus_used={"A100": 3}), taken[1]]
    assert placement(wanted, full) is None
    assert unservable_reason(wanted, full) is None
    # No GPU for a demand without one.
    assert placement(demand(), both) == Placement("a100s", None)


def test_no_gpu_choice_anywhere_names_them_all() -> None:
    wanted = demand(gpus=(("H100", 1), ("A100", 2)))
    reason = unservable_reason(wanted, [node("a", gpus={"L4": 2}), node("b", gpus={"A100": 1})])
    assert reason == "no worker has 1 x H100 or 2 x A100 GPU (GPU types registered: A100, L4)"


# --- making room by stopping idle replicas -------------------------------------------------


def held(
    replica_id: str,
    worker_id: str,
    cpu: float = 1.0,
    memory: int = 1024,
    gpu: tuple[str, int] | None = None,
    idle_since: float | None = 0.0,
) -> Held:
    return Held(replica_id, worker_id, cpu, memory, gpu, idle_since)


def test_the_longest_idle_replicas_go_first_on_the_node_that_needs_fewest() -> None:
    nodes = [node("a", cpu=4.0, cpu_used=4.0), node("b", cpu=4.0, cpu_used=4.0)]
    idle = [
        held("a-new", "a", idle_since=50.0),
        held("a-old", "a", idle_since=10.0),
        held("b-big", "b", cpu=2.0, idle_since=40.0),
    ]
    assert room_by_stopping(demand(cpu=1.0), nodes, idle) == ["a-old"]
    # Two CPUs: one replica on b, two on a.
    assert room_by_stopping(demand(cpu=2.0), nodes, idle) == ["b-big"]
    assert room_by_stopping(demand(cpu=2.0), nodes[:1], idle) == ["a-old", "a-new"]
    assert room_by_stopping(demand(cpu=8.0), nodes, idle) is None  # no node is that large
    assert room_by_stopping(demand(cpu=1.0), nodes, []) is None


def test_replicas_already_stopping_are_room_that_is_coming() -> None:
    nodes = [node("a", cpu=4.0, cpu_used=4.0)]
    leaving = held("leaving", "a", idle_since=None)
    assert room_by_stopping(demand(cpu=1.0), nodes, [leaving, held("idle", "a")]) == []
    assert room_by_stopping(demand(cpu=2.0), nodes, [held("idle", "a"), leaving]) == ["idle"]


def test_gpus_and_memory_come_back_with_their_replica() -> None:
    full = node("g", gpus={"H100": 2}, gpus_used={"H100": 2}, memory=4096, memory_used=4096)
    both = held("both", "g", memory=2048, gpu=("H100", 2))
    one = held("one", "g", memory=2048, gpu=None)
    wanted = demand(cpu=1.0, memory=1024, gpus=(("H100", 1),))
    assert room_by_stopping(wanted, [full], [one, both]) == ["both"]
    assert room_by_stopping(demand(cpu=1.0, memory=1024), [full], [one]) == ["one"]


# --- node labels ---------------------------------------------------------------------------


def labelled(worker_id: str, cpu_used: float = 0.0, **labels: str) -> NodeCapacity:
    return NodeCapacity(worker_id, 8.0, 16_384, {}, cpu_used, labels=labels)


def wanting(**labels: str) -> Demand:
    return Demand(1.0, 512, (), BUNDLE, node_labels=tuple(sorted(labels.items())))


def test_replicas_go_only_to_nodes_with_every_label_asked_for() -> None:
    nodes = [
        labelled("eu", zone="eu-west"),
        labelled("eu-fast", cpu_used=6.0, zone="eu-west", disk="nvme"),
        labelled("us", zone="us-east", disk="nvme"),
        labelled("plain"),
    ]
    assert place(wanting(zone="eu-west"), nodes) == "eu"  # the freer of the two
    assert place(wanting(zone="eu-west", disk="nvme"), nodes) == "eu-fast"
    assert place(wanting(), nodes) in {"eu", "us", "plain"}  # none asked: any of the freest
    full = [labelled("eu-fast", cpu_used=8.0, zone="eu-west", disk="nvme"), *nodes[2:]]
    assert place(wanting(zone="eu-west", disk="nvme"), full) is None  # waits for its node
    assert unservable_reason(wanting(zone="eu-west", disk="nvme"), full) is None


def test_labels_nobody_carries_are_named_with_the_labels_there_are() -> None:
    nodes = [labelled("us", zone="us-east"), labelled("plain")]
    reason = unservable_reason(wanting(zone="eu-west"), nodes)
    assert reason == (
        "no worker has the labels zone=eu-west (workers' labels: zone=us-east); "
        "join one with `ember worker --label zone=eu-west`"
    )
    big = Demand(64.0, 512, (), BUNDLE, node_labels=(("zone", "us-east"),))
    assert "no worker with labels zone=us-east is large enough for cpu=64" in (
        unservable_reason(big, nodes) or ""
    )


def test_making_room_looks_only_at_nodes_with_the_labels() -> None:
    nodes = [labelled("eu", cpu_used=8.0, zone="eu-west"), labelled("us", cpu_used=8.0)]
    idle = [held("on-us", "us", cpu=2.0), held("on-eu", "eu", cpu=2.0, idle_since=5.0)]
    assert room_by_stopping(wanting(zone="eu-west"), nodes, idle) == ["on-eu"]


@pytest.mark.parametrize(
    "labels",
    [{"zone": "eu west"}, {"": "x"}, {"zone": "-eu"}, {"zone": 3}, ["zone"], {"k": "v" * 64}],
)
def test_node_labels_that_cannot_be_labels_are_refused(labels: object) -> None:
    from ember.declarations.settings import EndpointSettings
    from ember.errors import InvalidError

    with pytest.raises(InvalidError, match="node_labels"):
        EndpointSettings(node_labels=labels)  # type: ignore[arg-type]


def test_a_draining_node_takes_nothing_new_but_keeps_the_endpoint_servable() -> None:
    draining = NodeCapacity("a", 8.0, 16_384, {}, draining=True)
    assert place(demand(), [draining, node("b", cpu=2.0)]) == "b"
    assert place(demand(), [draining]) is None
    assert unservable_reason(demand(), [draining]) is None  # calls wait for its return
    idle = [held("on-a", "a")]
    assert room_by_stopping(demand(), [draining], idle) is None
