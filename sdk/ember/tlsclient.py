"""TLS client contexts: trust the platform's own CA when one is configured."""

from __future__ import annotations

import ssl
from functools import lru_cache


@lru_cache(maxsize=8)
def client_context(ca_cert: str | None) -> ssl.SSLContext:
    """A verifying context; with `ca_cert`, it trusts that PEM file instead of the system's."""
    if ca_cert:
        return ssl.create_default_context(cafile=ca_cert)
    return ssl.create_default_context()
