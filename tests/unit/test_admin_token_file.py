"""The admin token the state dir keeps for the client config: made once, kept across
restarts, and replaced when it was revoked (a config holding it would lock the CLI out)."""

from __future__ import annotations

import stat
from pathlib import Path

from store_backends import StoreOpener

from ember_platform.security.tokens import Scope, TokenRegistry, bearer_hash, token_id
from ember_platform.server_info import ADMIN_TOKEN_FILE, admin_token_of


def test_the_kept_admin_token_survives_restarts_and_a_revoked_one_is_replaced(
    tmp_path: Path, open_store: StoreOpener
) -> None:
    store = open_store()
    first = admin_token_of(tmp_path, TokenRegistry(store))
    assert admin_token_of(tmp_path, TokenRegistry(store)) == first  # as after a restart
    tokens = TokenRegistry(store)
    tokens.create(Scope.ADMIN, "second")  # so that the kept one may be revoked
    tokens.revoke(token_id(bearer_hash(f"Bearer {first}") or ""))
    restarted = TokenRegistry(store)
    fresh = admin_token_of(tmp_path, restarted)
    assert fresh != first and restarted.scope_of(f"Bearer {fresh}") is Scope.ADMIN
    assert restarted.scope_of(f"Bearer {first}") is None  # the revoked one stays revoked
    kept = tmp_path / ADMIN_TOKEN_FILE
    assert kept.read_text().strip() == fresh
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert not list(tmp_path.glob("*.new"))
