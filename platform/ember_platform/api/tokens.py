"""API tokens (`ember token create | ls | revoke`): each with a scope, maybe an app, a
rate limit and an expiry; listed by id and name, never by their secret."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.errors import InvalidError
from ember.wire.labels import MAIN_WORKSPACE, split_app_key
from ember_platform.api.workspaces import Tenancy, named_workspace
from ember_platform.edge.errors import HttpError
from ember_platform.errors import Forbidden, InvalidRequest
from ember_platform.security.rate_limits import parse_rate_limit
from ember_platform.security.tokens import (
    WORKSPACE_SCOPES,
    LastAdminTokenError,
    NoSuchTokenError,
    Scope,
    bearer_hash,
    checked_token_name,
    hash_token,
    token_id,
)
from ember_platform.storage.records import TokenRecord

MAX_TOKEN_LIFETIME_S = 10 * 365 * 86_400.0  # the longest expires_in a token may have


class TokensApi:
    def __init__(self, tenancy: Tenancy) -> None:
        self.tenancy = tenancy
        self.tokens = tenancy.tokens

    async def create_token(self, request: Request) -> Response:
        """An admin makes any token; a deploy token makes deploy and invoke tokens of its
        own workspace."""
        grant = self.tenancy.grant(request, Scope.DEPLOY)
        try:
            payload = await request.json() if await request.body() else {}
            if not isinstance(payload, dict):
                raise ValueError('send a JSON object such as {"scope": "invoke", "name": "ci"}')
            scope = Scope(payload.get("scope", "invoke"))
            if grant.scope is not Scope.ADMIN and scope not in WORKSPACE_SCOPES:
                raise Forbidden(f"a {grant.scope.value} token cannot make {scope.value} tokens")
            named = payload.get("workspace")
            if named is not None and not isinstance(named, str):
                raise ValueError(f"workspace is a name, not {named!r}")
            workspace = None
            if scope in WORKSPACE_SCOPES:
                workspace = self.tenancy.workspaces.acting_in(
                    grant, named or named_workspace(request)
                )
            elif named is not None:
                raise ValueError(f"a {scope.value} token is the platform's, of no one workspace")
            name = checked_token_name(payload.get("name"))
            app = payload.get("app")
            key = None
            if app is not None:
                if not isinstance(app, str):
                    raise ValueError(f"app is a name, not {app!r}")
                key = self.tenancy.workspaces.app_of(grant, workspace, app)
            limit = payload.get("rate_limit")
            rate_limit = None if limit is None else parse_rate_limit(str(limit))
            expires_at = _expiry(payload.get("expires_in"))
            token = self.tokens.create(scope, name, key, rate_limit, expires_at, workspace)
        except (ValueError, InvalidError, InvalidRequest) as exc:
            message = exc.message if isinstance(exc, InvalidRequest) else str(exc)
            raise HttpError(400, "invalid_request", f"bad token request: {message}") from None
        return JSONResponse(
            {
                "token": token,
                "id": token_id(hash_token(token)),
                "scope": scope.value,
                "workspace": workspace,
                "name": name,
                "app": app,
                "rate_limit": None if rate_limit is None else str(rate_limit),
                "expires_at": expires_at,
            },
            status_code=201,
        )

    async def list_tokens(self, request: Request) -> Response:
        """Every token for an admin; a deploy token's workspace's for it."""
        grant = self.tenancy.grant(request, Scope.DEPLOY)
        yours = bearer_hash(request.headers.get("authorization"))
        return JSONResponse(
            {
                "tokens": [
                    {
                        "id": token_id(t.token_hash),
                        "scope": t.scope,
                        "workspace": _workspace_of(t),
                        "app": None if t.app is None else split_app_key(t.app)[1],
                        "rate_limit": t.rate_limit,
                        "expires_at": t.expires_at,
                        "name": t.name,
                        "created_at": t.created_at,
                        "yours": t.token_hash == yours,
                    }
                    for t in self.tokens.stored()
                    if grant.workspace is None or _workspace_of(t) == grant.workspace
                ]
            }
        )

    async def revoke_token(self, request: Request) -> Response:
        grant = self.tenancy.grant(request, Scope.DEPLOY)
        wanted = request.path_params["token_id"]
        mine = [
            t
            for t in self.tokens.stored()
            if token_id(t.token_hash) == wanted
            and (grant.workspace is None or _workspace_of(t) == grant.workspace)
        ]
        try:
            if not mine:  # another workspace's token is as unknown as one that never was
                raise NoSuchTokenError(wanted)
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


def _workspace_of(token: TokenRecord) -> str | None:
    """A deploy or invoke token's workspace (main for those made before workspaces)."""
    if Scope(token.scope) in WORKSPACE_SCOPES:
        return token.workspace or MAIN_WORKSPACE
    return None


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
