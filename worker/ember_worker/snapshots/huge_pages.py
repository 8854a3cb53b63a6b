"""Restoring a replica's memory into transparent huge pages (`ember worker --huge-pages`).

A restore spends most of its time allocating the replica's memory 4 KiB at a time. With
2 MiB pages it allocates 512 times fewer: an 800 MB process restored in 0.15 s instead
of 0.45 s when the kernel had huge pages at hand. Where the machine is a VM that hands
free memory back to its host (virtio-balloon free page reporting), a huge page is
usually memory the host must fault in again, and the same restore took about 1.5 s:
hence a node setting, off by default (bench/restore_fill.py tells whether it pays).

The node restores from its own view of an image, a folder beside it (`images-huge`)
that hard-links every file but the memory maps (`mm-*.img`). Those are copies in which
the private anonymous mappings whose pages are nearly all in the image (tensors,
buffers; not sparse heaps, which huge pages would bloat) carry MADV_HUGEPAGE. CRIU, with
our restore-fill patch, applies that advice before it reads the pages in. The image
itself, what is published, and other nodes' copies stay as they were dumped.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember_worker.snapshots.criu_images import present_ranges

MADV_HUGEPAGE = 14
MADV_NOHUGEPAGE = 15
HUGE_PAGE = 2 << 20
# Of a mapping's bytes, the share the image must hold: a huge page filled for a sparse
# mapping would allocate memory the process never had.
DENSE_SHARE = 0.9

MAP_PRIVATE = 0x02
MAP_ANONYMOUS = 0x20
MAP_GROWSDOWN = 0x100
PROT_WRITE = 0x2
VMA_AREA_REGULAR = 1 << 0
VMA_ANON_PRIVATE = 1 << 9

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
FOLDER = "images-huge"


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode (always, madvise or never); None where
    the kernel has none."""
    try:
        found = re.search(r"\[(\w+)\]", path.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def huge_pages_problem(path: Path = THP_ENABLED) -> str | None:
    """Why this node cannot restore into huge pages, or None if it can."""
    mode = thp_mode(path)
    if mode is None:
        return "this kernel has no transparent huge pages"
    if mode == "never":
        return f"transparent huge pages are off on this node ({path} says never)"
    return None


@dataclass(frozen=True)
class Advice:
    mappings: int  # how many mappings restore into huge pages
    bytes: int  # their size


def wants_huge_pages(vma: Mapping[str, Any], held: int) -> bool:
    """Whether a mapping should restore into huge pages: private, anonymous, writable,
    at least one huge page long, not a stack, not advised otherwise, and dense (`held`:
    its bytes in the image)."""
    size = int(vma["end"]) - int(vma["start"])
    flags = int(vma.get("flags", 0))
    status = int(vma.get("status", 0))
    madv = int(vma.get("madv", 0))
    return (
        size >= HUGE_PAGE
        and bool(flags & MAP_PRIVATE and flags & MAP_ANONYMOUS)
        and not flags & MAP_GROWSDOWN
        and bool(int(vma.get("prot", 0)) & PROT_WRITE)
        and bool(status & VMA_AREA_REGULAR and status & VMA_ANON_PRIVATE)
        and not madv & (1 << MADV_NOHUGEPAGE)
        and held >= DENSE_SHARE * size
    )


def held_bytes(vmas: Sequence[Mapping[str, Any]], ranges: Sequence[tuple[int, int]]) -> list[int]:
    """For each mapping (sorted by address and not overlapping, as in an image), how
    many of its bytes fall in `ranges`."""
    held = [0] * len(vmas)
    first = 0
    for start, end in sorted(ranges):
        while first < len(vmas) and int(vmas[first]["end"]) <= start:
            first += 1
        i = first
        while i < len(vmas) and int(vmas[i]["start"]) < end:
            held[i] += max(0, min(end, int(vmas[i]["end"])) - max(start, int(vmas[i]["start"])))
            i += 1
    return held


def mark_dense_mappings(
    vmas: Sequence[dict[str, Any]], ranges: Sequence[tuple[int, int]]
) -> Advice:
    """Add MADV_HUGEPAGE to the mappings that want it, in place."""
    count = total = 0
    for vma, held in zip(vmas, held_bytes(vmas, ranges), strict=True):
        if wants_huge_pages(vma, held):
            vma["madv"] = int(vma.get("madv", 0)) | (1 << MADV_HUGEPAGE)
            count += 1
            total += int(vma["end"]) - int(vma["start"])
    return Advice(mappings=count, bytes=total)


def _advise_copy(images: Path, mm_name: str, into: Path) -> Advice:
    import pycriu  # only where snapshots work, hence CRIU and pycriu, are there

    pid = mm_name[len("mm-") : -len(".img")]
    with open(images / f"pagemap-{pid}.img", "rb") as f:
        ranges = present_ranges(pycriu.images.load(f)["entries"])
    with open(images / mm_name, "rb") as f:
        mm = pycriu.images.load(f)
    advice = [mark_dense_mappings(entry.get("vmas", []), ranges) for entry in mm["entries"]]
    with open(into / mm_name, "wb") as f:
        pycriu.images.dump(mm, f)
    return Advice(sum(a.mappings for a in advice), sum(a.bytes for a in advice))


def huge_page_images(images: Path) -> tuple[Path, Advice | None]:
    """The folder to restore `images` from with huge pages, made beside it on first use:
    with what it advised then, else None."""
    view = images.parent / FOLDER
    if view.is_dir():
        return view, None
    work = Path(tempfile.mkdtemp(prefix=f".{FOLDER}-", dir=images.parent))
    try:
        mappings = size = 0
        for path in images.iterdir():
            if path.name.startswith("mm-") and path.name.endswith(".img"):
                advice = _advise_copy(images, path.name, work)
                mappings += advice.mappings
                size += advice.bytes
            elif path.is_file() and not path.name.endswith(".log") and "stats-" not in path.name:
                os.link(path, work / path.name)  # the same file: no space, no copy
        try:
            work.rename(view)
        except OSError:  # another restore made it first
            if not view.is_dir():
                raise
            return view, None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return view, Advice(mappings, size)
