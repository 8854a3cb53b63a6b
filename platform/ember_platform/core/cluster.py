"""The control plane's live picture and the parts that change it, composed.

`Cluster` builds the parts from the services it is given, each part handed the others
it needs, and is what the HTTP layer, the API, the controller and the server hold: the
picture (`endpoints`, `canaries`, `workers`, `replicas`, `inputs`, `wake`), the services
and the parts. Callers reach an operation on the part that does it, by its one name
(`cluster.input_lifecycle.replica_lost`, `cluster.roster.gone`); only what spans parts is
a method here (a worker's registration, garbage collection).

The parts, in the order they are built (each uses only those before it):
  calls/journal.py      CallJournal: what is kept and told of each call
  replicas.py           ReplicaLifecycle: start, ready, drain, stop, removal, usage
  gangs.py              GangStarts: a replica over several nodes, a member on each
  input_lifecycle.py    InputLifecycle (with queues.py's Queues): submit to outcome
  streams.py            StreamFlow: a running input's stream to and from its caller
  canaries.py           CanaryTrials: a new version beside the serving one
  deployments.py        Deployments: versions served, scaling overrides, removal
  snapshots/events.py   SnapshotReports: workers' snapshot reports, images offered
  workers.py            WorkerRoster: workers joining and leaving, nodes drained
  channel_messages.py   ChannelMessages: what workers and replicas say
  images/               image builds on nodes, nodes' copies and the store's blobs collected
"""

from __future__ import annotations

import functools

from ember.wire import messages as wire
from ember_platform.calls.journal import CallJournal
from ember_platform.calls.records import CallRecords
from ember_platform.calls.spans import SpanExporter
from ember_platform.calls.webhooks import WebhookSender
from ember_platform.config import ServerConfig
from ember_platform.core.canaries import CanaryTrials
from ember_platform.core.channel_messages import ChannelMessages
from ember_platform.core.deployments import Deployments
from ember_platform.core.gangs import GangStarts
from ember_platform.core.input_lifecycle import InputLifecycle
from ember_platform.core.replica_exec import ExecSessions
from ember_platform.core.replicas import ReplicaLifecycle
from ember_platform.core.streams import StreamFlow
from ember_platform.core.workers import WorkerRoster
from ember_platform.images.blob_garbage import ImageBlobGarbage
from ember_platform.images.builds import ImageBuilds
from ember_platform.images.node_copies import NodeImageCopies
from ember_platform.limits.admission import WorkspaceLimits
from ember_platform.limits.held_bytes import HeldBytes
from ember_platform.limits.workspace_limits import WorkspaceLimitRegistry, rate_of
from ember_platform.observability.engine_metrics import EngineMetrics
from ember_platform.observability.logs import LogSink
from ember_platform.observability.metrics import PlatformMetrics
from ember_platform.runtime.cluster_model import Worker
from ember_platform.runtime.live_state import LiveState
from ember_platform.security.secrets import SecretRegistry
from ember_platform.snapshots.events import SnapshotReports, image_dropped
from ember_platform.snapshots.registry import SnapshotRegistry
from ember_platform.storage.blobs import BlobStore, LocalBlobStore
from ember_platform.storage.state_store import StateStore


class Cluster:
    def __init__(
        self,
        config: ServerConfig,
        store: StateStore,
        logs: LogSink,
        *,
        blobs: BlobStore | None = None,  # snapshot images: the config's blob dir if None
        metrics: PlatformMetrics | None = None,
        calls: CallRecords | None = None,
        secrets: SecretRegistry | None = None,
        execs: ExecSessions | None = None,  # `ember replica exec` commands in flight
        webhooks: WebhookSender | None = None,  # None: no webhooks are sent
        spans: SpanExporter | None = None,  # requests' spans to a collector, if set
    ) -> None:
        self.config = config
        self.store = store
        self.logs = logs
        self.metrics = metrics or PlatformMetrics()
        self.calls = calls or CallRecords(store)
        self.secrets = secrets or SecretRegistry(store)
        self.execs = execs or ExecSessions()
        self.webhooks = webhooks
        self.spans = spans

        state = self.state = LiveState(
            draining_nodes=set(store.list_draining_nodes()),
            bodies=HeldBytes(config.held_budgets),
            answers=HeldBytes(config.held_budgets),
        )
        # The replicas' engines' own metrics (`engine_metrics=`), after the platform's in
        # /metrics.
        self.engine_metrics = EngineMetrics(alive=lambda replica: replica in state.replicas)
        self.endpoints = state.endpoints
        self.canaries = state.canaries
        self.workers = state.workers
        self.replicas = state.replicas
        self.inputs = state.inputs
        self.wake = state.wake
        self.snapshots = SnapshotRegistry(
            store,
            blobs or LocalBlobStore(config.blob_dir),
            config.snapshot_budget_bytes,
            on_drop=functools.partial(image_dropped, state.workers),  # nodes free copies
        )

        self.journal = CallJournal(state, self.calls, store, logs, self.metrics, webhooks, spans)
        replicas = self.replica_lifecycle = ReplicaLifecycle(
            state, config, store, logs, self.metrics, self.snapshots, self.secrets
        )
        self.gangs = GangStarts(state, logs, replicas, self.snapshots)
        self.workspace_limits = WorkspaceLimitRegistry(
            store,
            WorkspaceLimits(
                config.workspace_max_queued,
                config.workspace_max_running,
                rate_of(config.workspace_rate),
            ),
        )
        inputs = self.input_lifecycle = InputLifecycle(
            state,
            config,
            replicas,
            self.journal,
            logs,
            self.metrics,
            self.workspace_limits,
            self.engine_metrics,
        )
        self.queues = inputs.queues
        self.streams = StreamFlow(state, inputs, logs)
        self.trials = CanaryTrials(state, logs, self.queues, replicas)
        self.deployments = Deployments(
            state, store, logs, self.snapshots, inputs, replicas, self.trials
        )
        self.snapshot_reports = SnapshotReports(
            state, self.snapshots, self.secrets, logs, self.metrics
        )
        self.roster = WorkerRoster(
            state,
            config,
            store,
            logs,
            self.snapshots,
            self.snapshot_reports,
            self.execs,
            replicas,
            inputs,
        )
        # Images: built on worker nodes; their blobs and nodes' copies collected.
        self.image_blobs = ImageBlobGarbage(self.snapshots.blobs)
        self.image_builds = ImageBuilds(state, self.image_blobs)
        self.image_copies = NodeImageCopies(state)
        self.messages = ChannelMessages(
            state,
            config,
            replicas,
            inputs,
            self.streams,
            self.roster,
            self.snapshot_reports,
            self.execs,
            logs,
            self.metrics,
            self.engine_metrics,
            image_builds=self.image_builds,
        )

    def register_worker(self, hello: wire.Hello) -> Worker:
        """A worker's hello (WorkerRoster.register); once welcomed, it is told which
        images deployments run on."""
        worker = self.roster.register(hello)
        self.image_copies.sync()
        return worker

    def collect_garbage(self) -> None:
        """After a change of deployments, and now and then: snapshot images of code no
        longer deployed, and nodes told which images deployments still run on."""
        self.deployments.collect_snapshots()
        self.image_copies.sync()

    def collect_image_blobs(self) -> None:
        """Image blobs no built image names, old enough (in the background)."""
        self.image_blobs.collect_soon(*self.image_builds.building())
