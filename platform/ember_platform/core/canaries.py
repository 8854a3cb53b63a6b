"""Canary deploys: a new version of an app takes a share of its endpoints' calls beside
the serving one (`ember deploy --canary 10`), until it is promoted to take them all or
withdrawn.

A canary is an `EndpointRuntime` of its own per endpoint (`LiveState.canaries`), with its
queue, replicas, autoscaling and snapshots, so everything a serving version does works
for it unchanged. The gateway sends each call to one of the two (`route`): a call with an
affinity key by the key, so a session stays on one version; others at random. Promoting
hands the canary's replicas and queue to the serving runtime, which takes its version as
a deploy would: its own older replicas then retire as in a rolling deploy, and nothing
waits for a start. Withdrawing sends the canary's queue to the serving version and
drains its replicas.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from ember.errors import InvalidError
from ember.wire.labels import make_label
from ember.wire.spec import AppManifest
from ember_platform.core.queues import Queues
from ember_platform.core.replicas import ReplicaLifecycle
from ember_platform.observability.logs import LogSink
from ember_platform.runtime.affinity import key_weight
from ember_platform.runtime.cluster_model import EndpointRuntime, VersionOutcomes
from ember_platform.runtime.live_state import LiveState
from ember_platform.storage.records import Deployment


def check_canary_percent(value: object) -> int:
    """A canary's share of calls: a whole number from 1 to 99."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 99:
        raise InvalidError(
            f"a canary takes 1 to 99 percent of the calls, not {value!r} (promote it to "
            "give it all of them)"
        )
    return value


def route(
    canaries: Mapping[str, EndpointRuntime], runtime: EndpointRuntime, affinity: str | None
) -> EndpointRuntime:
    """The runtime a new call of `runtime`'s endpoint goes to: its canary (of `canaries`,
    by label) for the canary's share of calls (by the affinity key when there is one),
    else itself."""
    canary = canaries.get(runtime.label)
    if canary is None or canary.canary_percent is None:
        return runtime
    share = key_weight(affinity, "canary") % 100 if affinity else random.randrange(100)
    return canary if share < canary.canary_percent else runtime


class CanaryTrials:
    def __init__(
        self, state: LiveState, logs: LogSink, queues: Queues, replicas: ReplicaLifecycle
    ) -> None:
        self.state = state
        self.logs = logs
        self.queues = queues
        self.replicas = replicas

    def apply(self, deployment: Deployment) -> list[EndpointRuntime]:
        """Start (or replace) the app's canary: one runtime per endpoint, beside the
        serving one, taking `deployment.canary_percent` of its calls."""
        manifest = AppManifest.from_dict(deployment.manifest)
        percent = check_canary_percent(deployment.canary_percent)
        canaries = []
        for spec in manifest.endpoints:
            label = make_label(manifest.app, spec.name)
            serving = self.state.endpoints.get(label)
            if serving is None:  # the API refuses such canaries; a store edited by hand
                continue
            canary = self.state.canaries.get(label)
            if canary is None:
                canary = type(serving)(
                    manifest.app, spec, deployment.version, deployment.bundle_digest, manifest.entry
                )
                canary.deployed_at = deployment.created_at
                self.state.canaries[label] = canary
            else:  # a newer canary: the older one's replicas retire as in a rolling deploy
                canary.take_version(
                    spec,
                    deployment.version,
                    deployment.bundle_digest,
                    manifest.entry,
                    deployment.created_at,
                )
            canary.canary_percent = percent
            serving.outcomes = VersionOutcomes()  # compared over the same time as the canary
            canaries.append(canary)
            self.logs.system(
                manifest.app,
                spec.name,
                f"canary: version {deployment.version} takes {percent}% of calls beside "
                f"version {serving.version}",
            )
        self.state.wake.set()
        return canaries

    def set_percent(self, app: str, percent: int) -> list[EndpointRuntime]:
        check_canary_percent(percent)
        canaries = [c for c in self.state.canaries.values() if c.app == app]
        for canary in canaries:
            canary.canary_percent = percent
            self.logs.system(
                app, canary.spec.name, f"canary: version {canary.version} takes {percent}% of calls"
            )
        return canaries

    def promote(self, label: str) -> EndpointRuntime:
        """The canary's version serves every call: the serving runtime takes it, with the
        canary's replicas (ready ones serve at once) and queued calls."""
        canary = self.state.canaries.pop(label)
        serving = self.state.endpoints[label]
        previous = serving.version
        serving.take_version(
            canary.spec, canary.version, canary.bundle_digest, canary.entry, canary.deployed_at
        )
        serving.outcomes = canary.outcomes
        for replica in canary.replicas.values():
            replica.endpoint = serving
            serving.replicas[replica.id] = replica
        canary.replicas.clear()
        serving.last_start = canary.last_start or serving.last_start
        self._requeue_all(canary, serving)
        canary.removed = True
        self.logs.system(
            serving.app,
            serving.spec.name,
            f"canary promoted: version {serving.version} serves every call; version "
            f"{previous}'s replicas retire as its own are ready",
        )
        self.queues.dispatch(serving)
        self.state.wake.set()
        return serving

    def withdraw(self, label: str, reason: str) -> None:
        """End the canary: its queued calls go to the serving version, its replicas drain."""
        canary = self.state.canaries.pop(label)
        canary.removed = True
        serving = self.state.endpoints.get(label)
        if serving is not None:
            self._requeue_all(canary, serving)
        for replica in list(canary.replicas.values()):
            self.replicas.drain(replica)
        self.logs.system(
            canary.app, canary.spec.name, f"canary version {canary.version} withdrawn: {reason}"
        )
        if serving is not None:
            self.queues.dispatch(serving)
        self.state.wake.set()

    def _requeue_all(self, source: EndpointRuntime, target: EndpointRuntime) -> None:
        """Move queued inputs, in their order, each with a fresh queue timeout."""
        while source.pending:
            inp = source.pending.popleft()
            if inp.done:
                continue
            inp.disarm()  # a fresh queue timeout where it goes
            inp.canary = False
            self.queues.enqueue(target, inp)
