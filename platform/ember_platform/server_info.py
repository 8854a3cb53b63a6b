"""What a started server tells whoever started it (`ServerInfo`: `ember server` prints it,
and the client config is written from it), and the admin token the state dir keeps for
that config."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ember_platform.config import ServerConfig
from ember_platform.security.state_files import kept_secret, replace_secret

if TYPE_CHECKING:
    from ember_platform.security.tokens import TokenRegistry

log = logging.getLogger("ember.server")

ADMIN_TOKEN_FILE = "admin-token"  # in the state dir, mode 0600


@dataclass(frozen=True)
class ServerInfo:
    url: str
    ca_cert: Path
    admin_token: str  # "" for a standby that never owned the platform
    own_certificate: str | None = None  # what --tls-cert serves, to callers asking for it
    public_url: str | None = None  # --public-url, where it differs from `url`

    @classmethod
    def of(
        cls,
        url: str,
        ca_cert: Path,
        admin_token: str,
        public_url: str,
        own_certificate: str | None = None,
    ) -> ServerInfo:
        """`public_url` (`public_url_of`) is kept only where it differs from `url`."""
        public = public_url if public_url != url else None
        return cls(url, ca_cert, admin_token, own_certificate, public)


def public_url_of(config: ServerConfig, url: str) -> str:
    """Where callers reach the server: --public-url, else the URL it serves at."""
    return (config.public_url or url).rstrip("/")


def admin_token_of(state_dir: Path, tokens: TokenRegistry) -> str:
    """The admin token is created once; its plain text stays in the state dir (mode 0600),
    for the client config each start writes. One revoked since (`ember token revoke`)
    is replaced by a new one: written into the config it would lock every command out."""
    from ember_platform.security.tokens import Scope

    path = state_dir / ADMIN_TOKEN_FILE
    token = kept_secret(path, lambda: tokens.create(Scope.ADMIN, "admin"))
    if tokens.scope_of(f"Bearer {token}") is Scope.ADMIN:
        return token
    token = tokens.create(Scope.ADMIN, "admin")
    replace_secret(path, token)
    log.warning(
        "the admin token kept in %s no longer works (revoked): a new one replaces it there "
        "and in the client config",
        path.name,
    )
    return token


def kept_admin_token(state_dir: Path) -> str:
    """The admin token an earlier start as owner kept in the state dir, or "" if none did
    (a standby, which has no token registry of its own to make one)."""
    path = state_dir / ADMIN_TOKEN_FILE
    return path.read_text().strip() if path.exists() else ""
