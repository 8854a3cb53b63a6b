"""Deployments in the live picture: an app's version served (its endpoints' runtimes
created or moved to it), its autoscaling changed without a deploy (`ember scale`), its
endpoints removed; at start, the stored versions and overrides served again; and the
snapshots that no deployed version or secret can use any more let go.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from ember.errors import InvalidError
from ember.wire.labels import make_label, split_app_key
from ember.wire.spec import AppManifest
from ember_platform.core.canaries import CanaryTrials
from ember_platform.core.input_lifecycle import InputLifecycle
from ember_platform.core.replicas import ReplicaLifecycle
from ember_platform.observability.logs import LogSink
from ember_platform.runtime.cluster_model import EndpointRuntime
from ember_platform.runtime.inputs import Outcome
from ember_platform.runtime.live_state import LiveState
from ember_platform.scaling.overrides import SCALABLE, effective_settings, merged
from ember_platform.snapshots.registry import SnapshotRegistry
from ember_platform.storage.records import Deployment, ScalingOverride
from ember_platform.storage.state_store import StateStore, StoreWriteError

log = logging.getLogger("ember.cluster")


class Deployments:
    def __init__(
        self,
        state: LiveState,
        store: StateStore,
        logs: LogSink,
        snapshots: SnapshotRegistry,
        inputs: InputLifecycle,
        replicas: ReplicaLifecycle,
        trials: CanaryTrials,
    ) -> None:
        self.state = state
        self.store = store
        self.logs = logs
        self.snapshots = snapshots
        self.inputs = inputs
        self.replicas = replicas
        self.trials = trials

    def apply(self, deployment: Deployment, *, resumed: bool = False) -> list[EndpointRuntime]:
        """Serve the deployment's version of its app; endpoints it lacks are removed.
        `resumed`: served again at a start of the control plane, which is no deploy."""
        manifest = AppManifest.from_dict(deployment.manifest)
        seen = set()
        runtimes = []
        for spec in manifest.endpoints:
            label = make_label(manifest.app, spec.name)
            seen.add(label)
            runtime = self.state.endpoints.get(label)
            if runtime is None:
                runtime = EndpointRuntime(
                    manifest.app, spec, deployment.version, deployment.bundle_digest, manifest.entry
                )
                self.state.endpoints[label] = runtime
                runtime.deployed_at = deployment.created_at
            else:
                # Old replicas drain (controller); queued inputs wait for the new version.
                runtime.take_version(
                    spec,
                    deployment.version,
                    deployment.bundle_digest,
                    manifest.entry,
                    deployment.created_at,
                )
                self._fail_inputs_for_removed_methods(runtime)
            runtimes.append(runtime)
            if not resumed:  # a restart would say it again of every endpoint
                self.logs.system(manifest.app, spec.name, f"deployed version {deployment.version}")
            if label in self.state.canaries:
                self.trials.withdraw(label, f"version {deployment.version} was deployed")
        for label, runtime in list(self.state.endpoints.items()):
            if runtime.app == manifest.app and label not in seen:
                self.remove_endpoint(label, "it was removed from the app")
        self.state.wake.set()
        return runtimes

    def _fail_inputs_for_removed_methods(self, runtime: EndpointRuntime) -> None:
        """Queued inputs of a method the new version no longer has end with the 404 a new
        call of it gets, rather than reach code that lacks it (an AttributeError, a 500)."""
        listed = ", ".join(sorted(runtime.spec.methods)) or "none"
        for inp in [i for i in runtime.pending if i.method not in runtime.spec.methods]:
            runtime.pending.remove(inp)
            message = (
                f"version {runtime.version} of {runtime.label} was deployed while this call "
                f"waited, and has no method {inp.method!r} (it has: {listed})"
            )
            self.inputs.finish(inp, Outcome.error(404, "not_found", message))

    def set_scaling(self, runtime: EndpointRuntime, change: dict[str, Any]) -> None:
        """Change the endpoint's autoscaling settings until its next deploy (None for a
        setting: back to the deployed value); kept in the store across restarts.
        InvalidError when the result is not valid settings, with nothing changed."""
        override = merged(runtime.scaling_override, change)
        settings = effective_settings(runtime.spec.settings, override)
        if override:
            record = ScalingOverride(
                runtime.label, runtime.app, runtime.version, override, time.time()
            )
            self.store.put_scaling_override(record)
        else:
            self.store.delete_scaling_override(runtime.label)
        runtime.scaling_override = override
        runtime.overridden = settings if override else None
        deployed = runtime.spec.settings
        said = ", ".join(
            f"{name}={getattr(settings, name):g}"
            + (f" (deployed {getattr(deployed, name):g})" if name in override else " (as deployed)")
            for name in SCALABLE
        )
        self.logs.system(runtime.app, runtime.spec.name, f"scaling set: {said}")
        self.state.wake.set()

    def resume(self) -> list[str]:
        """At start: serve each app's stored version, with its endpoints' last starts. One
        deployed under an older release whose checks let it through is left out, not the
        platform's start; the returned lines say which and what to fix (also in the app's
        log)."""
        refusals = []
        for deployment in self.store.latest_deployments():
            try:
                self.apply(deployment, resumed=True)
            except (InvalidError, TypeError, KeyError, ValueError) as exc:
                refusal = (
                    f"app {deployment.app} version {deployment.version} is not served: its "
                    f"manifest fails this release's checks ({exc}); fix it and deploy again"
                )
                self.logs.system(deployment.app, "", refusal)
                refusals.append(refusal)
        for label, start in self.store.endpoint_starts().items():
            runtime = self.state.endpoints.get(label)
            if runtime is not None:  # `ember ls` and the dashboard show it as before
                runtime.last_start = start
        return refusals

    def restore_scaling(self) -> int:
        """At start: the stored overrides of the versions that serve; others are gone
        with the deploy that replaced their version."""
        restored = 0
        for record in self.store.list_scaling_overrides():
            runtime = self.state.endpoints.get(record.label)
            if runtime is None or runtime.version != record.version:
                with contextlib.suppress(StoreWriteError):
                    self.store.delete_scaling_override(record.label)
                continue
            try:
                runtime.overridden = effective_settings(runtime.spec.settings, record.settings)
            except (InvalidError, TypeError) as exc:
                log.warning("scaling override of %s dropped: %s", record.label, exc)
                continue
            runtime.scaling_override = dict(record.settings)
            restored += 1
        return restored

    def remove_app(self, app: str) -> int:
        labels = [label for label, r in self.state.endpoints.items() if r.app == app]
        for label in labels:
            self.remove_endpoint(label, f"app {app} was stopped")
        return len(labels)

    def remove_endpoint(self, label: str, reason: str) -> None:
        if label in self.state.canaries:
            self.trials.withdraw(label, reason)
        runtime = self.state.endpoints.pop(label)
        runtime.removed = True
        self.inputs.fail_queued(runtime, Outcome.error(404, "not_found", f"{label}: {reason}"))
        for replica in list(runtime.replicas.values()):
            self.replicas.drain(replica)
        self.logs.system(runtime.app, runtime.spec.name, f"stopped: {reason}")

    def secret_changed(self, workspace: str, name: str) -> None:
        """Drop the images of endpoints that use the secret: they hold its old values.
        (Their keys would not match again anyway; this frees the space at once.)"""
        for label in self.secret_users(workspace, name):
            for record in self.snapshots.for_label(label):
                self.snapshots.drop(record.key)

    def secret_users(self, workspace: str, name: str) -> list[str]:
        """Labels of the workspace's deployed endpoints that ask for the secret."""
        return sorted(
            {
                r.label
                for r in self.state.runtimes()
                if name in r.settings.secrets and split_app_key(r.app)[0] == workspace
            }
        )

    def collect_snapshots(self) -> None:
        current = {(r.label, r.bundle_digest) for r in self.state.runtimes()}
        for key in self.snapshots.collect_garbage(current):
            log.info("snapshot %s collected", key)
