"""API tokens (`ember token create | ls | revoke`): each with a scope, maybe an app, a
rate limit and an expiry; listed by id and name, never by their secret."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.endpoints.settings import check_name
from ember.errors import InvalidError
from ember_platform.http.errors import HttpError
from ember_platform.security.rate_limits import parse_rate_limit
from ember_platform.security.tokens import (
    LastAdminTokenError,
    NoSuchTokenError,
    Scope,
    TokenRegistry,
    bearer_hash,
    checked_token_name,
    hash_token,
    token_id,
)

MAX_TOKEN_LIFETIME_S = 10 * 365 * 86_400.0  # the longest expires_in a token may have


class TokensApi:
    def __init__(self, tokens: TokenRegistry) -> None:
        self.tokens = tokens

    async def create_token(self, request: Request) -> Response:
        self.tokens.require(request.headers.get("authorization"), Scope.ADMIN)
        try:
            payload = await request.json() if await request.body() else {}
            if not isinstance(payload, dict):
                raise ValueError('send a JSON object such as {"scope": "invoke", "name": "ci"}')
            scope = Scope(payload.get("scope", "invoke"))
            name = checked_token_name(payload.get("name"))
            app = payload.get("app")
            if app is not None:
                check_name("app", app)
            limit = payload.get("rate_limit")
            rate_limit = None if limit is None else parse_rate_limit(str(limit))
            expires_at = _expiry(payload.get("expires_in"))
            token = self.tokens.create(scope, name, app, rate_limit, expires_at)
        except (ValueError, InvalidError) as exc:
            raise HttpError(400, "invalid_request", f"bad token request: {exc}") from None
        return JSONResponse(
            {
                "token": token,
                "id": token_id(hash_token(token)),
                "scope": scope.value,
                "name": name,
                "app": app,
                "rate_limit": None if rate_limit is None else str(rate_limit),
                "expires_at": expires_at,
            },
            status_code=201,
        )

    async def list_tokens(self, request: Request) -> Response:
        self.tokens.require(request.headers.get("authorization"), Scope.ADMIN)
        yours = bearer_hash(request.headers.get("authorization"))
        return JSONResponse(
            {
                "tokens": [
                    {
                        "id": token_id(t.token_hash),
                        "scope": t.scope,
                        "app": t.app,
                        "rate_limit": t.rate_limit,
                        "expires_at": t.expires_at,
                        "name": t.name,
                        "created_at": t.created_at,
                        "yours": t.token_hash == yours,
                    }
                    for t in self.tokens.stored()
                ]
            }
        )

    async def revoke_token(self, request: Request) -> Response:
        self.tokens.require(request.headers.get("authorization"), Scope.ADMIN)
        wanted = request.path_params["token_id"]
        try:
            record = self.tokens.revoke(wanted)
        except NoSuchTokenError:
            raise HttpError(
                404, "not_found", f"no token {wanted}; `ember token ls` lists their ids"
            ) from None
        except LastAdminTokenError:
            raise HttpError(
                409,
                "conflict",
                f"token {wanted} is the last admin token: revoking it would lock everyone "
                "out; create another with `ember token create --scope admin` first",
            ) from None
        return JSONResponse({"revoked": {"id": wanted, "scope": record.scope, "name": record.name}})


def _expiry(expires_in: object) -> float | None:
    """A new token's expiry from the request's `expires_in` seconds (None: it never does);
    ValueError for one that is not a positive number of at most ten years."""
    if expires_in is None:
        return None
    if isinstance(expires_in, bool) or not isinstance(expires_in, int | float):
        raise ValueError(f"expires_in must be a number of seconds, not {expires_in!r}")
    if not 0 < expires_in <= MAX_TOKEN_LIFETIME_S:
        raise ValueError(f"expires_in must be above 0 and at most ten years, not {expires_in}")
    return time.time() + float(expires_in)
