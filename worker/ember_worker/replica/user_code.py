"""The endpoint's own code in this replica: its class constructed (its weights attached),
its `enter(snap=True)` hooks run before any connection (what a snapshot holds), its
other `enter` hooks and web app's lifespan once connected, its `@ember.health_check` from
then on, its `exit` hooks at the end, and the function or method each input names."""

from __future__ import annotations

import asyncio
import inspect
import traceback
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any

from ember.endpoints.asgi import is_wsgi_factory
from ember.endpoints.decorators import EndpointDefinition
from ember.wire.spec import FUNCTION_METHOD
from ember_worker.replica.health_checks import HealthMonitor
from ember_worker.replica.loaded_weights import complete_mapped_weights, drop_weights_connections
from ember_worker.replica.web_apps.asgi_lifespan import AppLifespan
from ember_worker.replica.web_apps.wsgi_bridge import WsgiBridge


async def call_hook(func: Callable[[], Any]) -> None:
    """Run a lifecycle hook: awaited if async, in a thread if sync (heartbeats go on)."""
    if inspect.iscoroutinefunction(func):
        await func()
    else:
        await asyncio.to_thread(func)


def make_web_app(factory: Callable[[], Any], executor: Executor) -> Any:
    """Call a web-app endpoint's `@ember.asgi_app()` (or `wsgi_app()`) function; its app
    must be callable. A WSGI app is served through a bridge, in threads of `executor`."""
    app = factory()
    if inspect.isawaitable(app):
        app = asyncio.run(_awaited(app))
    wsgi = is_wsgi_factory(factory)
    if not callable(app):
        name = getattr(factory, "__qualname__", "the web app's function")
        kind = "a WSGI" if wsgi else "an ASGI"
        raise TypeError(f"{name} returned {type(app).__name__}, not {kind} app")
    return WsgiBridge(app, executor) if wsgi else app


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


class UserCode:
    def __init__(self, definition: EndpointDefinition, executor: Executor) -> None:
        self.definition = definition
        self.executor = executor  # where a WSGI app's requests run
        self.instance: Any = definition.target() if definition.kind == "class" else None
        settings = definition.settings
        if self.instance is not None and settings.weights:
            from ember_worker.weights.opener import WeightsByName

            # Opened on first use, so an endpoint that never reads them pays nothing.
            self.instance.weights = WeightsByName(settings.weights, settings.s3_endpoint_url)
        self.web_app: Any = None  # a web-app endpoint's ASGI app, made by run_snap_hooks
        self.lifespan: AppLifespan | None = None  # its lifespan, started once it may serve

    def hooks(self, *, snap: bool) -> list[Callable[[], Any]]:
        return [
            getattr(self.instance, name)
            for name, is_snap in self.definition.enter_hooks
            if is_snap == snap
        ]

    def run_snap_hooks(self) -> None:
        """Before any connection exists: this is the state a snapshot captures. Weights
        kept as views of the node cache's files stay mappings: a snapshot leaves their
        pages out and a restore maps the same files again, so each is made whole here."""
        if self.definition.kind == "asgi":
            self.web_app = make_web_app(self.definition.target, self.executor)
        for hook in self.hooks(snap=True):
            if inspect.iscoroutinefunction(hook):
                asyncio.run(hook())
            else:
                hook()
        weights: Any = getattr(self.instance, "weights", None)
        if self.definition.settings.snapshot:
            if hasattr(weights, "prepare"):
                # Into the image: a restored replica's first weights read skips this set-up.
                weights.prepare()
            complete_mapped_weights()
        drop_weights_connections()  # a snapshot cannot hold open connections

    async def enter(self) -> None:
        """Once connected: the web app's lifespan starts, then the other `enter` hooks
        run. What they raise means the replica cannot serve."""
        if self.web_app is not None and not isinstance(self.web_app, WsgiBridge):
            self.lifespan = AppLifespan(self.web_app)
            await self.lifespan.startup()
        for hook in self.hooks(snap=False):
            await call_hook(hook)

    async def exit(self) -> None:
        """The web app's lifespan ends and the `exit` hooks run, each whatever the last
        raised (printed)."""
        if self.lifespan is not None:
            try:
                await self.lifespan.shutdown()
            except Exception:
                traceback.print_exc()
        for name in self.definition.exit_hooks:
            try:
                await call_hook(getattr(self.instance, name))
            except Exception:
                traceback.print_exc()

    def start_health_checks(
        self, report_unhealthy: Callable[[str, str], Awaitable[None]]
    ) -> asyncio.Task[None] | None:
        """The class's `@ember.health_check`, run from now on (after any snapshot); what
        fails goes to `report_unhealthy(check, reason)`."""
        if self.definition.health_check is None:
            return None
        name, check = self.definition.health_check

        async def report(reason: str) -> None:
            await report_unhealthy(name, reason)

        monitor = HealthMonitor(name, getattr(self.instance, name), check, report)
        return asyncio.ensure_future(monitor.run())

    def target(self, method: str) -> Callable[..., Any]:
        """What an input's `method` names: the endpoint's function, or a method."""
        if method == FUNCTION_METHOD:
            return self.definition.target
        return getattr(self.instance, method)
