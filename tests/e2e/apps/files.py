"""Endpoints that take files (bytes parameters, from forms, raw bodies, JSON and the SDK)
and return them (bytes, ember.File)."""

import hashlib
from typing import Literal

import ember


@ember.endpoint(snapshot=False, max_body_mb=16)  # uploads larger than the server's 8 MiB
def digest(data: bytes, algorithm: Literal["sha256", "md5"] = "sha256", times: int = 1) -> dict:
    return {
        "size": len(data),
        "hex": hashlib.new(algorithm, data * times).hexdigest(),
    }


@ember.endpoint(snapshot=False)
class Images:
    @ember.method
    def describe(
        self, image: bytes, caption: str, tags: list[str] | None = None, flip: bool = False
    ) -> dict:
        return {"size": len(image), "caption": caption, "tags": tags, "flip": flip}

    @ember.method
    def same(self, a: bytes, b: bytes) -> bool:
        return a == b

    @ember.method
    def add(self, x: int, y: float = 0.5) -> float:
        return x + y


@ember.endpoint(snapshot=False)
def reverse(data: bytes, name: str | None = None) -> ember.File:
    return ember.File(data[::-1], media_type="image/x-reversed", filename=name)


@ember.endpoint(snapshot=False)
def counting(n: int) -> bytes:
    return bytes(i % 256 for i in range(n))


@ember.endpoint(snapshot=False)
def tone(chunks: int, size: int = 1000, fail_after: int | None = None, mixed: bool = False):
    """A file made as it is sent: the first chunk says its media type and name."""
    for index in range(chunks):
        if index == fail_after:
            raise ValueError(f"the tone broke after {index} chunks")
        data = bytes([index % 256]) * size
        yield ember.File(data, "audio/x-tone", "tone.raw") if index == 0 else data
    if mixed:
        yield {"not": "bytes"}


@ember.endpoint(snapshot=False)
def firehose(chunks: int, size: int, progress: str):
    """Bytes as fast as they can be made, counting in the file `progress` how many are."""
    with open(progress, "w") as counter:
        for index in range(chunks):
            yield bytes([index % 256]) * size
            counter.seek(0)
            counter.write(f"{index + 1:8d}")
            counter.flush()
