"""Every message between the control plane, a node's agent and a replica, typed, and the one
framing of the replica channel. The control plane, the agent and the replica all import it;
no other module spells a message kind.

Two channels carry them, both WebSockets:

- the agent's (`/v1/workers/channel`): one JSON object a frame, its kind in `"type"`;
- a replica's (`/v1/replicas/channel`): a JSON header line, its kind in `"type"`, then a
  body (JSON text, verbatim); messages batched into one frame are separated by
  `RECORD_SEPARATOR`.

Decoding checks each message against its structure (msgspec, which also encodes and decodes
faster than `json` on the gateway's hot path): a replica runs its user's code, so what it
sends is input to check, never to trust. A message that does not fit raises `WireError`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import msgspec

from ember.declarations import engine_metrics as engine
from ember.wire.gangs import GangMember

# Separates messages batched into one WebSocket frame. Valid JSON text never contains it
# (control characters must be escaped inside strings), so bodies need no escaping.
RECORD_SEPARATOR = "\x1e"


class WireError(ValueError):
    """A message that is not JSON, names no known kind, or does not fit its kind."""


class _Message(msgspec.Struct, tag_field="type", omit_defaults=True, kw_only=True):
    """A message: its kind is its class's tag, sent as `"type"`."""


# ---- A replica to its agent, on its status pipe (a JSON line each) --------------------------


class ReadWeights(msgspec.Struct, kw_only=True):
    """A weights object the replica read, and its version then."""

    url: str
    s3_endpoint_url: str | None = None
    tag: str


class Quiet(_Message, tag="quiet", kw_only=True):
    """Booted and quiet: a snapshot may be taken now (the agent then writes its identity)."""

    boot_seconds: Seconds
    weights: list[ReadWeights] = []  # what it read, for the image's metadata


class ChangedWeights(msgspec.Struct, kw_only=True):
    url: str
    was: str
    now: str


class UncheckedWeights(msgspec.Struct, kw_only=True):
    url: str
    error: str


class WeightsChecked(_Message, tag="weights_checked", kw_only=True):
    """Restored: which weights read before the snapshot changed at their origins since."""

    changed: list[ChangedWeights] = []
    unchecked: list[UncheckedWeights] = []
    checked: int = 0
    seconds: Seconds = 0.0


StatusReport = Quiet | WeightsChecked


# ---- The control plane to a replica (headers of the replica channel) ------------------------


class Input(_Message, tag="input", kw_only=True):
    """An input to run: the body is its keyword arguments (a web request's, for web apps)."""

    id: str
    method: str
    stream: bool = False  # read by methods whose stream flag decides per call
    affinity: str | None = None  # ember.current_affinity_key() in the code
    trace: str | None = None  # its W3C traceparent: its calls join the trace
    priority: int = 1  # 0 high, 1 normal, 2 low (a batch's): ember.current_priority()
    # A gang member's copy of rank 0's input (gang_inputs="every_rank"): it runs it, and
    # says only how it ended, since rank 0's result is the answer.
    echo: bool = False


class InputMessage(_Message, tag="message", kw_only=True):
    """A WebSocket session's message from its caller: the body."""

    id: str


class Ack(_Message, tag="ack", kw_only=True):
    """The control plane took this much of a stream: the replica may run a window ahead."""

    id: str
    bytes: int


class Cancel(_Message, tag="cancel", kw_only=True):
    """Stop the input: its caller went, or its time ran out."""

    id: str


ToReplica = Input | InputMessage | Ack | Cancel


# ---- A replica to the control plane ---------------------------------------------------------


Seconds = Annotated[float, msgspec.Meta(ge=0, le=7 * 86_400)]
ADOPTED: Literal["adopted"] = "adopted"  # the start kind of a replica whose channel reopened


