"""The ports a gang member's network namespace forwards: its own in, its peers' out."""

from __future__ import annotations

from dataclasses import dataclass

from ember.wire.gangs import GangMember

Ports = tuple[int, int]  # first, last


@dataclass(frozen=True)
class GangPorts:
    """Its own ports in from the node's `address` (the ones its processes bind, its
    ephemeral ones too), and its peers' out from its loopback to the node's (peers on
    this machine; those on others are reached at their address, as any host is)."""

    address: str
    own: Ports
    peers: tuple[Ports, ...]


def gang_ports(member: GangMember, address: str) -> GangPorts:
    """The ports `member`'s network forwards, its own bound at `address` (this node's
    gang address)."""
    peers = tuple(member.ports_of(rank) for rank in range(member.size) if rank != member.rank)
    return GangPorts(address=address, own=member.ports_of(member.rank), peers=peers)
