"""The ports a gang member's network namespace forwards: its own in, its peers' out.

A gang's members reach each other on the loopback of the machine their nodes share
(the control plane places a gang on nodes of one loopback alone): a member's pasta
takes its own ports in at the node's 127.0.0.1 and forwards its peers' from its own
loopback there. Nothing else of the node's, and no other replica, reaches them: other
replicas' pastas forward none of these ports."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ember.wire.gangs import GangMember

Ports = tuple[int, int]  # first, last
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class GangPorts:
    own: Ports  # taken in at the node's loopback: what its processes bind, ephemeral too
    peers: tuple[Ports, ...]  # forwarded from its loopback to the node's


def gang_ports(member: GangMember) -> GangPorts:
    """The ports `member`'s network forwards."""
    peers = tuple(member.ports_of(rank) for rank in range(member.size) if rank != member.rank)
    return GangPorts(own=member.ports_of(member.rank), peers=peers)


def node_loopback() -> str:
    """This agent's loopback, as nodes compare theirs: its boot (the machine, until it
    restarts) and its network namespace. Two workers of one machine and namespace share
    it, so their replicas' forwards reach each other."""
    with open("/proc/sys/kernel/random/boot_id") as boot:
        machine = boot.read().strip()
    return f"{machine}:{os.stat('/proc/self/ns/net').st_ino}"
