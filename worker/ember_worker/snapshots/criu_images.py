"""What the worker reads in CRIU's image files, with pycriu: their page size and the
flags of pagemap entries."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

PAGE_SIZE = 4096
PE_PARENT, PE_PRESENT = 1, 4  # pagemap entry flags: in a parent image; data in pages-*.img


def present_ranges(pagemap: Iterable[Mapping[str, Any]]) -> list[tuple[int, int]]:
    """(start, end) of the address ranges whose pages the image holds, from a pagemap's
    entries (the first, its header, has no address)."""
    return [
        (int(e["vaddr"]), int(e["vaddr"]) + int(e["nr_pages"]) * PAGE_SIZE)
        for e in pagemap
        if "vaddr" in e and int(e.get("flags", 0)) & PE_PRESENT
    ]
