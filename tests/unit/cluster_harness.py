"""A control plane without a network for unit tests: a real `Cluster` (SQLite store in
tmp_path, real `LogSink`) whose workers and replicas are played by the test. Commands are
read from `worker.outbox` and `replica.outbox` (decoded as the agent and the replica
decode them, then as dicts); answers go in through `worker_message` and
`replica_message`, encoded as `ember.wire.messages` (`reply` checks its header against
its type first); `Controller.tick(now)` is called directly."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from ember.declarations.settings import EndpointSettings
from ember.wire import messages as wire
from ember.wire.labels import make_label
from ember.wire.spec import FUNCTION_METHOD, AppManifest, EndpointSpec, MethodSpec
from ember_platform.config import ServerConfig
from ember_platform.core.cluster import Cluster
from ember_platform.core.controller import Controller
from ember_platform.observability.logs import LogSink
from ember_platform.runtime.cluster_model import EndpointRuntime, Replica, Worker
from ember_platform.runtime.inputs import Input, Outcome
from ember_platform.storage.records import Deployment
from ember_platform.storage.sqlite_store import SqliteStateStore

APP = "demo"
ENDPOINT = "fn"
LABEL = make_label(APP, ENDPOINT)
DIGEST = "sha256:" + "ab" * 32
ENTRY = "app.py"
WORKER_HELLO = wire.Hello(name="node-1", cpu=4, memory=8192)

Message = tuple[dict[str, Any], bytes]  # a channel message: header, body


def deployment(
    version: int = 1, *, streaming: bool = False, is_async: bool = False, **settings: Any
) -> Deployment:
    spec = EndpointSpec(
        name=ENDPOINT,
        attribute="fn",
        kind="function",
        settings=EndpointSettings(**settings),
        methods={
            FUNCTION_METHOD: MethodSpec(FUNCTION_METHOD, streaming=streaming, is_async=is_async)
        },
    )
    manifest = AppManifest(app=APP, entry=ENTRY, endpoints=[spec])
    return Deployment(APP, version, DIGEST, manifest.to_dict(), time.time())


def hello(**fields: Any) -> wire.Hello:
    """The default worker's hello with `fields` changed."""
    return msgspec.structs.replace(WORKER_HELLO, **fields)


def error_of(outcome: Outcome) -> tuple[str, str]:
    error = json.loads(outcome.body)["error"]
    return error["type"], error["message"]


