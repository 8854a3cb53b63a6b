"""TLS client contexts: trust the platform's own CA when one is configured."""

from __future__ import annotations

import ssl
from functools import lru_cache

from ember.errors import ConfigError


@lru_cache(maxsize=8)
def client_context(ca_cert: str | None) -> ssl.SSLContext:
    """A verifying context; with `ca_cert`, it trusts that PEM file instead of the system's."""
    if ca_cert:
        try:
            return ssl.create_default_context(cafile=ca_cert)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"cannot load the CA certificate {ca_cert} to trust: {exc}; point ca_cert "
                "(or EMBER_CA_CERT) at a PEM file such as the server's ca.pem"
            ) from None
    return ssl.create_default_context()
