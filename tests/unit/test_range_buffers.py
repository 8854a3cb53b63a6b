"""Fetched ranges' memory (worker/weights/range_buffers.py): large ones in mappings of
their own, filled exactly, short and long bodies told apart."""

from __future__ import annotations

import io
import mmap

import pytest

from ember_worker.weights.origins.range_buffers import OWN_MAPPING_BYTES, allocate, read_into


def test_large_buffers_are_mappings_of_their_own_small_ones_bytearrays() -> None:
    assert isinstance(allocate(OWN_MAPPING_BYTES), mmap.mmap)
    assert isinstance(allocate(OWN_MAPPING_BYTES - 1), bytearray)
    assert len(allocate(0)) == 0


@pytest.mark.parametrize("size", [10, OWN_MAPPING_BYTES + 3])
def test_a_body_of_the_asked_size_fills_the_buffer(size: int) -> None:
    body = bytes(range(256)) * (size // 256 + 1)
    stream = io.BytesIO(body[:size])
    data, longer = read_into(size, stream.readinto)
    assert bytes(data) == body[:size] and not longer


@pytest.mark.parametrize("size", [10, OWN_MAPPING_BYTES + 3])
def test_a_short_body_comes_back_short_and_a_long_one_is_told(size: int) -> None:
    short, longer = read_into(size, io.BytesIO(b"x" * (size - 4)).readinto)
    assert short == b"x" * (size - 4) and not longer
    data, longer = read_into(size, io.BytesIO(b"y" * (size + 1)).readinto)
    assert len(data) == size and longer
    # Without the probe nothing past the range is read.
    stream = io.BytesIO(b"z" * (size + 1))
    data, longer = read_into(size, stream.readinto, probe=False)
    assert len(data) == size and not longer and stream.tell() == size
