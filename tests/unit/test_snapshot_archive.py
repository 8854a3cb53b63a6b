"""The snapshot image's archive: a zstd-compressed tar of the image folder, CRIU's logs
left out, unpacked to the same files; packing leaves nothing for the garbage collector."""

from __future__ import annotations

import gc
from pathlib import Path

from ember_worker.snapshots.image_transfer import pack_image, unpack_image


def test_pack_and_unpack_round_trip_without_logs(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    (images / "pages-1.img").write_bytes(bytes(range(256)) * 4096)
    (images / "core-1.img").write_bytes(b"core")
    (images / "dump.log").write_text("CRIU's own log stays on the node")
    archive = tmp_path / "image.tar.zst"
    pack_image(images, archive)
    assert archive.stat().st_size < 64 * 1024  # compressed
    out = tmp_path / "out"
    out.mkdir()
    unpack_image(archive, out)
    assert sorted(p.name for p in out.iterdir()) == ["core-1.img", "pages-1.img"]
    assert (out / "pages-1.img").read_bytes() == (images / "pages-1.img").read_bytes()


def test_packing_frees_the_compressor_when_it_returns(tmp_path: Path) -> None:
    """Not at some later collection: that may run in a forked child, where freeing a
    multithreaded compressor waits for ever on its threads' locks."""
    images = tmp_path / "images"
    images.mkdir()
    (images / "pages-1.img").write_bytes(b"x" * 100_000)
    gc.collect()
    gc.disable()
    try:
        pack_image(images, tmp_path / "image.tar.zst")
        gc.set_debug(gc.DEBUG_SAVEALL)
        assert gc.collect() == 0, [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
