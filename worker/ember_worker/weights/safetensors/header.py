"""The safetensors format, parsed and checked without torch: the header of one file and the
index (`model.safetensors.index.json`) of a sharded checkpoint.

A safetensors file is an 8-byte little-endian header length N, N bytes of UTF-8 JSON naming
each tensor's dtype, shape and byte range (relative to the data section at 8 + N), then the
data. Headers come from users and from origins we do not control, so everything in them is
checked before any offset is trusted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from ember.errors import WeightsFormatError

# Bytes read at open: enough for the header of nearly every checkpoint in one round trip.
HEADER_PROBE = 64 * 1024
# The reference implementation refuses longer headers; a larger N means the bytes are no header.
MAX_HEADER_LENGTH = 100 * 1024 * 1024
_LENGTH_BYTES = 8

# Bytes per element of every dtype the format names (sub-byte types are not supported).
ITEM_SIZES: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1,
    "C64": 8,
}
_METADATA_KEY = "__metadata__"
# torch (and numpy) index with int64: a shape whose strides overflow it is no tensor, even
# one of 0 elements, so torch.empty would fail on it with a low-level error.
_MAX_ELEMENTS = 2**63 - 1


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header describes it; `start` and `end` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    """A checked header: `tensors` in the order of their data in the file."""

    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data, all tensors together."""
        return sum(info.nbytes for info in self.tensors.values())


@dataclass(frozen=True)
class ShardIndex:
    """A sharded checkpoint's index: which shard file holds each tensor."""

    weight_map: dict[str, str]
    metadata: dict[str, str]

    @property
    def shard_files(self) -> list[str]:
        """Each shard once, in name order (which is file order for `-0000k-of-0000n` names)."""
        return sorted(set(self.weight_map.values()))


def header_length(url: str, prefix: bytes, size: int) -> int:
    """N from the first 8 bytes of an object of `size` bytes, checked to be plausible."""
    if size < _LENGTH_BYTES or len(prefix) < _LENGTH_BYTES:
        raise WeightsFormatError(url, f"not a safetensors file (the object has only {size} bytes)")
    length = int.from_bytes(prefix[:_LENGTH_BYTES], "little")
    if length == 0:
        raise WeightsFormatError(url, "not a safetensors file (its header length is 0)")
    if length > MAX_HEADER_LENGTH:
        raise WeightsFormatError(
            url,
            f"not a safetensors file (its first 8 bytes give a header length of {length} "
            f"bytes, over the {MAX_HEADER_LENGTH // (1024 * 1024)} MiB limit)",
        )
    if _LENGTH_BYTES + length > size:
        raise WeightsFormatError(
            url,
            f"the header says it is {length} bytes long but the object has only {size} bytes",
        )
    return length


def parse_header(url: str, raw: bytes, size: int) -> Header:
    """Parse and check `raw`, the N header bytes after the length, of an object of `size`."""
    document = _load_json(url, raw, what="header")
    if not isinstance(document, dict):
        raise WeightsFormatError(
            url, f"not a safetensors file (its header is a JSON {_json_kind(document)})"
        )
    data_start = _LENGTH_BYTES + len(raw)
    metadata = _string_map(url, document.pop(_METADATA_KEY, {}), what="the header's __metadata__")
    infos = [_tensor_info(url, name, entry, data_start) for name, entry in document.items()]
    infos.sort(key=lambda info: (info.start, info.end, info.name))
    previous: TensorInfo | None = None
    for info in infos:
        if info.end > size:
            raise WeightsFormatError(
                url,
                f"the header says tensor '{info.name}' ends at byte {info.end} "
                f"but the object has only {size} bytes",
            )
        if info.nbytes == 0:
            continue  # occupies no bytes, so it overlaps nothing
        if previous is not None and info.start < previous.end:
            raise WeightsFormatError(
                url,
                f"tensors '{previous.name}' and '{info.name}' overlap (bytes "
                f"{previous.start}-{previous.end} and {info.start}-{info.end})",
            )
        previous = info
    return Header({info.name: info for info in infos}, metadata, data_start)


