"""Secrets (`ember secret set | ls | rm`): named sets of values an endpoint's replicas
get as environment variables; listed with their keys and users, never their values."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.declarations.settings import check_name
from ember.errors import InvalidError
from ember_platform.api.workspaces import Tenancy
from ember_platform.core.cluster import Cluster
from ember_platform.edge.errors import HttpError


class SecretsApi:
    def __init__(self, tenancy: Tenancy, cluster: Cluster) -> None:
        self.tenancy = tenancy
        self.cluster = cluster

    def _named(self, request: Request) -> tuple[str, str]:
        """(workspace, name) of the secret the path names."""
        _, workspace = self.tenancy.workspace(request)
        name = request.path_params["name"]
        try:
            check_name("secret", name)
        except InvalidError as exc:
            raise HttpError(400, "invalid_request", str(exc)) from None
        return workspace, name

    async def list_secrets(self, request: Request) -> Response:
        """Names, keys and users of the workspace's secrets: never their values."""
        _, workspace = self.tenancy.workspace(request)
        return JSONResponse(
            {
                "secrets": [
                    {
                        "name": name,
                        "keys": sorted(s.values),
                        "updated_at": s.updated_at,
                        "used_by": self.cluster.deployments.secret_users(workspace, name),
                    }
                    for name, s in self.cluster.secrets.all(workspace)
                ]
            }
        )

    async def put_secret(self, request: Request) -> Response:
        workspace, name = self._named(request)
        try:
            payload = await request.json()
            created = self.cluster.secrets.put(workspace, name, payload.get("values"))
        except InvalidError as exc:
            raise HttpError(400, "invalid_request", str(exc)) from None
        except (ValueError, AttributeError):
            raise HttpError(
                400, "invalid_request", 'a secret is a JSON object: {"values": {"KEY": "value"}}'
            ) from None
        self.cluster.deployments.secret_changed(workspace, name)
        users = self.cluster.deployments.secret_users(workspace, name)
        return JSONResponse(
            {"name": name, "created": created, "used_by": users},
            status_code=201 if created else 200,
        )

    async def delete_secret(self, request: Request) -> Response:
        workspace, name = self._named(request)
        users = self.cluster.deployments.secret_users(workspace, name)
        if users:
            raise HttpError(
                409,
                "conflict",
                f"secret {name} is used by {', '.join(users)}: stop those apps, or deploy "
                "them without it, first",
            )
        if not self.cluster.secrets.delete(workspace, name):
            raise HttpError(404, "not_found", f"no secret {name}; `ember secret ls` lists them")
        return JSONResponse({"name": name, "deleted": True})
