"""Which mappings of an image restore into huge pages (ember_worker.snapshots.huge_pages)."""

from __future__ import annotations

from pathlib import Path

from ember_worker.snapshots.criu_images import present_ranges
from ember_worker.snapshots.huge_pages import (
    HUGE_PAGE,
    MADV_HUGEPAGE,
    MADV_NOHUGEPAGE,
    held_bytes,
    huge_pages_problem,
    mark_dense_mappings,
    thp_mode,
    wants_huge_pages,
)

MIB = 1 << 20
ANON_PRIVATE = {"flags": 0x22, "prot": 0x3, "status": (1 << 9) | 1}


def vma(start: int, end: int, **fields: int) -> dict:
    return {"start": start, "end": end, **ANON_PRIVATE, **fields}


def test_a_dense_private_anonymous_mapping_wants_huge_pages():
    assert wants_huge_pages(vma(0, 64 * MIB), held=64 * MIB)
    assert wants_huge_pages(vma(0, 64 * MIB), held=58 * MIB)  # 91 %: dense enough


def test_sparse_small_or_other_mappings_do_not():
    assert not wants_huge_pages(vma(0, 64 * MIB), held=32 * MIB)  # sparse: would bloat
    assert not wants_huge_pages(vma(0, HUGE_PAGE - 4096), held=HUGE_PAGE - 4096)  # too small
    assert not wants_huge_pages(vma(0, 8 * MIB, prot=0x1), held=8 * MIB)  # read-only
    assert not wants_huge_pages(vma(0, 8 * MIB, flags=0x22 | 0x100), held=8 * MIB)  # a stack
    assert not wants_huge_pages(vma(0, 8 * MIB, flags=0x02), held=8 * MIB)  # file-backed
    assert not wants_huge_pages(vma(0, 8 * MIB, status=(1 << 8) | 1), held=8 * MIB)  # shared
    refused = vma(0, 8 * MIB, madv=1 << MADV_NOHUGEPAGE)  # the process said no
    assert not wants_huge_pages(refused, held=8 * MIB)


def test_held_bytes_splits_ranges_over_mappings():
    vmas = [vma(0, 4 * MIB), vma(4 * MIB, 8 * MIB), vma(16 * MIB, 20 * MIB)]
    # One range across the first two mappings, one inside the third, one in a gap.
    ranges = [(3 * MIB, 5 * MIB), (17 * MIB, 18 * MIB), (10 * MIB, 11 * MIB)]
    assert held_bytes(vmas, ranges) == [MIB, MIB, MIB]
    assert held_bytes(vmas, []) == [0, 0, 0]


def test_present_ranges_reads_only_pages_in_the_image():
    pagemap = [
        {"pages_id": 1},  # the header
        {"vaddr": 4096, "nr_pages": 2, "flags": 4},  # in pages-*.img
        {"vaddr": 65536, "nr_pages": 8, "flags": 1},  # in a parent image only
        {"vaddr": 1 << 30, "nr_pages": 1, "flags": 4 | 2},  # lazy, still in the image
    ]
    assert present_ranges(pagemap) == [(4096, 12288), ((1 << 30), (1 << 30) + 4096)]


def test_mark_dense_mappings_adds_the_advice_and_keeps_others():
    dense = vma(0, 8 * MIB, madv=1 << 12)  # some other advice is kept
    sparse = vma(8 * MIB, 16 * MIB)
    advice = mark_dense_mappings([dense, sparse], [(0, 8 * MIB), (8 * MIB, 9 * MIB)])
    assert advice.mappings == 1 and advice.bytes == 8 * MIB
    assert dense["madv"] == (1 << 12) | (1 << MADV_HUGEPAGE)
    assert "madv" not in sparse


def test_thp_mode_and_why_not(tmp_path: Path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert thp_mode(setting) == "madvise" and huge_pages_problem(setting) is None
    setting.write_text("always madvise [never]\n")
    problem = huge_pages_problem(setting)
    assert problem is not None and "never" in problem
    missing = tmp_path / "absent"
    assert thp_mode(missing) is None
    assert huge_pages_problem(missing) == "this kernel has no transparent huge pages"