def parse_index(url: str, raw: bytes | str) -> ShardIndex:
    """Parse and check a `model.safetensors.index.json` document fetched from `url`."""
    document = _load_json(url, raw, what="index")
    if not isinstance(document, dict):
        raise WeightsFormatError(
            url, f"not a safetensors index (it is a JSON {_json_kind(document)}, not an object)"
        )
    weight_map = document.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightsFormatError(
            url, 'not a safetensors index (it has no "weight_map" object naming tensors)'
        )
    for name, file_name in weight_map.items():
        if not isinstance(file_name, str) or not file_name:
            raise WeightsFormatError(
                url, f"the index maps tensor '{name}' to {file_name!r}, not a shard file name"
            )
        if not _is_relative_name(file_name):
            raise WeightsFormatError(
                url, f"the index names shard '{file_name}', which is outside the index's folder"
            )
    raw_metadata = document.get("metadata") or {}
    if not isinstance(raw_metadata, dict):
        raise WeightsFormatError(url, 'the index\'s "metadata" is not an object')
    # Index metadata holds numbers ("total_size"); keep them JSON-encoded so metadata is
    # str -> str like a file's __metadata__.
    metadata = {
        key: value if isinstance(value, str) else json.dumps(value)
        for key, value in raw_metadata.items()
    }
    return ShardIndex(dict(weight_map), metadata)


def _load_json(url: str, raw: bytes | str, *, what: str) -> Any:
    kind = "safetensors file" if what == "header" else "safetensors index"
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes | bytearray) else raw
    except UnicodeDecodeError:
        raise WeightsFormatError(url, f"not a {kind} (its {what} is not UTF-8)") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKeyError as exc:
        raise WeightsFormatError(url, f"its {what} names '{exc.key}' twice") from None
    except (ValueError, RecursionError) as exc:  # also ints too long, nesting too deep
        raise WeightsFormatError(
            url, f"not a {kind} (its {what} is not valid JSON: {exc})"
        ) from None


class _DuplicateKeyError(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of repeated keys; a header naming a tensor twice is a lie.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKeyError(key)
        result[key] = value
    return result


def _tensor_info(url: str, name: str, entry: object, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise WeightsFormatError(url, f"the header's entry for tensor '{name}' is not an object")
    dtype = entry.get("dtype")
    if not isinstance(dtype, str) or dtype not in ITEM_SIZES:
        raise WeightsFormatError(
            url,
            f"tensor '{name}' has unknown dtype {dtype!r} (known: {', '.join(sorted(ITEM_SIZES))})",
        )
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_count(dim) for dim in shape):
        raise WeightsFormatError(
            url, f"tensor '{name}' has shape {shape!r}, not a list of non-negative integers"
        )
    if _strides_overflow(shape):
        raise WeightsFormatError(
            url, f"tensor '{name}' has shape {shape!r}, too large for any tensor"
        )
    offsets = entry.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(offset) for offset in offsets)
        or offsets[0] > offsets[1]
    ):
        raise WeightsFormatError(
            url,
            f"tensor '{name}' has data_offsets {offsets!r}, "
            "not [begin, end] with 0 <= begin <= end",
        )
    begin, end = offsets
    expected = math.prod(shape) * ITEM_SIZES[dtype]
    if end - begin != expected:
        raise WeightsFormatError(
            url,
            f"tensor '{name}' has {end - begin} bytes in the file but its shape {shape} "
            f"of {dtype} needs {expected}",
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _strides_overflow(shape: list[int]) -> bool:
    # Stops at the limit: a hostile header's long shape would make a full product slow.
    product = 1
    for dim in shape:
        product *= max(dim, 1)
        if product > _MAX_ELEMENTS:
            return True
    return False


def _string_map(url: str, value: object, *, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise WeightsFormatError(url, f"{what} is not an object of strings")
    return dict(value)


def _is_count(value: object) -> bool:
    # bool is an int subclass, and `true` is no dimension.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_relative_name(file_name: str) -> bool:
    # Checked decoded too: file:// and most HTTP servers decode the joined URL, so a
    # "%2E%2E%2F" in a shard name would climb out of the index's folder there.
    return all(_is_plain_relative(name) for name in (file_name, unquote(file_name)))


def _is_plain_relative(file_name: str) -> bool:
    parts = file_name.split("/")
    return (
        not file_name.startswith("/")
        and "\\" not in file_name
        and ":" not in file_name
        and all(part not in ("", ".", "..") for part in parts)
    )


def _json_kind(value: object) -> str:
    kinds = {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)
