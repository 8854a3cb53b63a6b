"""A replica's memory use, summed over its process tree, held against its request."""

from __future__ import annotations

import os
from pathlib import Path

from ember_worker.processes.memory_use import MIB, over_request, proportional_bytes, tree_bytes


def fake_process(proc: Path, pid: int, pss_kib: int, children: tuple[int, ...] = ()) -> None:
    task = proc / str(pid) / "task" / str(pid)
    task.mkdir(parents=True)
    (proc / str(pid) / "smaps_rollup").write_text(
        f"00400000-7ffd0000 ---p 00000000 00:00 0 [rollup]\nRss: {pss_kib * 2} kB\n"
        f"Pss: {pss_kib} kB\nPss_Anon: {pss_kib} kB\n"
    )
    (task / "children").write_text(" ".join(map(str, children)) + " ")


def test_a_tree_sums_its_processes(tmp_path: Path) -> None:
    fake_process(tmp_path, 10, 1000, (11, 12))
    fake_process(tmp_path, 11, 200, (13,))
    fake_process(tmp_path, 12, 30)
    fake_process(tmp_path, 13, 4)
    assert proportional_bytes(10, tmp_path) == 1000 * 1024
    assert tree_bytes(10, tmp_path) == (1000 + 200 + 30 + 4) * 1024
    assert tree_bytes(99, tmp_path) is None  # gone


def test_this_process_has_a_size() -> None:
    used = tree_bytes(os.getpid())
    assert used is not None and used > 10 * MIB


def test_only_use_over_the_request_is_told() -> None:
    assert over_request(512 * MIB, 512) is None
    note = over_request(700 * MIB, 512)
    assert note is not None
    assert note.startswith("uses 700 MiB, more than the memory=512 (MiB) its endpoint asks for")
