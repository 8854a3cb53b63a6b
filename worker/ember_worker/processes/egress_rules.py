"""No link-local egress for replicas: where clouds serve instance metadata (credentials).

Replicas share the node's network (models download things), so the worker adds packet
filter rules: a chain of its own, jumped to from OUTPUT, that rejects what replicas send
to 169.254.0.0/16 (and fe80::/10), matched two ways: by the uids they run as
(`--replica-uids`, iptables' owner match), and by their cgroup v2 group (the cgroup
match's --path, which takes in every group below the agent's group of replicas,
cgroups.py). The second holds whatever the uid: a replica's snapshot phase run as uid 0
where CRIU lacks CAP_SYS_RESOURCE, and a process that could change its uid, stay in
their group (their sandbox shows them no cgroup file system to move out with).
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
    ) -> None:
        self.chain = chain_name(work_dir)
        # The replicas' uids, and `also` (first, count): the image build steps'.
        ranges = [(first_uid, count), *([also] if also is not None else [])]
        self.uid_ranges = [f"{first}-{first + many - 1}" for first, many in ranges]
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
