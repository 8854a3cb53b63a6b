"""Image references as `Image.from_registry` takes them: `[host[:port]/]path[:tag][@digest]`,
as Docker and the OCI distribution spec write them ("python:3.11-slim",
"ghcr.io/org/app:v2", "localhost:5000/base@sha256:...")."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ember.errors import InvalidError

DEFAULT_REGISTRY = "registry-1.docker.io"  # where a name with no host is (Docker Hub)
PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
PATH = re.compile(rf"{PATH_COMPONENT}(?:/{PATH_COMPONENT})*\Z")
HOST = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.?)+(?::[0-9]{1,5})?\Z")
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")
DIGEST = re.compile(r"sha256:[0-9a-f]{64}\Z")


@dataclass(frozen=True)
class Reference:
    registry: str  # host[:port]
    repository: str  # path inside it, e.g. "library/python"
    tag: str | None
    digest: str | None  # "sha256:<hex>": what the pulled manifest must hash to

    @property
    def wanted(self) -> str:
        """What to ask the registry's manifests endpoint for: the digest, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text


def parse_reference(text: object) -> Reference:
    def bad(why: str) -> InvalidError:
        return InvalidError(
            f"from_registry({text!r}): {why}; write e.g. 'python:3.11-slim', "
            "'ghcr.io/org/app:v2' or 'localhost:5000/base@sha256:<64 hex>'"
        )

    if not isinstance(text, str) or not text or len(text) > 512 or text != text.strip():
        raise bad("not an image reference")
    rest, _, digest = text.partition("@")
    if digest and not DIGEST.match(digest):
        raise bad(f"{digest!r} is not a digest (sha256: and 64 lower-case hex digits)")
    first, slash, after = rest.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, after
        if not HOST.match(registry):
            raise bad(f"{registry!r} is not a host[:port]")
    else:
        registry, path = DEFAULT_REGISTRY, rest
    tag = None
    last_slash = path.rfind("/")
    colon = path.rfind(":")
    if colon > last_slash:
        path, tag = path[:colon], path[colon + 1 :]
        if not TAG.match(tag):
            raise bad(f"{tag!r} is not a tag")
    if not PATH.match(path):
        raise bad(f"{path!r} is not a repository name (lower-case, '/'-separated)")
    if registry == DEFAULT_REGISTRY and "/" not in path:
        path = f"library/{path}"  # Docker Hub's official images
    if tag is None and not digest:
        tag = "latest"
    return Reference(registry, path, tag, digest or None)