class StartReport(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """How a replica started, sent with `ready`: shown by `ember ls`, the logs and the
    start metrics. Each phase's duration (None: not part of this start)."""

    kind: Literal["cold", "restore", "adopted"] = "cold"
    boot_seconds: Seconds | None = None  # imports and enter(snap=True) hooks
    fetch_seconds: Seconds | None = None  # the snapshot image, to the node (the agent)
    restore_seconds: Seconds | None = None  # CRIU restoring the process (the agent)
    # Of restore_seconds, the CUDA driver putting device memory back.
    gpu_restore_seconds: Seconds | None = None
    weights_check_seconds: Seconds | None = None  # asking weights' origins after a restore
    enter_seconds: Seconds | None = None  # its enter() hooks
    memory_pending: bool = False  # a lazy restore whose memory is still arriving
    image_root: Annotated[str, msgspec.Meta(max_length=300)] = ""  # "lazy", "extracted (why)"

    def phases(self) -> dict[str, float]:
        """The phases' durations by name ("boot", "restore", ...), those it had."""
        return {
            name.removesuffix("_seconds"): value
            for name in self.__struct_fields__
            if name.endswith("_seconds") and (value := getattr(self, name)) is not None
        }


class Ready(_Message, tag="ready", kw_only=True):
    """The replica serves, and how it started."""

    start: StartReport = StartReport()


class StartupFailed(_Message, tag="startup_failed", kw_only=True):
    """Its enter() hooks (or its web app's startup) raised."""

    error_type: str = "Error"
    message: str = ""


class Unhealthy(_Message, tag="unhealthy", kw_only=True):
    """Its `@ember.health_check` failed: it takes no new inputs."""

    check: str = ""
    reason: str = ""


class ReplicaHeartbeat(_Message, tag="heartbeat", kw_only=True):
    """Alive; with what its code read of weights and its own metrics, when there are any."""

    weights: dict[str, Any] | None = None
    metrics: list[Any] | None = None


# Bounds of an engine's metrics as a replica sends them (`ember.declarations.engine_metrics`).
_Name = Annotated[str, msgspec.Meta(max_length=engine.MAX_NAME)]
_Labels = Annotated[
    dict[_Name, Annotated[str, msgspec.Meta(max_length=engine.MAX_LABEL_VALUE)]],
    msgspec.Meta(max_length=engine.MAX_LABELS),
]


class EngineSample(msgspec.Struct, array_like=True):
    """One sample of an engine's metric: its name, its labels, its value."""

    name: _Name
    labels: _Labels
    value: float


class EngineFamily(msgspec.Struct, omit_defaults=True):
    """One metric family of an engine, as prometheus_client's text parser reads it."""

    name: _Name
    type: Annotated[str, msgspec.Meta(max_length=20)]
    samples: Annotated[list[EngineSample], msgspec.Meta(max_length=engine.MAX_SERIES)]
    help: Annotated[str, msgspec.Meta(max_length=engine.MAX_HELP)] = ""


class EngineMetrics(_Message, tag="engine_metrics", kw_only=True):
    """Its engine's metrics (`engine_metrics=`), scraped now: the body is their families
    (`engine_body`); or, with no body, why they could not be."""

    error: Annotated[str, msgspec.Meta(max_length=500)] | None = None


class Event(_Message, tag="event", kw_only=True):
    """One item of a stream: the body. A file's chunk names its media type (base64 body)."""

    id: str
    media_type: str | None = None
    filename: str | None = None


class Result(_Message, tag="result", kw_only=True):
    """The input's result: the body. A file names its media type (base64 body)."""

    id: str
    media_type: str | None = None
    filename: str | None = None


class ResultPart(_Message, tag="result_part", kw_only=True):
    """A piece of a large result (the body), sent ahead of its `Result`, which carries the
    last: each piece is a message of its own, so that the control plane serves other
    calls between them instead of taking in tens of MiB at once."""

    id: str


class End(_Message, tag="end", kw_only=True):
    """A stream's end."""

    id: str


class Error(_Message, tag="error", kw_only=True):
    """The input failed: its status and the error its caller gets."""

    id: str
    status: Annotated[int, msgspec.Meta(ge=400, le=599)] = 500  # an HTTP error's
    error_type: str
    message: str
    # OpenAI's error fields, from an ember.InputError that gives them: the error object
    # carries both keys when either is set.
    param: str | None = None
    code: str | None = None


class Cancelled(_Message, tag="cancelled", kw_only=True):
    """The input stopped (cancelled): its slot is free."""

    id: str


FromReplica = (
    Ready
    | StartupFailed
    | Unhealthy
    | ReplicaHeartbeat
    | EngineMetrics
    | Event
    | Result
    | ResultPart
    | End
    | Error
    | Cancelled
)


# ---- The control plane to an agent ----------------------------------------------------------


class Welcome(_Message, tag="welcome", kw_only=True):
    """The agent's hello was taken: it is this worker."""

    worker_id: str


class Refused(_Message, tag="refused", kw_only=True):
    """The agent's hello was refused, and why (then the channel closes)."""

    reason: str = "refused"


class SnapshotPlan(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What a replica does with a snapshot: take one at its quiet point (`"take"`), or
    start restored from one (`"restore"`, of this image)."""

    action: str  # any other is a cold boot without one (a later release's)
    key: str
    image_id: str = ""


class StartReplica(_Message, tag="start_replica", kw_only=True):
    """Start a replica of an endpoint on this node: cold, or restored from `snapshot`."""

    replica_id: str
    token: str  # the replica's own channel token
    call_token: str = ""  # an invoke grant for its app's workspace: its calls of others
    app: str
    endpoint: str
    label: str
    version: int
    bundle_digest: str
    entry: str
    attribute: str
    concurrency: int
    memory: int | None = None  # MiB, named if the OOM killer ends it
    memory_limit: int | None = None  # MiB, a cgroup's hard cap
    cpu_limit: float | None = None  # CPUs, a cgroup's CFS quota
    cpu: float | None = None  # CPUs it was placed for: the node refuses it past its --cpu
    log_rate: int | None = None  # KiB a second of its output shipped (None: the node's)
    requirements: list[str] = []  # pip lines, with the app's
    env: dict[str, str] = {}  # its env= and its secrets' variables
    # The node picks which of its GPUs; the scheduler checked it has enough.
    gpu_type: str | None = None
    gpu_count: int = 0
    snapshot: SnapshotPlan | None = None  # None: boot cold
    snapshot_note: str | None = None  # why there is no snapshot, said once
    image: dict[str, Any] | None = None  # its endpoint's image= (Image.to_dict), built
    gang: GangMember | None = None  # a member of a replica over several nodes


class StopReplica(_Message, tag="stop_replica", kw_only=True):
    """Stop a replica: SIGTERM, then SIGKILL after `grace` seconds."""

    replica_id: str
    grace: float = 30.0


class KillReplica(_Message, tag="kill_replica", kw_only=True):
    """Kill a replica now."""

    replica_id: str


class PrefetchSnapshot(_Message, tag="prefetch_snapshot", kw_only=True):
    """Fetch a published image into the node's cache before a replica needs it; an
    endpoint with `weights=` sends its environment too (the image may map weights)."""

    key: str
    label: str = ""
    image_id: str = ""
    raw_size: int = 0
    env: dict[str, str] | None = None


class RetakeSnapshot(_Message, tag="retake_snapshot", kw_only=True):
    """The answer to a failed restore's `retake`: may this replica take the new image?"""

    replica_id: str
    key: str
    granted: bool


class ForgetSnapshot(_Message, tag="forget_snapshot", kw_only=True):
    """Free this node's copies of a dropped image."""

    key: str


class ProfileSpec(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What `ember profile` asks of a replica's worker: py-spy, run by the agent itself
    against the replica's process (never a command of the caller's), records its stacks
    for `duration` seconds into a flame graph (SVG) or a speedscope file, or (`dump`)
    prints every thread's stack once."""

    mode: Literal["record", "dump"] = "record"
    duration: Annotated[float, msgspec.Meta(gt=0, le=600)] = 10.0
    format: Literal["flamegraph", "speedscope"] = "flamegraph"
    native: bool = True  # native (C, C++, Cython) frames too, where py-spy can unwind them
    rate: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 100  # samples a second


class Exec(_Message, tag="exec", kw_only=True):
    """Run a command beside a replica (`ember replica exec`), or with `profile` profile
    it (`ember profile`: `command` then only says what runs, for its log)."""

    exec_id: str
    replica_id: str
    command: list[str]
    timeout: float | None = None
    stdin: str | None = None  # base64, handed in whole
    interactive: bool = False
    terminal: tuple[int, int] | None = None  # [rows, cols] of a pseudo-terminal
    profile: ProfileSpec | None = None


class ExecInput(_Message, tag="exec_input", kw_only=True):
    """What an interactive command's caller typed (base64), or the end of its input."""

    exec_id: str
    data: str | None = None
    eof: bool = False


class ExecResize(_Message, tag="exec_resize", kw_only=True):
    """The caller's terminal changed size."""

    exec_id: str
    rows: int = 24
    cols: int = 80


class ExecKill(_Message, tag="exec_kill", kw_only=True):
    """Kill a command run beside a replica."""

    exec_id: str


class BuildImage(_Message, tag="build_image", kw_only=True):
    """Build what the control plane's store lacks of an image (Image.to_dict), saying
    how it goes in ImageBuildOutput and ImageBuildDone messages."""

    build_id: str
    image: dict[str, Any]
    # Local files of its copy steps, uploaded by the deploying client: the sha256 of the
    # tar of each (by the step's layer digest), fetched from /v1/image-files/.
    files: dict[str, str] = {}
    secrets: dict[str, dict[str, str]] = {}  # the values of secrets its steps name
    # A stored registry layer is reused only once the registry accepts the credentials of
    # the secret the step names for the manifest that was pulled (the control plane
    # says no for a workspace that pulled it or was accepted so before).
    verify_registry: bool = True


class ImagesInUse(_Message, tag="images_in_use", kw_only=True):
    """The images the cluster's deployed endpoints run on (sent after each change and
    now and then): a node removes its copies (roots, mounts) of any other image that
    none of its replicas uses."""

    digests: list[str] = []


class ForgetImage(_Message, tag="forget_image", kw_only=True):
    """An image was dropped (`ember image rm`): free this node's copies of it that no
    replica uses."""

    digest: str


class UncordonGpu(_Message, tag="uncordon_gpu", kw_only=True):
    """`ember node uncordon NODE --gpu N`: the fenced GPU takes replicas again (fenced
    anew at once if its condition persists)."""

    index: Annotated[int, msgspec.Meta(ge=0)]


ToAgent = (
    Welcome
    | Refused
    | StartReplica
    | StopReplica
    | KillReplica
    | UncordonGpu
    | PrefetchSnapshot
    | RetakeSnapshot
    | ForgetSnapshot
    | Exec
    | ExecInput
    | ExecResize
    | ExecKill
    | BuildImage
    | ImagesInUse
    | ForgetImage
)


# ---- An agent to the control plane ----------------------------------------------------------


class HeldReplica(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A replica the agent runs, named in its hello: a control plane that took over
    from the one that started it adopts it (its channel reconnects) or stops it."""

    replica_id: str
    token: str  # its channel's, as `start_replica` gave it
    call_token: str = ""
    label: str
    version: int
    gpu_type: str | None = None
    gpu_count: int = 0
    # How long it has run on its node (the node's own clock: no skew between machines).
    # A control plane over its cap keeps the longest-running replicas, warm, and stops
    # ones it started itself before this worker's hello.
    running_seconds: float = 0.0
    # A gang's member: stopped, not adopted (its gang is started anew); its gang's ports
    # stay taken until it has ended.
    gang: GangMember | None = None


class Hello(_Message, tag="hello", kw_only=True):
    """The agent joins: what its node offers and can do, and the replicas it runs."""

    name: str
    cpu: float
    memory: int  # MiB
    gpus: dict[str, int] = {}  # GPU type -> count
    bundles: list[str] = []  # bundle digests already on the node
    snapshots: dict[str, Any] = {}  # {"problem", "env_key", "criu", "lazy_restore", ...}
    memory_limits_problem: str | None = None  # why it cannot enforce memory_limit=
    cpu_limits_problem: str | None = None  # why it cannot enforce cpu_limit=
    labels: dict[str, str] = {}  # `ember worker --label KEY=VALUE`
    # Which loopback its replicas' forwarded ports are on (the boot and network namespace
    # of its agent): nodes that share one may run the members of one gang.
    loopback: Annotated[str, msgspec.Meta(max_length=100)] = ""
    pid: int | None = None  # the agent's, on its machine
    instance: str = ""  # the agent process's own random id: tells a reconnect from a namesake
    replicas: list[HeldReplica] = []  # still running from an earlier session


GpuState = Literal["healthy", "degraded", "failed", "unknown"]


class GpuHealth(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One GPU's health as the node's NVML watch last saw it (ember_worker.gpus.health);
    a failed GPU stays fenced (no replica is placed on it) until the operator uncordons it."""

    index: Annotated[int, msgspec.Meta(ge=0)]
    kind: str
    state: GpuState
    reasons: list[str] = []  # what made it degraded or failed, or why it is unknown
    fenced: bool = False
    lost: bool = False  # fell off the bus: its replicas are replaced at once
    replicas: list[str] = []  # the replicas holding it


class AgentHeartbeat(_Message, tag="heartbeat", kw_only=True):
    """Alive; with the node's GPU samples and its replicas' use, and what its caches hold
    when that changed."""

    gpus: list[dict[str, Any]] | None = None  # NVML samples
    gpu_health: list[GpuHealth] | None = None
    replica_memory: dict[str, int] | None = None  # replica id -> bytes
    replica_cpu_throttled: dict[str, float] | None = None  # replica id -> seconds waited
    cached_snapshots: list[list[str]] | None = None  # [key, image id] pairs
    cached_weights: dict[str, int] | None = None  # object URL -> bytes on disk
    booked: list[float] | None = None  # [CPUs, MiB] its live replicas were placed for


class Logs(_Message, tag="logs", kw_only=True):
    """Replica output and the agent's notes, a batch of log entries."""

    entries: list[dict[str, Any]]


class Leaving(_Message, tag="leaving", kw_only=True):
    """The agent was asked to stop: its replicas finish what they run, nothing new comes."""


class ReplicaExited(_Message, tag="replica_exited", kw_only=True):
    """A replica's process ended, or (`no_room`) never started: the node had none of the
    GPUs it was placed for free (fenced, or not yet let go of), or (`node_full`) its CPUs
    or memory were booked by the replicas it runs; not its code's fault."""

    replica_id: str
    returncode: int | None = None
    detail: str = ""
    no_room: bool = False
    node_full: bool = False


class ReplicaMemoryIn(_Message, tag="replica_memory_in", kw_only=True):
    """A lazily restored replica's memory is all in (or failed to come)."""

    replica_id: str
    seconds: float  # after the restore; always sent, as the control plane reads it
    error: str | None = None


class SnapshotDumped(_Message, tag="snapshot_dumped", kw_only=True):
    """A replica's image is dumped on its node; publishing follows."""

    key: str
    replica_id: str
    label: str
    image_id: str = ""


class SnapshotTaken(_Message, tag="snapshot_taken", kw_only=True):
    """A replica's image is published to the blob store."""

    key: str
    replica_id: str
    label: str
    image_id: str = ""
    bundle_digest: str
    size: int = 0
    raw_size: int = 0
    dump_seconds: float = 0.0


class SnapshotFailed(_Message, tag="snapshot_failed", kw_only=True):
    """Taking or publishing a replica's image failed."""

    key: str
    replica_id: str
    label: str
    image_id: str = ""
    reason: str = ""


class TakeDeclined(_Message, tag="take_declined", kw_only=True):
    """A retake granted too late: the replica booted on without taking the image."""

    key: str
    replica_id: str


class RestoreFailed(_Message, tag="restore_failed", kw_only=True):
    """A replica could not be restored from an image: the node dropped it."""

    key: str
    image_id: str = ""
    replica_id: str
    reason: str = ""
    retake: bool = False  # the replica boots cold and asks to take the new image


class ExecOutput(_Message, tag="exec_output", kw_only=True):
    """Output of a command run beside a replica (base64)."""

    exec_id: str
    stream: str  # "stdout" or "stderr"
    data: str


class ExecExit(_Message, tag="exec_exit", kw_only=True):
    """A command run beside a replica ended: its exit code, or None and why."""

    exec_id: str
    exit_code: int | None = None
    error: str | None = None


class ImageBuildOutput(_Message, tag="image_build_output", kw_only=True):
    """Lines of an image build's output: a line per step, then the step's own."""

    build_id: str
    lines: list[str]


class ImageBuildDone(_Message, tag="image_build_done", kw_only=True):
    """An image build ended: built (how many layers now, how many reused), or why not."""

    build_id: str
    error: str | None = None
    built: int = 0
    reused: int = 0
    seconds: float = 0.0


FromAgent = (
    Hello
    | AgentHeartbeat
    | Logs
    | Leaving
    | ReplicaExited
    | ReplicaMemoryIn
    | SnapshotDumped
    | SnapshotTaken
    | SnapshotFailed
    | TakeDeclined
    | RestoreFailed
    | ExecOutput
    | ExecExit
    | ImageBuildOutput
    | ImageBuildDone
)

# Snapshot reports as the control plane counts them (metrics' event names).
SNAPSHOT_EVENTS: dict[type[_Message], str] = {
    SnapshotDumped: "dumped",
    SnapshotTaken: "published",
    SnapshotFailed: "take_failed",
    RestoreFailed: "restore_failed",
}

_encoder = msgspec.json.Encoder()
_engine_families = msgspec.json.Decoder(
    Annotated[list[EngineFamily], msgspec.Meta(max_length=engine.MAX_FAMILIES)]
)
_from_replica = msgspec.json.Decoder(FromReplica)
_status = msgspec.json.Decoder(StatusReport)
_to_replica = msgspec.json.Decoder(ToReplica)
_from_agent = msgspec.json.Decoder(FromAgent)
_to_agent = msgspec.json.Decoder(ToAgent)


def encode(message: _Message) -> str:
    """A message of the agent's channel, as its frame's text."""
    return _encoded(message)


def frame(header: _Message, body: bytes | str = b"") -> str:
    """A message of a replica's channel: its JSON header line, then its body verbatim."""
    text = body.decode() if isinstance(body, bytes) else body
    return _encoded(header) + "\n" + text


def engine_body(families: list[EngineFamily]) -> str:
    """The body of an `EngineMetrics` message."""
    return _encoder.encode(families).decode()


def engine_families(body: str) -> list[EngineFamily]:
    """The families an `EngineMetrics` message's body holds (at most `MAX_WIRE_BYTES`
    of it: decode no more)."""
    if len(body) > engine.MAX_WIRE_BYTES:
        raise WireError(f"engine metrics of {len(body)} bytes; at most {engine.MAX_WIRE_BYTES}")
    try:
        return _engine_families.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise WireError(str(error)) from None


def records(frame_text: str) -> list[str]:
    """The messages batched into one frame of a replica's channel."""
    return frame_text.split(RECORD_SEPARATOR)


# Python's json module writes two things strict JSON has not: lone surrogates (a str made
# of undecodable bytes, such as a file name in an error message, escaped as `\udcff`) and
# NaN or Infinity. Both sides have sent them: each falls back to json's way for those.


def _encoded(message: _Message) -> str:
    try:
        return _encoder.encode(message).decode()
    except UnicodeEncodeError:  # a lone surrogate, which UTF-8 cannot carry: escaped
        return json.dumps(msgspec.to_builtins(message))


def _decoded(decoder: msgspec.json.Decoder[Any], text: str | bytes) -> Any:
    try:
        return decoder.decode(text)
    except msgspec.ValidationError as error:  # a kind or a field amiss
        raise WireError(str(error)) from None
    except msgspec.DecodeError as error:  # not strict JSON: maybe json's, else none
        try:
            loose = json.loads(text)
        except (ValueError, RecursionError):
            raise WireError(str(error)) from None
    try:
        return msgspec.convert(loose, decoder.type)
    except msgspec.ValidationError as error:
        raise WireError(str(error)) from None


def _split(message: str) -> tuple[str, str]:
    header, _, body = message.partition("\n")
    return header, body


def from_replica(message: str) -> tuple[FromReplica, str]:
    """One message a replica sent (a record of its frame): its header and its body."""
    header, body = _split(message)
    return _decoded(_from_replica, header), body


def status_line(report: StatusReport) -> bytes:
    """A status report as its line on the status pipe."""
    return msgspec.json.encode(report) + b"\n"


def from_status_pipe(line: bytes) -> StatusReport:
    """One line a replica wrote on its status pipe."""
    return _decoded(_status, line)


def to_replica(message: str) -> tuple[ToReplica, str]:
    """One message the control plane sent a replica: its header and its body."""
    header, body = _split(message)
    return _decoded(_to_replica, header), body


def from_agent(text: str | bytes) -> FromAgent:
    """One message an agent sent on its channel."""
    return _decoded(_from_agent, text)


def to_agent(text: str | bytes) -> ToAgent:
    """One message the control plane sent an agent."""
    return _decoded(_to_agent, text)


def to_builtins(message: _Message) -> dict[str, Any]:
    """A message as a plain dict, its kind in "type" (for logs and tests)."""
    return msgspec.to_builtins(message)


def kinds(union: Any) -> Iterator[str]:
    """The kinds a union of messages names, in order (for docs and tests)."""
    for struct in union.__args__:
        yield struct.__struct_config__.tag
