"""Image build steps' networks (networks/namespaces.py's `build_network`): a node
without pasta fails the step saying what to install, before any process starts (never
the node's network); the builds' network uid is none of a replica's, and the egress rules
cover it; a proxy on the node's loopback is the one port forwarded."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from ember_worker.networks import namespaces as networks
from ember_worker.networks.namespaces import NET_UIDS, build_network, loopback_ports


def test_a_node_without_pasta_fails_the_step_saying_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = networks.system_tool

    def without_pasta(name: str) -> str:
        if name == "pasta":
            raise FileNotFoundError(name)
        return real(name)

    def no_process(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"a process started: {args}")

    monkeypatch.setattr(networks, "system_tool", without_pasta)
    monkeypatch.setattr(subprocess, "Popen", no_process)
    with pytest.raises(OSError, match=r"image build steps .* apt-get install passt"):
        build_network()


def test_the_builds_network_uid_is_no_replicas_and_the_egress_rules_cover_it() -> None:
    first, count = NET_UIDS.span
    assert first <= NET_UIDS.build < first + count
    replica_network_uids = range(NET_UIDS.first, NET_UIDS.first + NET_UIDS.count)
    assert NET_UIDS.build not in replica_network_uids
    with pytest.raises(ValueError):  # the replicas' mapping never reaches it
        NET_UIDS.for_replica(100_000 + NET_UIDS.count, 100_000)


def test_only_a_proxy_on_the_nodes_loopback_is_forwarded() -> None:
    proxies = [
        "http://127.0.0.1:3128",
        "http://proxy.example:8080",
        "http://localhost:99999",  # no port: nothing
        "http://[::1]:3129",
    ]
    assert loopback_ports(proxies) == (3128, 3129)
