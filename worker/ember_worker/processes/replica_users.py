"""The unprivileged user each workspace's replicas run as on this node.

One uid per workspace, and a gid of the same number, from a range the node reserves for
replicas (`ember worker --replica-uids FIRST:COUNT`, 200000:65536 by default): no
account in /etc/passwd is needed, and none may use the range. The uid is
FIRST + (sha256 of the workspace's name mod COUNT), so every node picks the same one
for a workspace and a snapshot (whose image holds its process's credentials, restored
by CRIU) restores as the same user anywhere. Two workspaces whose names hash alike, or
a uid the node's own accounts hold, move on to the next free number; the record
(`<work dir>/replica-users.json`, root's alone) keeps every choice, so a uid never
changes on a node across restarts, even where such a probe made it differ from another
node's (a restore checks the uid it got, replica_images.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import secrets
from dataclasses import dataclass
from pathlib import Path

DEFAULT_FIRST_UID = 200_000
DEFAULT_UID_COUNT = 65_536
RECORD_NAME = "replica-users.json"


@dataclass(frozen=True)
class ReplicaUser:
    """Who a replica runs as: no supplementary groups, no capabilities, no_new_privs."""

    uid: int
    gid: int

    def argument(self) -> str:
        """As pid_namespace_init.py's --user takes it."""
        return f"{self.uid}:{self.gid}"


def parse_range(text: str) -> tuple[int, int]:
    """`FIRST:COUNT` (ValueError if it is not two numbers that fit uids above root's)."""
    first_text, _, count_text = text.partition(":")
    first, count = int(first_text), int(count_text)
    if first < 1000 or count < 1 or first + count > 2**32 - 2:
        raise ValueError(f"{text!r} is not a range of uids FIRST:COUNT above 999")
    return first, count


def _taken_by_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


class ReplicaUsers:
    def __init__(
        self, record: Path, first: int = DEFAULT_FIRST_UID, count: int = DEFAULT_UID_COUNT
    ) -> None:
        self.record = record
        self.first = first
        self.count = count
        self._chosen: dict[str, int] | None = None  # workspace: uid, read on first use

    def _load(self) -> dict[str, int]:
        if self._chosen is None:
            try:
                data = json.loads(self.record.read_text())
                self._chosen = {str(k): int(v) for k, v in data.items()}
            except FileNotFoundError:
                self._chosen = {}
        return self._chosen

    def _save(self, chosen: dict[str, int]) -> None:
        tmp = self.record.with_name(f".{self.record.name}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(chosen, out, sort_keys=True)
        os.replace(tmp, self.record)

    def for_workspace(self, workspace: str) -> ReplicaUser:
        """The workspace's user on this node, chosen (and recorded) on first use."""
        chosen = self._load()
        uid = chosen.get(workspace)
        if uid is None:
            uid = self._choose(workspace, set(chosen.values()))
            chosen[workspace] = uid
            self._save(chosen)
        return ReplicaUser(uid, uid)

    def _choose(self, workspace: str, taken: set[int]) -> int:
        start = int.from_bytes(hashlib.sha256(workspace.encode()).digest()[:8], "big")
        for step in range(self.count):
            uid = self.first + (start + step) % self.count
            if uid not in taken and not _taken_by_account(uid):
                return uid
        raise OSError(f"every uid of the replica range {self.first}:{self.count} is taken")
