"""What the gateway needs of the cluster to run calls, and nothing more: the endpoints
(and their canaries), inputs submitted, cancelled and streamed, and a request's end.
`core.cluster.Cluster` is one; naming the members here (and of each part it reaches,
the members the gateway calls) says what the gateway's modules depend on."""

from __future__ import annotations

from typing import Protocol

from ember_platform.calls.records import CallRecords
from ember_platform.observability.metrics import PlatformMetrics
from ember_platform.observability.request_stats import RequestStats
from ember_platform.runtime.cluster_model import EndpointRuntime
from ember_platform.runtime.inputs import Input
from ember_platform.runtime.live_state import LiveState


class Intake(Protocol):  # core/input_lifecycle.py's InputLifecycle
    def submit(self, inp: Input) -> None: ...

    def cancel(self, inp: Input, reason: str) -> None: ...


class Streams(Protocol):  # core/streams.py's StreamFlow
    async def next_event(self, inp: Input) -> tuple[str, bytes | None]: ...

    def send_to_input(self, inp: Input, message: bytes) -> None: ...


class Journal(Protocol):  # calls/journal.py's CallJournal
    def request_finished(self, stats: RequestStats, inp: Input, status: int) -> None: ...


class Roster(Protocol):  # core/workers.py's WorkerRoster
    def unservable_reason(self, runtime: EndpointRuntime) -> str | None: ...


class CallPlane(Protocol):
    endpoints: dict[str, EndpointRuntime]  # serving versions, by label
    canaries: dict[str, EndpointRuntime]  # versions on trial, by label
    inputs: dict[str, Input]  # those on their way, by id
    calls: CallRecords  # spawned calls' records
    state: LiveState  # for the bytes it holds (bodies, answers)
    metrics: PlatformMetrics

    # The parts it reaches, read-only: each seen only through what the gateway calls.
    @property
    def input_lifecycle(self) -> Intake: ...

    @property
    def streams(self) -> Streams: ...

    @property
    def journal(self) -> Journal: ...

    @property
    def roster(self) -> Roster: ...
