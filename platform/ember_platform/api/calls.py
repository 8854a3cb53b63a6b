"""Calls (`ember call ls | get | cancel`): the spawned calls of an app or endpoint, one
call's state or result (waiting for it up to `?wait=` seconds), cancelling one; and the
key the webhooks that tell of their end are signed with."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.declarations.settings import check_name
from ember.errors import InvalidError
from ember.wire.labels import label_names, make_label, split_label
from ember_platform.core.cluster import Cluster
from ember_platform.edge.call_cors import CallCors
from ember_platform.edge.errors import HttpError
from ember_platform.runtime.inputs import JSON_MEDIA_TYPE, Input, Outcome
from ember_platform.security.tokens import Scope, TokenRegistry

if TYPE_CHECKING:
    from ember_platform.api.workspaces import Tenancy
from ember_platform.storage.records import CallRecord

MAX_CALL_WAIT = 60.0
MAX_CALLS_LISTED = 1000


def require_call_of(tokens: TokenRegistry, request: Request, label: str, not_found: str) -> None:
    """An invoke token may reach `label`'s endpoint and calls; a token for another
    app is told `not_found`, as if there were nothing (it may not know of other apps)."""
    grant = tokens.require(request.headers.get("authorization"), Scope.INVOKE)
    parts = split_label(label)
    if parts is None or not grant.may_call(parts[0]):
        raise HttpError(404, "not_found", not_found)


class CallsApi:
    def __init__(self, tenancy: Tenancy, cluster: Cluster, stopping: asyncio.Event) -> None:
        self.tenancy = tenancy
        self.tokens = tenancy.tokens
        self.cluster = cluster
        self.stopping = stopping  # set: a call's ?wait= ends early
        # A browser page may read and cancel the calls it spawned, at the origin it called.
        self.cors = CallCors(cluster)

    async def webhook_secret(self, request: Request) -> Response:
        """The key the workspace's webhook receivers check signatures with
        (`ember.verify_webhook`): each workspace has its own."""
        _, workspace = self.tenancy.workspace(request)
        if self.cluster.webhooks is None:
            raise HttpError(404, "not_found", "this control plane sends no webhooks")
        return JSONResponse(
            {"secret": self.cluster.webhooks.secret_for(workspace), "workspace": workspace}
        )

    async def cancel_call(self, request: Request) -> Response:
        """Stop an async call: out of its queue, or stopped on its replica."""
        call_id = request.path_params["call_id"]
        live, record = self._reachable_call(request, call_id)
        if live is not None and live.is_async and not live.done:
            self.cluster.input_lifecycle.cancel(live, f"call {call_id} was cancelled by its caller")
            return JSONResponse({"id": call_id, "status": "cancelled"})
        if live is not None:
            record = self.cluster.calls.get(call_id)
        if record is None:
            raise HttpError(404, "not_found", _no_call(call_id))
        if record.status.finished:
            if record.http_status == 499:
                raise HttpError(409, "conflict", f"call {call_id} was cancelled already")
            raise HttpError(
                409,
                "conflict",
                f"call {call_id} has finished ({record.status.value}, {record.http_status}): "
                "too late to cancel",
            )
        raise HttpError(409, "conflict", f"call {call_id} cannot be cancelled now; retry")

    async def list_calls(self, request: Request) -> Response:
        """The newest spawned calls (scheduled runs among them) of an app or endpoint, or
        of every app of the workspace (of every workspace for an admin's
        `?all_workspaces=true`): ids and states, not arguments or results. For deploy
        tokens (and admin): ids are what lets a caller read a result."""
        _, workspace = self.tenancy.listed(request)
        app = request.query_params.get("app", "")
        endpoint = request.query_params.get("endpoint", "")
        limit_text = request.query_params.get("limit", "50")
        if not (limit_text.isascii() and limit_text.isdigit()) or not (
            1 <= int(limit_text) <= MAX_CALLS_LISTED
        ):
            raise HttpError(
                400,
                "invalid_request",
                f"limit must be a whole number from 1 to {MAX_CALLS_LISTED}, not {limit_text!r}",
            )
        limit = int(limit_text)
        try:
            if endpoint:
                check_name("endpoint", endpoint)
        except InvalidError as exc:
            raise HttpError(400, "invalid_request", str(exc)) from None
        if endpoint and not app:
            raise HttpError(400, "invalid_request", "endpoint= goes with app=")
        key = self.tenancy.app(request, app) if app else None
        label = make_label(key, endpoint) if key and endpoint else None
        records = self.cluster.calls.recent(key, label, limit, workspace)
        if key and not records:
            deployments = self.cluster.store.list_deployments(key)
            if not deployments:
                raise HttpError(404, "not_found", f"no app named {app} was ever deployed")
            if endpoint and not any(
                e.get("name") == endpoint
                for d in deployments
                for e in d.manifest.get("endpoints", [])
            ):
                raise HttpError(
                    404, "not_found", f"app {app} never had an endpoint named {endpoint}"
                )
        calls = [
            {
                "call_id": r.id,
                "workspace": names[0] if (names := label_names(r.label)) else None,
                "label": r.label,
                "method": r.method,
                "status": r.status.value,
                "http_status": r.http_status,
                "attempts": r.attempts,
                "created_at": r.created_at,
                "finished_at": r.finished_at,
                "webhook": r.webhook_state or ("waiting" if r.webhook else None),
            }
            for r in records
        ]
        return JSONResponse({"calls": calls})

    def _reachable_call(
        self, request: Request, call_id: str
    ) -> tuple[Input | None, CallRecord | None]:
        """The call as its live input, else as its record (read only then). A token that
        may not reach its endpoint gets 404, as for a call that does not exist."""
        live = self.cluster.inputs.get(call_id)
        record = None if live is not None else self.cluster.calls.get(call_id)
        label = live.label if live is not None else record.label if record is not None else ""
        require_call_of(self.tokens, request, label, _no_call(call_id))
        return live, record

    async def get_call(self, request: Request) -> Response:
        call_id = request.path_params["call_id"]
        live, record = self._reachable_call(request, call_id)
        try:
            wait = min(float(request.query_params.get("wait", "0")), MAX_CALL_WAIT)
        except ValueError:
            raise HttpError(400, "invalid_request", "wait must be a number of seconds") from None
        if live is not None:  # its record, as it is once the wait is over
            if wait > 0:
                await done_unless_stopping(live.outcome, self.stopping, wait)
            record = self.cluster.calls.get(call_id)
        if record is None:
            raise HttpError(404, "not_found", _no_call(call_id))
        if not record.status.finished:
            body = {"call_id": call_id, "status": record.status.value}
            return JSONResponse(body, status_code=202)
        answer = Outcome(
            record.http_status or 200,
            record.result or b"null",
            record.media_type or JSON_MEDIA_TYPE,
            record.filename,
        )
        return Response(
            answer.body,
            status_code=answer.status,
            headers={**answer.headers(), "X-Ember-Call-Status": record.status.value},
        )


async def done_unless_stopping(
    pending: asyncio.Future[Any], stopping: asyncio.Event, timeout: float
) -> bool:
    """Wait up to `timeout` seconds for `pending`, less if `stopping` is set meanwhile (or
    already); whether it is done. `pending` is left as it is either way."""
    if not pending.done() and not stopping.is_set():
        stop = asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait(
                (pending, stop), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stop.cancel()
    return pending.done()


def _no_call(call_id: str) -> str:
    return f"no call {call_id} (results are kept for a day)"
