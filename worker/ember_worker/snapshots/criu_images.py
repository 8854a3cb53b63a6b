"""What the worker reads in an image folder: CRIU's image files, with pycriu (their page
size, the flags of pagemap entries, whether the pages are all there), and the meta.json
the dump wrote beside them."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ember_worker.snapshots.errors import SnapshotError

PAGE_SIZE = 4096
PE_PARENT, PE_PRESENT = 1, 4  # pagemap entry flags: in a parent image; data in pages-*.img

# The replica's pipes, external to the image: meta.json names each by its key in the
# dumped process, and a restore hands new ones in their place.
PIPE_ROLES = ("lifeline", "stdout", "stderr", "control", "status")
# The replica's network namespace, external to the image too: a restore hands in a new one.
NETWORK_KEY = "replica-network"


def present_ranges(pagemap: Iterable[Mapping[str, Any]]) -> list[tuple[int, int]]:
    """(start, end) of the address ranges whose pages the image holds, from a pagemap's
    entries (the first, its header, has no address)."""
    return [
        (int(e["vaddr"]), int(e["vaddr"]) + int(e["nr_pages"]) * PAGE_SIZE)
        for e in pagemap
        if "vaddr" in e and int(e.get("flags", 0)) & PE_PRESENT
    ]


def check_pages(images: Path) -> None:
    """Every pages-*.img holds as many bytes as its pagemap says. CRIU 4.1.1 loops on a
    truncated one instead of failing, so this is checked before a restore."""
    import pycriu

    for pagemap in sorted(images.glob("pagemap-*.img")):
        try:
            with pagemap.open("rb") as handle:
                head, *entries = pycriu.images.load(handle)["entries"]
            expected = PAGE_SIZE * sum(
                e["nr_pages"]
                for e in entries
                if e.get("flags", 0) & PE_PRESENT and not e.get("flags", 0) & PE_PARENT
            )
            pages = images / f"pages-{head['pages_id']}.img"
            size = pages.stat().st_size if pages.exists() else 0
        except (OSError, ValueError, KeyError, pycriu.images.MagicException) as exc:
            raise SnapshotError(f"the image's {pagemap.name} is unreadable: {exc}") from None
        if size != expected:
            raise SnapshotError(
                f"the image is truncated: {pages.name} has {size} bytes, its pagemap "
                f"says {expected}"
            )


def image_meta(images: Path) -> dict[str, Any]:
    """What the dump recorded beside an image (meta.json): its key, pipes, GPU state."""
    try:
        meta = json.loads((images / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"the image has no readable meta.json: {exc}") from None
    if not isinstance(meta, dict):
        raise SnapshotError("the image's meta.json is not an object")
    return meta
