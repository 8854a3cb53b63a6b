"""No link-local egress for replicas: where clouds serve instance metadata (credentials).

Replicas share the node's network (models download things), so the worker adds packet
filter rules: a chain of its own, jumped to from OUTPUT, that rejects what replicas send
to 169.254.0.0/16 (and fe80::/10), matched two ways: by the uids they run as
(`--replica-uids`, iptables' owner match), and by their cgroup v2 group (the cgroup
match's --path, which takes in every group below the agent's group of replicas,
cgroups.py). The second holds whatever the uid: a replica's snapshot phase run as uid 0
where CRIU lacks CAP_SYS_RESOURCE, and a process that could change its uid, stay in
their group (their sandbox shows them no cgroup file system to move out with).
Replicas and image build steps, with networks of their own (networks/namespaces.py),
send through pasta, which runs as their network uid: the chain refuses what those uids
send to the node's own addresses (the addrtype match's LOCAL: every interface's), with a
TCP reset for TCP (a refused connection, never a hang), to multicast and broadcast
ones, and to link-local ones. The node's loopback is reached only through the ports
pasta forwards (the control plane's, those the operator opened, a build step's proxy
there).
The chain is named after the worker's folder, so two workers on
one machine keep theirs apart; it is made anew at start (what a killed worker left goes
first) and removed when the worker stops. Other egress is left alone.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

LINK_LOCAL = {"iptables": "169.254.0.0/16", "ip6tables": "fe80::/10"}
# Multicast (a node's sockets on the wildcard address join some) and the all-ones
# broadcast.
GROUPS = {"iptables": ("224.0.0.0/4", "255.255.255.255"), "ip6tables": ("ff00::/8",)}
TIMEOUT = 10.0


def chain_name(work_dir: Path) -> str:
    return "EMBER-" + hashlib.sha256(str(work_dir).encode()).hexdigest()[:12]


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool, "-w", "5", *args], capture_output=True, text=True, timeout=TIMEOUT, check=False
    )


class EgressRules:
    def __init__(
        self,
        work_dir: Path,
        first_uid: int,
        count: int,
        cgroup_path: str | None = None,
        also: tuple[int, int] | None = None,
        networks: tuple[int, int] | None = None,
    ) -> None:
        self.chain = chain_name(work_dir)
        # The replicas' uids, and `also` (first, count): the image build steps'.
        ranges = [(first_uid, count), *([also] if also is not None else [])]
        ranges += [networks] if networks is not None else []
        self.uid_ranges = [_uid_range(one) for one in ranges]
        # The networks' uids (first, count): no node address.
        self.network_uids = _uid_range(networks) if networks is not None else None
        self.cgroup_path = cgroup_path  # the agent's v2 group of replicas, from the v2 root
        self.installed: list[str] = []  # the tools whose chain is in place

    def install(self) -> str | None:
        """Put the rules in place (blocking); None, or why replicas may still reach
        link-local addresses (no iptables, or it failed)."""
        self.remove()
        if shutil.which("iptables") is None:
            return "iptables is not installed"
        for tool, network in LINK_LOCAL.items():
            if shutil.which(tool) is None:
                continue
            steps: list[tuple[str, ...]] = [("-N", self.chain)]
            steps += self._node_addresses(tool)
            for uids in self.uid_ranges:
                owner = ("-m", "owner", "--uid-owner", uids)
                steps.append(("-A", self.chain, "-d", network, *owner, "-j", "REJECT"))
            if self.cgroup_path is not None:
                group = ("-m", "cgroup", "--path", self.cgroup_path)
                steps.append(("-A", self.chain, "-d", network, *group, "-j", "REJECT"))
            steps.append(("-I", "OUTPUT", "-j", self.chain))
            for step in steps:
                done = _run(tool, *step)
                if done.returncode != 0:
                    self.remove()
                    return f"{tool} {' '.join(step)}: {done.stderr.strip()}"
            self.installed.append(tool)
        return None

    def _node_addresses(self, tool: str) -> list[tuple[str, ...]]:
        """The rules that keep the networks' uids (pasta, carrying what replicas and build
        steps send) off the node's own addresses, and off multicast and broadcast (which
        the node's sockets on the wildcard address, and other replicas' pastas, would
        receive). The node's IPv4 loopback is left out: pasta reaches it only at the
        ports it forwards from the namespace's own (--no-map-gw maps nothing else there,
        and nothing in a namespace holds the capability to hand pasta other frames);
        several workers on one node, each forwarding its control plane's port, share the
        network uids, so no worker's chain may name its own ports alone. Its IPv6
        loopback is refused (pasta forwards `::1` too, where no control plane listens)."""
        if self.network_uids is None:
            return []
        owner = ("-m", "owner", "--uid-owner", self.network_uids)
        outside = ("!", "-d", "127.0.0.0/8") if tool == "iptables" else ()
        local = (*outside, "-m", "addrtype", "--dst-type", "LOCAL", *owner)
        reset = ("-j", "REJECT", "--reject-with", "tcp-reset")
        steps: list[tuple[str, ...]] = [
            ("-A", self.chain, "-p", "tcp", *local, *reset),
            ("-A", self.chain, *local, "-j", "REJECT"),
        ]
        for group in GROUPS[tool]:
            steps.append(("-A", self.chain, "-d", group, *owner, "-j", "REJECT"))
        if tool == "iptables":
            broadcast = ("-m", "addrtype", "--dst-type", "BROADCAST", *owner)
            steps.append(("-A", self.chain, *broadcast, "-j", "REJECT"))
        return steps

    def remove(self) -> None:
        """Take the chain away, this run's or a killed one's (blocking)."""
        for tool in LINK_LOCAL:
            if shutil.which(tool) is None:
                continue
            while _run(tool, "-D", "OUTPUT", "-j", self.chain).returncode == 0:
                pass
            _run(tool, "-F", self.chain)
            _run(tool, "-X", self.chain)
        self.installed.clear()


def _uid_range(first_count: tuple[int, int]) -> str:
    first, count = first_count
    return f"{first}-{first + count - 1}"
