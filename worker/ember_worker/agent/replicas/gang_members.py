"""A gang member's place among its peers, as its process sees it: the variables
torchrun would give it, and the ports it may listen on."""

from __future__ import annotations

import ipaddress

from ember.wire.gangs import GangMember


def gang_env(member: GangMember) -> dict[str, str]:
    """torchrun's variables (one process per node: its local rank is 0), and the ports
    it may listen on. On loopback (nodes on one machine), gloo and NCCL bind there."""
    first, last = member.ports_of(member.rank)
    env = {
        "RANK": str(member.rank),
        "WORLD_SIZE": str(member.size),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "NODE_RANK": str(member.rank),
        "GROUP_RANK": str(member.rank),
        "MASTER_ADDR": member.master_addr,
        "MASTER_PORT": str(member.first_port),
        "EMBER_GANG_ID": member.gang_id,
        "EMBER_GANG_PORTS": f"{first}-{last}",
    }
    if ipaddress.ip_address(member.master_addr).is_loopback:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = "lo"
    return env
