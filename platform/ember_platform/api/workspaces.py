"""Workspaces (`ember workspace create | ls | set | rm`), and how every other resource's
request finds the workspace it acts in and the app it means (`Tenancy`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.errors import InvalidError
from ember.wire.labels import checked_label, make_label, split_app_key
from ember_platform.core.cluster import Cluster
from ember_platform.edge.errors import HttpError
from ember_platform.errors import Forbidden, InvalidRequest
from ember_platform.limits.workspace_limits import LIMITS
from ember_platform.runtime.cluster_model import EndpointRuntime
from ember_platform.security.tokens import Grant, Scope, TokenRegistry, token_id
from ember_platform.security.workspaces import (
    WORKSPACE_HEADER,
    WorkspaceExists,
    WorkspaceRegistry,
)

# `?all_workspaces=true` (`--all-workspaces`): a listing of every workspace, for an admin.
ALL_WORKSPACES = "all_workspaces"


def named_workspace(request: Request) -> str | None:
    """The workspace a request names: its `Ember-Workspace` header or `?workspace=`."""
    return request.headers.get(WORKSPACE_HEADER) or request.query_params.get("workspace") or None


class Tenancy:
    """A request's grant, the workspace it acts in and the app or label it means."""

    def __init__(self, tokens: TokenRegistry, workspaces: WorkspaceRegistry) -> None:
        self.tokens = tokens
        self.workspaces = workspaces

    def grant(self, request: Request, needed: Scope) -> Grant:
        return self.tokens.require(request.headers.get("authorization"), needed)

    def workspace(self, request: Request, needed: Scope = Scope.DEPLOY) -> tuple[Grant, str]:
        grant = self.grant(request, needed)
        return grant, self.workspaces.acting_in(grant, named_workspace(request))

    def listed(self, request: Request, needed: Scope = Scope.DEPLOY) -> tuple[Grant, str | None]:
        """The workspace a listing shows: the request's, or None (every one) when it asks
        for all of them, which only an admin token may: a workspace's token must never
        learn what another holds, not even its names."""
        grant = self.grant(request, needed)
        if request.query_params.get(ALL_WORKSPACES, "").lower() not in ("1", "true", "yes"):
            return grant, self.workspaces.acting_in(grant, named_workspace(request))
        if grant.scope is not Scope.ADMIN:
            raise Forbidden(
                "listing every workspace (--all-workspaces) is the operator's: it needs an "
                "admin token"
            )
        return grant, None

    def app(self, request: Request, app: str, needed: Scope = Scope.DEPLOY) -> str:
        """The key of the app `app` names (`app`, or `workspace--app`) for this request."""
        grant = self.grant(request, needed)
        return self.workspaces.app_of(grant, named_workspace(request), app)

    def label(self, request: Request, label: str, needed: Scope = Scope.DEPLOY) -> str:
        """The label of the endpoint `label` names: `app--endpoint` in the request's
        workspace, or `workspace--app--endpoint`."""
        try:
            app, endpoint = checked_label(label)
        except InvalidError as exc:
            raise InvalidRequest(str(exc)) from None
        return make_label(self.app(request, app, needed), endpoint)


def in_workspace(key: str, workspace: str) -> bool:
    """Whether the app key `key` is of `workspace`."""
    return split_app_key(key)[0] == workspace


def in_listing(key: str, workspace: str | None) -> bool:
    """Whether a listing of `workspace` (Tenancy.listed; None: every one, the operator's)
    shows the app whose key is `key`."""
    return workspace is None or in_workspace(key, workspace)


