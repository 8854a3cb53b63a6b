"""Secrets (`ember secret set | ls | rm`): named sets of values an endpoint's replicas
get as environment variables; listed with their keys and users, never their values."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.errors import InvalidError
from ember_platform.core.cluster import Cluster
from ember_platform.http.errors import HttpError
from ember_platform.security.tokens import Scope, TokenRegistry


class SecretsApi:
    def __init__(self, tokens: TokenRegistry, cluster: Cluster) -> None:
        self.tokens = tokens
        self.cluster = cluster

    async def list_secrets(self, request: Request) -> Response:
        """Names, keys and users of the secrets: never their values."""
        self.tokens.require(request.headers.get("authorization"), Scope.ADMIN)
        return JSONResponse(
            {
                "secrets": [
                    {
                        "name": s.name,
                        "keys": sorted(s.values),
                        "updated_at": s.updated_at,
                        "used_by": self.cluster.secret_users(s.name),
                    }
                    for s in self.cluster.secrets.all()
                ]
            }
        )

    async def put_secret(self, request: Request) -> Response:
        self.tokens.require(request.headers.get("authorization"), Scope.ADMIN)
        name = request.path_params["name"]
        try:
            payload = await request.json()
            created = self.cluster.secrets.put(name, payload.get("values"))
        except InvalidError as exc:
            raise HttpError(400, "invalid_request", str(exc)) from None
        except (ValueError, AttributeError):
            raise HttpError(
                400, "invalid_request", 'a secret is a JSON object: {"values": {"KEY": "value"}}'
            ) from None
        self.cluster.secret_changed(name)
        users = self.cluster.secret_users(name)
        return JSONResponse(
            {"name": name, "created": created, "used_by": users},
            status_code=201 if created else 200,
        )

    async def delete_secret(self, request: Request) -> Response:
        self.tokens.require(request.headers.get("authorization"), Scope.ADMIN)
        name = request.path_params["name"]
        users = self.cluster.secret_users(name)
        if users:
            raise HttpError(
                409,
                "conflict",
                f"secret {name} is used by {', '.join(users)}: stop those apps, or deploy "
                "them without it, first",
            )
        if not self.cluster.secrets.delete(name):
            raise HttpError(404, "not_found", f"no secret {name}; `ember secret ls` lists them")
        return JSONResponse({"name": name, "deleted": True})