@dataclass
class Env:
    """One control plane, one worker, and helpers that play the worker and replicas."""

    config: ServerConfig
    store: SqliteStateStore
    cluster: Cluster
    controller: Controller
    worker: Worker

    @property
    def runtime(self) -> EndpointRuntime:
        return self.cluster.endpoints[LABEL]

    def deploy(
        self, version: int = 1, *, streaming: bool = False, is_async: bool = False, **settings: Any
    ) -> None:
        self.cluster.deployments.apply(
            deployment(version, streaming=streaming, is_async=is_async, **settings)
        )

    def submit(
        self,
        body: bytes = b'{"x": 1}',
        *,
        is_async: bool = False,
        parent_id: str | None = None,
        priority: int = 1,
        affinity: str | None = None,
        canary: bool = False,
    ) -> Input:
        streaming = self.runtime.spec.methods[FUNCTION_METHOD].streaming
        inp = Input(
            id=f"in-{len(self.cluster.inputs)}-{time.monotonic_ns()}",
            label=LABEL,
            method=FUNCTION_METHOD,
            body=body,
            streaming=streaming,
            is_async=is_async,
            parent_id=parent_id,
            priority=priority,
            affinity=affinity,
            canary=canary,
        )
        self.cluster.input_lifecycle.submit(inp)
        return inp

    def tick(self, now: float | None = None) -> None:
        self.controller.tick(time.time() if now is None else now)

    def advance(self, now: float) -> None:
        """Tick at `now` as if every worker and connected replica had kept heartbeating."""
        for worker in self.cluster.workers.values():
            worker.last_seen = now
        for replica in self.cluster.replicas.values():
            if replica.outbox is not None:
                replica.last_seen = now
        self.tick(now)

    def commands(self, worker: Worker | None = None) -> list[dict[str, Any]]:
        """Drain a worker's outbox (the default worker's unless one is given)."""
        outbox = (worker or self.worker).outbox
        out = []
        while not outbox.empty():
            text = outbox.get_nowait()
            out.append({"type": "<close>"} if text == "" else wire.to_builtins(wire.to_agent(text)))
        return out

    def started(self, commands: list[dict[str, Any]]) -> list[Replica]:
        return [
            self.cluster.replicas[c["replica_id"]] for c in commands if c["type"] == "start_replica"
        ]

    def connect(self, replica: Replica) -> None:
        replica.outbox = asyncio.Queue()  # what the replica channel does on connect

    def ready(self, replica: Replica) -> None:
        self.connect(replica)
        self.cluster.messages.from_replica(replica, wire.frame(wire.Ready()))

    def start_ready(self, now: float | None = None) -> list[Replica]:
        """Tick, then bring every replica the tick started to ready."""
        self.tick(now)
        replicas = self.started(self.commands())
        for replica in replicas:
            self.ready(replica)
        return replicas

    def sent(self, replica: Replica) -> list[Message]:
        """Drain what the control plane sent a replica."""
        assert replica.outbox is not None
        out: list[Message] = []
        while not replica.outbox.empty():
            text = replica.outbox.get_nowait()
            if text == "":
                out.append(({"type": "<close>"}, b""))
                continue
            header, body = wire.to_replica(text)
            out.append((wire.to_builtins(header), body.encode()))
        return out

    def inputs_sent(self, replica: Replica) -> list[str]:
        return [h["id"] for h, _ in self.sent(replica) if h["type"] == "input"]

    def reply(
        self, replica: Replica, kind: str, inp: Input | None = None, body: bytes = b"", **extra: Any
    ) -> None:
        fields: dict[str, Any] = {"type": kind, **extra}
        if inp is not None:
            fields["id"] = inp.id
        header: wire.FromReplica = msgspec.convert(fields, wire.FromReplica)
        self.cluster.messages.from_replica(replica, wire.frame(header, body))

    def say(self, message: wire.FromAgent, worker: Worker | None = None) -> None:
        """A message from a worker (the default worker's unless one is given)."""
        self.cluster.messages.from_worker(worker or self.worker, wire.encode(message))

    def exited(self, replica: Replica, returncode: int = 1) -> None:
        self.say(wire.ReplicaExited(replica_id=replica.id, returncode=returncode))

    def logs(self) -> str:
        path = self.config.log_dir / f"{APP}.jsonl"
        return "\n".join(json.loads(line)["text"] for line in path.read_text().splitlines())


def outcome_of(inp: Input) -> Outcome:
    assert inp.done and inp.outcome.done(), f"input {inp.id} has not finished"
    return inp.outcome.result()


def make_env(tmp_path: Path, *, with_worker: bool = True, **config: Any) -> Env:
    # A closed replica channel is lost at once unless a test asks for the wait.
    config.setdefault("exit_report_grace_seconds", 0.0)
    cfg = ServerConfig(state_dir=tmp_path, **config)
    store = SqliteStateStore(cfg.db_path)
    cluster = Cluster(cfg, store, LogSink(cfg.log_dir))
    if with_worker:
        worker = cluster.register_worker(WORKER_HELLO)
    else:  # an outbox to read from, but no worker the cluster knows of
        worker = Worker("w-unregistered", "unregistered", 0.0, 0, {})
    return Env(cfg, store, cluster, Controller(cluster), worker)


def run(
    tmp_path: Path,
    scenario: Callable[[Env], Awaitable[None]],
    *,
    with_worker: bool = True,
    **config: Any,
) -> None:
    """Run `scenario` inside a fresh event loop against a fresh control plane."""

    async def main() -> None:
        env = make_env(tmp_path, with_worker=with_worker, **config)
        try:
            await scenario(env)
        finally:
            env.store.close()

    asyncio.run(main())
