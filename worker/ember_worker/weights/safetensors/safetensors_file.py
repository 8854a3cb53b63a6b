"""One safetensors object read lazily through a `RangeSource`: the header is read at open,
each tensor fetched by byte range only when asked for, bulk loads streamed in file order with
the next ranges already in flight.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable, Iterator
from typing import TYPE_CHECKING

from ember.errors import WeightsFormatError, WeightsUnavailableError
from ember_worker.weights.safetensors.header import (
    HEADER_PROBE,
    Header,
    TensorInfo,
    header_length,
    parse_header,
)
from ember_worker.weights.safetensors.source import Data, RangeSource

if TYPE_CHECKING:
    import torch

# torch attribute of each safetensors dtype; looked up at use, as older torch lacks some.
_TORCH_DTYPE_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
}
_NAMES_SHOWN = 5
# difflib over every key is quadratic-ish; past this many keys, just list a few.
_MAX_KEYS_FOR_SUGGESTIONS = 20_000


class SafetensorsFile:
    """One safetensors object: the header is read at open, tensors only when asked for."""

    def __init__(self, source: RangeSource) -> None:
        self.source = source
        self.header = _read_header(source)

    @property
    def url(self) -> str:
        return self.source.url

    @property
    def metadata(self) -> dict[str, str]:
        return self.header.metadata

    @property
    def dtypes(self) -> dict[str, str]:
        return {name: info.dtype for name, info in self.header.tensors.items()}

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: info.shape for name, info in self.header.tensors.items()}

    @property
    def nbytes(self) -> int:
        return self.header.nbytes

    def keys(self) -> list[str]:
        """Tensor names in the order of their data in the file."""
        return list(self.header.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.header.tensors

    def __len__(self) -> int:
        return len(self.header.tensors)

    def __repr__(self) -> str:
        return f"SafetensorsFile({self.url!r}, {len(self)} tensors)"

    def info(self, name: str) -> TensorInfo:
        try:
            return self.header.tensors[name]
        except KeyError:
            raise _unknown_tensor(self.url, name, self.header.tensors) from None

    def get(
        self,
        name: str,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Read exactly the bytes of tensor `name` and return it (on `device`, as `dtype`)."""
        info = self.info(name)
        data = _read_exactly(self.source, info.start, info.end) if info.nbytes else b""
        return _convert(self._tensor(info, data), device, dtype)

    def iter_tensors(
        self,
        names: Iterable[str] | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(name, tensor)` for `names` (default: all) in file order, fetched through
        `source.read_ranges` so later tensors are in flight while earlier ones are used."""
        # Checked here, not in the generator, so a wrong name fails at the call.
        infos = self._in_file_order(names)
        return self._stream(infos, device, dtype)

    def _in_file_order(self, names: Iterable[str] | None) -> list[TensorInfo]:
        if names is None:
            return list(self.header.tensors.values())
        if isinstance(names, str):
            raise TypeError(f"names must be a collection of tensor names, not the string {names!r}")
        infos = {name: self.info(name) for name in names}
        return sorted(infos.values(), key=lambda info: info.start)

    def _stream(
        self,
        infos: list[TensorInfo],
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        ranges = [(info.start, info.end) for info in infos if info.nbytes]
        chunks = self.source.read_ranges(ranges) if ranges else iter(())
        try:
            for info in infos:
                data = self._next_chunk(chunks, info)
                tensor = _convert(self._tensor(info, data), device, dtype)
                del data  # the tensor holds what it needs of the source's buffer
                yield info.name, tensor
                del tensor  # hold nothing while the next range is read
        finally:
            _close(chunks)  # stopping early must cancel the ranges still in flight

    def _next_chunk(self, chunks: Iterator[Data], info: TensorInfo) -> Data:
        if info.nbytes == 0:
            return b""  # never asked of the reader
        data = next(chunks, None)
        if data is None:
            raise WeightsUnavailableError(
                self.url, f"the reader stopped before tensor '{info.name}'"
            )
        if len(data) != info.nbytes:
            raise _short_read(self.url, info.start, info.end, len(data))
        return data

    def _tensor(self, info: TensorInfo, data: Data) -> torch.Tensor:
        import torch

        torch_dtype = _torch_dtype(self.url, info)
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=torch_dtype)  # frombuffer refuses 0 bytes
        # A writable buffer the source returned (a bytearray of its own, or a view of the disk
        # tier's private file mapping) is used as is: no copy. `frombuffer` holds a reference
        # to it, so the mapping lives as long as the tensor, past the reader and the view.
        # Read-only bytes are copied, so that every tensor is writable.
        writable = isinstance(data, bytearray) or (
            isinstance(data, memoryview) and not data.readonly
        )
        buffer = data if writable else bytearray(data)
        # safetensors data is little-endian, as is every host Ember runs on.
        return torch.frombuffer(buffer, dtype=torch_dtype).reshape(info.shape)


def _read_header(source: RangeSource) -> Header:
    size = source.size
    # Copied out: the header is small, and parsed as bytes.
    probe = b""
    if size >= 8:
        probe = bytes(_read_exactly(source, 0, min(size, HEADER_PROBE), peek=True))
    length = header_length(source.url, probe, size)
    end = 8 + length
    raw = probe[8:end]
    if end > len(probe):  # a header longer than the probe: one more read for the rest
        raw += bytes(_read_exactly(source, len(probe), end, peek=True))
    return parse_header(source.url, raw, size)


def _read_exactly(source: RangeSource, start: int, end: int, *, peek: bool = False) -> Data:
    """Bytes [start, end) through the cache; `peek`: a small one-off read (the header)."""
    data = source.peek(start, end) if peek else source.read(start, end)
    if len(data) != end - start:
        raise _short_read(source.url, start, end, len(data))
    return data


def _short_read(url: str, start: int, end: int, got: int) -> WeightsUnavailableError:
    return WeightsUnavailableError(
        url, f"asked the reader for bytes {start}-{end} ({end - start} bytes) and got {got}"
    )


def _sorted_infos(file: SafetensorsFile, names: list[str]) -> list[TensorInfo]:
    return sorted((file.info(name) for name in names), key=lambda info: info.start)


def _torch_dtype(url: str, info: TensorInfo) -> torch.dtype:
    import torch

    torch_dtype = getattr(torch, _TORCH_DTYPE_NAMES[info.dtype], None)
    if not isinstance(torch_dtype, torch.dtype):
        raise WeightsFormatError(
            url,
            f"tensor '{info.name}' has dtype {info.dtype}, "
            f"which this torch ({torch.__version__}) cannot represent",
        )
    return torch_dtype


def _convert(
    tensor: torch.Tensor, device: torch.device | str | None, dtype: torch.dtype | None
) -> torch.Tensor:
    if device is None and dtype is None:
        return tensor
    return tensor.to(device=device, dtype=dtype)


def _unknown_tensor(url: str, name: str, known: Collection[str]) -> KeyError:
    suggestions: list[str] = []
    if len(known) <= _MAX_KEYS_FOR_SUGGESTIONS:
        suggestions = difflib.get_close_matches(name, known, n=3)
    if suggestions:
        hint = f"did you mean {_quoted(suggestions)}?"
    else:
        hint = f"it has {_quoted(list(known))}"
    return KeyError(f"{url} has no tensor {name!r}; {hint}")


def _quoted(names: list[str]) -> str:
    shown = ", ".join(f"'{name}'" for name in names[:_NAMES_SHOWN])
    if len(names) > _NAMES_SHOWN:
        shown += f" and {len(names) - _NAMES_SHOWN} more"
    return shown


def _close(iterator: Iterator[object]) -> None:
    close = getattr(iterator, "close", None)
    if close is not None:
        close()
