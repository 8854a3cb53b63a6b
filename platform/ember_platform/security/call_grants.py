"""Who may call an endpoint, and the one charge a call makes against its token's rate
limit: a pure check first (`grant`, `may_call`), then `charge`, once the version of the
endpoint that takes the call is chosen, so a call to a canary pays once."""

from __future__ import annotations

import time

from ember.wire.labels import split_app_key
from ember_platform.errors import Forbidden, RateLimited, TokenRefused
from ember_platform.security.rate_limits import RateLimiter
from ember_platform.security.tokens import Grant, Scope, TokenRegistry, bearer_hash


class CallGrants:
    def __init__(self, tokens: TokenRegistry) -> None:
        self.tokens = tokens
        self.rate_limits = RateLimiter()
        tokens.on_revoke(self.rate_limits.forget)

    def grant(self, authorization: str | None, app: str) -> Grant:
        """The grant of the token in `authorization` to call `app`'s endpoints: valid, of
        the invoke scope, for this app (TokenRefused, Forbidden otherwise). Charges
        nothing."""
        if authorization is None:
            raise TokenRefused(
                "missing token: send 'Authorization: Bearer <token>' (create one with "
                "`ember token create`)"
            )
        grant = self.tokens.grant_of(authorization)
        if grant is None:
            raise TokenRefused(self.tokens.refusal(authorization, "the token is not valid"))
        if not grant.scope.allows(Scope.INVOKE):
            raise Forbidden(f"a {grant.scope.value} token cannot call endpoints")
        if not grant.may_call(app):
            if grant.app is not None:
                only = f"app {split_app_key(grant.app)[1]}"
            else:
                only = f"workspace {grant.workspace}"
            raise Forbidden(f"this token calls the endpoints of {only} only")
        return grant

    def may_call(self, authorization: str | None, app: str) -> bool:
        try:
            self.grant(authorization, app)
        except (TokenRefused, Forbidden):
            return False
        return True

    def charge(self, authorization: str, grant: Grant) -> None:
        """One call taken from the token's rate limit (RateLimited past it)."""
        if grant.rate_limit is None:
            return
        key = bearer_hash(authorization) or ""
        wait = self.rate_limits.wait_needed(key, grant.rate_limit, time.monotonic())
        if wait:
            raise RateLimited(
                f"this token may make {grant.rate_limit} calls; retry in {wait:.2f} s "
                "(`ember token create --rate-limit` sets a token's limit)",
                wait,
            )
