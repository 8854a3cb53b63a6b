"""The uid each workspace's replicas run as, and the ACL entries that let one uid into
a folder: chosen by hash, moved on past collisions, recorded, written as setfacl would."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from machine_needs import need

from ember_worker.processes import file_grants
from ember_worker.processes.file_grants import EXECUTE, GROUP_OBJ, MASK, OTHER, RX, USER
from ember_worker.processes.replica_users import ReplicaUsers, parse_range


def test_a_workspace_gets_the_same_uid_on_every_node_and_keeps_it(tmp_path: Path) -> None:
    one = ReplicaUsers(tmp_path / "a.json").for_workspace("team-a")
    other_node = ReplicaUsers(tmp_path / "b.json").for_workspace("team-a")
    assert one == other_node and 200_000 <= one.uid < 265_536 and one.gid == one.uid
    assert ReplicaUsers(tmp_path / "a.json").for_workspace("team-b") != one
    again = ReplicaUsers(tmp_path / "a.json")  # a restart reads the record
    assert again.for_workspace("team-a") == one
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o600


def test_colliding_workspaces_take_the_next_free_uid_and_keep_it(tmp_path: Path) -> None:
    users = ReplicaUsers(tmp_path / "record.json", first=300_000, count=2)
    first, second = users.for_workspace("x"), users.for_workspace("y")
    assert {first.uid, second.uid} == {300_000, 300_001}
    with pytest.raises(OSError, match="every uid"):
        users.for_workspace("z")
    # The record decides from then on, whatever the order of asking.
    reread = ReplicaUsers(tmp_path / "record.json", first=300_000, count=2)
    assert reread.for_workspace("y") == second and reread.for_workspace("x") == first


def test_uids_the_machines_accounts_hold_are_skipped(tmp_path: Path) -> None:
    # uid 0 is root's on every machine: a range of it alone has nothing to hand out.
    with pytest.raises(OSError, match="every uid"):
        ReplicaUsers(tmp_path / "record.json", first=0, count=1).for_workspace("main")
    assert ReplicaUsers(tmp_path / "r2.json", first=0, count=100_000).for_workspace("main").uid


def test_ranges_are_checked() -> None:
    assert parse_range("200000:65536") == (200_000, 65_536)
    for bad in ("0:10", "200000", "200000:0", "x:1", "4294967000:1000"):
        with pytest.raises(ValueError):
            parse_range(bad)


def test_a_grant_adds_one_users_entry_and_can_close_the_folder_to_others(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "bundle"
    folder.mkdir(mode=0o755)
    try:
        file_grants.grant(folder, 201_234, RX, private=True)
    except OSError as exc:
        need("root", f"this file system keeps no ACLs: {exc}")
    entries = file_grants.read_acl(folder)
    assert (USER, RX, 201_234) in entries
    assert [p for t, p, _ in entries if t in (GROUP_OBJ, OTHER)] == [0, 0]
    assert [p for t, p, _ in entries if t == MASK] == [RX]
    assert folder.stat().st_mode & 0o007 == 0  # others: nothing
    file_grants.grant(folder, 201_999, EXECUTE)  # a second user, kept beside the first
    assert {(USER, RX, 201_234), (USER, EXECUTE, 201_999)} <= set(file_grants.read_acl(folder))
    # A chmod since (a server's of its state dir) empties the mask: granting again fixes it.
    os.chmod(folder, 0o700)
    file_grants.grant(folder, 201_234, RX)
    assert [p for t, p, _ in file_grants.read_acl(folder) if t == MASK] == [RX]


def test_the_kernel_lets_the_named_user_in_and_no_other(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        need("root", "switching to another uid needs root")
    folder = tmp_path / "private"
    folder.mkdir()
    (folder / "file").write_text("seen")
    os.chmod(folder, 0o700)
    for uid in (201_234, 201_235):  # both may pass the folders above
        file_grants.grant_passage(folder, uid)
    file_grants.grant(folder, 201_234, RX, private=True)
    for uid, expected in ((201_234, "seen"), (201_235, "Permission denied")):
        result = subprocess.run(
            ["/bin/cat", str(folder / "file")],
            user=uid,
            group=uid,
            extra_groups=[],
            capture_output=True,
            text=True,
            check=False,
        )
        assert expected in result.stdout + result.stderr
