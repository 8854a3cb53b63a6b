"""Workspaces: what a tenant owns (apps, secrets, Dicts, Queues, Volumes, calls, logs,
usage, tokens), and which one a request acts in.

A deploy or invoke token belongs to one workspace and acts there only; the platform's own
tokens (admin, worker, metrics) reach every workspace, and an admin request names the one
it acts in (`Ember-Workspace` header or `?workspace=`; main if it names none). Inside the
platform an app is named by its key (`ember.wire.labels.app_key`), so whatever is keyed
by app is kept per workspace without a column of its own.
"""

from __future__ import annotations

import time

from ember.declarations.settings import check_name
from ember.errors import InvalidError
from ember.wire.labels import MAIN_WORKSPACE, app_key, checked_app_key
from ember_platform.errors import Forbidden, InvalidRequest, UnknownWorkspace
from ember_platform.security.tokens import Grant
from ember_platform.storage.records import WorkspaceRecord
from ember_platform.storage.state_store import StateStore

WORKSPACE_HEADER = "ember-workspace"


class WorkspaceExists(ValueError):
    """`ember workspace create` of a name already taken."""


class WorkspaceRegistry:
    """The workspaces, in memory; the store is written first on every change."""

    def __init__(self, store: StateStore, started_at: float | None = None) -> None:
        self._store = store
        self._created = {w.name: w for w in store.list_workspaces()}
        # main is never stored: it exists on every platform, from its first start.
        self._main = WorkspaceRecord(MAIN_WORKSPACE, started_at or time.time())

    def exists(self, name: str) -> bool:
        return name == MAIN_WORKSPACE or name in self._created

    def all(self) -> list[WorkspaceRecord]:
        """main first, then the others by name."""
        return [self._main, *sorted(self._created.values(), key=lambda w: w.name)]

    def create(self, name: str) -> WorkspaceRecord:
        """A new workspace: InvalidError for a name that cannot be one, WorkspaceExists for
        one that is taken."""
        check_name("workspace", name)
        if self.exists(name):
            raise WorkspaceExists(name)
        record = WorkspaceRecord(name, time.time())
        self._store.put_workspace(record)
        self._created[name] = record
        return record

    def delete(self, name: str) -> None:
        """Forget a workspace (what it owned is the caller's to remove first)."""
        if name == MAIN_WORKSPACE:
            raise InvalidError("the main workspace cannot be removed")
        if name not in self._created:
            raise UnknownWorkspace(_unknown(name))
        self._store.delete_workspace(name)
        del self._created[name]

    def acting_in(self, grant: Grant, named: str | None) -> str:
        """The workspace a request with `grant` acts in, given the one it names (None:
        none). A token of one workspace acts in that one, and naming another is
        Forbidden; the platform's tokens act in the one named, main by default."""
        if named is not None and named != MAIN_WORKSPACE:
            try:
                check_name("workspace", named)
            except InvalidError as exc:
                raise InvalidRequest(str(exc)) from None
        if grant.workspace is not None:
            if named is not None and named != grant.workspace:
                raise Forbidden(
                    f"this token belongs to workspace {grant.workspace}, not {named}: it "
                    f"acts in {grant.workspace} only"
                )
            return grant.workspace
        workspace = named or MAIN_WORKSPACE
        if not self.exists(workspace):
            raise UnknownWorkspace(_unknown(workspace))
        return workspace

    def app_of(self, grant: Grant, named_workspace: str | None, app: str) -> str:
        """The key of the app a request means by `app` (a name, or `workspace--app`)."""
        parsed = checked_app_key(app)
        if parsed is None:
            try:
                check_name("app", app)
            except InvalidError as exc:
                raise InvalidRequest(str(exc)) from None
            raise InvalidRequest(f"app name {app!r} is not allowed")
        in_key, name = parsed
        if in_key is not None and named_workspace is not None and in_key != named_workspace:
            raise InvalidRequest(
                f"app {app} is of workspace {in_key}, but the request names {named_workspace}"
            )
        return app_key(self.acting_in(grant, in_key or named_workspace), name)


def _unknown(name: str) -> str:
    return f"no workspace named {name}; `ember workspace ls` lists them"
