"""The origin for a URL, chosen by its scheme (s3://, http(s)://, file://), and the set-up
reading one needs, done ahead of the first read."""

from __future__ import annotations

from urllib.parse import urlsplit

from ember.errors import WeightsError
from ember_worker.weights.origins.file import FileOrigin
from ember_worker.weights.origins.http import FsspecOrigin
from ember_worker.weights.origins.origin import Origin
from ember_worker.weights.origins.s3 import S3Origin

SUPPORTED_SCHEMES = ("s3", "http", "https", "file")


def open_origin(url: str, *, s3_endpoint_url: str | None = None) -> Origin:
    """The origin for a URL, chosen by its scheme."""
    scheme = urlsplit(url).scheme.lower()
    if scheme == "s3":
        return S3Origin(url, endpoint_url=s3_endpoint_url)
    if scheme in ("http", "https"):
        return FsspecOrigin(url)
    if scheme == "file":
        return FileOrigin(url)
    supported = ", ".join(f"{name}://" for name in SUPPORTED_SCHEMES)
    raise WeightsError(url, f"unsupported URL scheme {scheme!r}; supported: {supported}")


def prepare(url: str, *, s3_endpoint_url: str | None = None) -> None:
    """Do now, without contacting the origin, the set-up that reading `url` needs: import
    its client library and, for S3, build the process's shared client (0.1-0.3 s in all).
    A replica does it before its snapshot, so that a restored one's first read skips it."""
    origin = open_origin(url, s3_endpoint_url=s3_endpoint_url)
    if isinstance(origin, S3Origin | FsspecOrigin):
        origin.prepare()