class WorkspacesApi:
    def __init__(
        self,
        tenancy: Tenancy,
        cluster: Cluster,
        removing: Callable[[str], None] | None = None,  # told of a workspace before it goes
    ) -> None:
        self.tenancy = tenancy
        self.workspaces = tenancy.workspaces
        self.cluster = cluster
        self.removing = removing

    async def list_workspaces(self, request: Request) -> Response:
        """Every workspace for an admin; its own for a deploy token."""
        grant = self.tenancy.grant(request, Scope.DEPLOY)
        rows = []
        for workspace in self.workspaces.all():
            if grant.workspace is not None and workspace.name != grant.workspace:
                continue
            apps = sorted({split_app_key(r.app)[1] for r in self._endpoints_of(workspace.name)})
            rows.append(
                {
                    "name": workspace.name,
                    "created_at": workspace.created_at,
                    "apps": apps,
                    "limits": self._limits_of(workspace.name),
                }
            )
        return JSONResponse({"workspaces": rows})

    async def set_limits(self, request: Request) -> Response:
        """An admin's admission limits for a workspace: `{"max_queued": 50, "rate":
        "10/s"}`; a limit absent stays as it is, null puts it back to the default."""
        self.tenancy.grant(request, Scope.ADMIN)
        name = request.path_params["name"]
        if not self.workspaces.exists(name):
            raise HttpError(404, "not_found", f"no workspace named {name}")
        try:
            changes = await request.json()
            if not isinstance(changes, dict):
                raise ValueError
        except ValueError:
            raise HttpError(
                400,
                "invalid_request",
                'send a JSON object such as {"max_queued": 100, "max_running": 10, '
                '"rate": "50/s"} (null: the default)',
            ) from None
        self.cluster.workspace_limits.change(name, changes)
        return JSONResponse({"name": name, "limits": self._limits_of(name)})

    def _limits_of(self, workspace: str) -> dict[str, Any]:
        """The limits in force, and which of them an admin set (the others: defaults)."""
        limits = self.cluster.workspace_limits.of(workspace)
        own = self.cluster.workspace_limits.settings(workspace)
        return {
            "max_queued": limits.max_queued,
            "max_running": limits.max_running,
            "rate": None if limits.rate is None else str(limits.rate),
            "set": [name for name in LIMITS if getattr(own, name) is not None],
        }

    async def create_workspace(self, request: Request) -> Response:
        self.tenancy.grant(request, Scope.ADMIN)
        try:
            payload = await request.json()
            name = payload["name"] if isinstance(payload, dict) else None
            if not isinstance(name, str):
                raise ValueError
        except (ValueError, KeyError):
            raise HttpError(
                400, "invalid_request", 'send a JSON object such as {"name": "team-a"}'
            ) from None
        try:
            record = self.workspaces.create(name)
        except InvalidError as exc:
            raise HttpError(400, "invalid_request", str(exc)) from None
        except WorkspaceExists:
            raise HttpError(409, "conflict", f"workspace {name} exists already") from None
        return JSONResponse({"name": record.name, "created_at": record.created_at}, 201)

    async def delete_workspace(self, request: Request) -> Response:
        """Refused while the workspace has apps, unless `?force=true`: then its apps are
        stopped and removed, and its secrets and tokens with them."""
        self.tenancy.grant(request, Scope.ADMIN)
        name = request.path_params["name"]
        force = request.query_params.get("force", "").lower() in ("1", "true", "yes")
        if not self.workspaces.exists(name):
            raise HttpError(404, "not_found", f"no workspace named {name}")
        # Running, or deployed and stopped: what the store still keeps counts too.
        keys = {r.app for r in self._endpoints_of(name)}
        keys |= {d.app for d in self.cluster.store.latest_deployments()}
        apps = sorted(a for a in keys if in_workspace(a, name))
        if apps and not force:
            shown = ", ".join(split_app_key(a)[1] for a in apps)
            raise HttpError(
                409,
                "conflict",
                f"workspace {name} still has apps ({shown}): stop them first, or remove it "
                "with everything in it with --force",
            )
        for app in apps:
            self.cluster.store.delete_app(app)
            self.cluster.deployments.remove_app(app)
        for secret, _ in self.cluster.secrets.all(name):
            self.cluster.secrets.delete(name, secret)
        for token in self.tenancy.tokens.stored():
            if token.workspace == name:  # its channels close with it
                self.tenancy.tokens.revoke(token_id(token.token_hash))
        if self.removing is not None:
            self.removing(name)  # what runs for it in the background stops first
        try:
            self.workspaces.delete(name)  # and every row the store kept of it
        except InvalidError as exc:
            raise HttpError(400, "invalid_request", str(exc)) from None
        self.cluster.workspace_limits.forget(name)
        self.cluster.input_lifecycle.admission.forget(name)
        self.cluster.collect_garbage()
        return JSONResponse({"name": name, "deleted": True, "stopped_apps": len(apps)})

    def _endpoints_of(self, workspace: str) -> list[EndpointRuntime]:
        return [r for r in self.cluster.endpoints.values() if in_workspace(r.app, workspace)]
