"""Endpoint settings: one dataclass, checked once, when the decorator runs."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ember.declarations.engine_metrics import MetricTarget, check_engine_metrics
from ember.declarations.node_labels import check_node_labels
from ember.declarations.retries import Retries
from ember.declarations.schedules import Schedule, schedule_from_dict
from ember.errors import InvalidError
from ember.images.image import Image

# GPU types a worker may advertise and an endpoint may ask for. Names are upper-case;
# aliases let users write what they see in `nvidia-smi`.
GPU_TYPES: tuple[str, ...] = (
    "T4",
    "L4",
    "A10G",
    "L40S",
    "A100",
    "A100-80GB",
    "H100",
    "H200",
    "B200",
)
GPU_ALIASES: dict[str, str] = {"A100-40GB": "A100", "H100-80GB": "H100", "A10": "A10G"}

NAME_PATTERN = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,46}[a-z0-9])?\Z")  # \Z: "a\n" is no name


def check_name(kind: str, name: str) -> str:
    """Return `name` if it can be part of a label and a DNS name, else raise InvalidError."""
    if not isinstance(name, str) or not NAME_PATTERN.match(name) or "--" in name:
        raise InvalidError(
            f"{kind} name {name!r} is not allowed: use 1-48 lower-case letters, digits and "
            "single hyphens, starting and ending with a letter or digit "
            "(it becomes part of a URL and a DNS name)"
        )
    return name


def normalize_name(name: str) -> str:
    """Turn a Python identifier such as `MyModel_v2` into a label-safe `mymodel-v2`."""
    cleaned = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return re.sub(r"-{2,}", "-", cleaned)


MAX_GPU_CHOICES = 8
ROUTE_BY = (None, "prefix")


def parse_gpu_choices(gpu: str | list[str] | None) -> tuple[tuple[str, int], ...]:
    """`gpu=` as (type, count) choices in order of preference: one for "H100:2", several
    for ["H100", "A100-80GB:2"] (whichever a node has free, the first preferred); none
    for no GPU."""
    if gpu is None:
        return ()
    if isinstance(gpu, list | tuple):
        if not gpu or len(gpu) > MAX_GPU_CHOICES:
            raise InvalidError(
                f"gpu={gpu!r}: a list names 1 to {MAX_GPU_CHOICES} GPU types in order of "
                "preference, e.g. gpu=['H100', 'A100-80GB:2']"
            )
        choices = [parse_gpu(choice) for choice in gpu]
        kinds = [kind for kind, _ in choices]
        if len(set(kinds)) != len(kinds):
            raise InvalidError(f"gpu={gpu!r} names a GPU type twice")
        return tuple((str(kind), count) for kind, count in choices)
    kind, count = parse_gpu(gpu)
    return ((str(kind), count),)


def parse_gpu(gpu: str | None) -> tuple[str | None, int]:
    """Parse `"H100"` or `"H100:2"` into (type, count); None means no GPU."""
    if gpu is None:
        return None, 0
    if not isinstance(gpu, str) or not gpu.strip():
        raise InvalidError(f"gpu={gpu!r} is not a GPU type; write e.g. gpu='H100' or 'H100:2'")
    kind, _, count_text = gpu.strip().upper().partition(":")
    kind = GPU_ALIASES.get(kind, kind)
    if kind not in GPU_TYPES:
        raise InvalidError(
            f"unknown GPU type {gpu!r}; choose one of {', '.join(GPU_TYPES)} "
            "(append ':N' for N GPUs, e.g. 'H100:2')"
        )
    count = 1
    if count_text:
        if not re.fullmatch(r"[0-9]+", count_text) or not 1 <= int(count_text) <= 8:
            raise InvalidError(f"gpu={gpu!r}: the count after ':' must be 1 to 8")
        count = int(count_text)
    return kind, count


WEIGHTS_SCHEMES = ("s3", "http", "https", "file")


def check_weights_entry(name: str, url: str) -> None:
    """One `weights=` entry: a Python identifier naming a URL Ember can read."""
    if not name.isidentifier():
        raise InvalidError(f"weights: {name!r} is not a valid name; use letters, digits and _")
    parts = urlsplit(url)
    if parts.scheme not in WEIGHTS_SCHEMES:
        raise InvalidError(
            f"weights[{name!r}]={url!r}: use an s3://, https://, http:// or file:// URL"
        )
    whole_bucket = parts.path == "/"  # s3://bucket/: a sharded checkpoint at its root
    if parts.scheme == "s3" and (not parts.netloc or not (parts.path.strip("/") or whole_bucket)):
        raise InvalidError(
            f"weights[{name!r}]={url!r}: an S3 URL names a bucket and a key or a prefix, "
            "e.g. s3://bucket/model.safetensors or s3://bucket/llama/"
        )
    if parts.scheme in ("http", "https") and not parts.netloc:
        raise InvalidError(f"weights[{name!r}]={url!r}: the URL has no host")
    if parts.scheme == "file" and parts.netloc not in ("", "localhost"):
        raise InvalidError(f"weights[{name!r}]={url!r}: a file URL needs an absolute path")


# A body travels to a replica in one channel message, files in it as base64.
MAX_BODY_MB = 48

ENV_KEY_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
RESERVED_ENV_PREFIX = "EMBER_"  # the platform's own variables
MAX_REQUIREMENTS = 200
MAX_REQUIREMENT_CHARS = 1000
MAX_ENV_KEYS = 100
MAX_ENV_VALUE_BYTES = 64 * 1024
MAX_ENV_BYTES = 256 * 1024


def check_requirements(lines: Any) -> list[str]:
    """`lines` if each is one requirement line for pip ("numpy>=2", "./wheels/x.whl",
    "--extra-index-url URL"), else InvalidError."""
    if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
        raise InvalidError(
            "requirements must be a list of pip requirement lines, e.g. ['numpy>=2', 'scipy']"
        )
    if len(lines) > MAX_REQUIREMENTS:
        raise InvalidError(f"requirements has {len(lines)} lines; at most {MAX_REQUIREMENTS}")
    for line in lines:
        if (
            not line.strip()
            or len(line) > MAX_REQUIREMENT_CHARS
            or any(c in line for c in "\r\n\0")
        ):
            raise InvalidError(
                f"requirements: {line[:80]!r} is not one requirement line (one line of at "
                f"most {MAX_REQUIREMENT_CHARS} characters, not empty)"
            )
    return list(lines)


def check_environment(what: str, values: Any) -> dict[str, str]:
    """`values` if they can be variables of a replica's environment, else InvalidError
    naming `what` (a secret, an endpoint's env=)."""
    if not isinstance(values, dict):
        raise InvalidError(f"{what} must map variable names to values")
    if len(values) > MAX_ENV_KEYS:
        raise InvalidError(f"{what} has {len(values)} keys; at most {MAX_ENV_KEYS}")
    total = 0
    for key, value in values.items():
        if not isinstance(key, str) or not ENV_KEY_PATTERN.match(key):
            raise InvalidError(
                f"{key!r} is not an environment variable name: use letters, digits and "
                "underscores, not starting with a digit"
            )
        if key.upper().startswith(RESERVED_ENV_PREFIX):
            raise InvalidError(f"{key}: names starting with {RESERVED_ENV_PREFIX} are Ember's own")
        if not isinstance(value, str) or "\0" in value:
            raise InvalidError(f"the value of {key} must be text without NUL characters")
        size = len(value.encode())
        if size > MAX_ENV_VALUE_BYTES:
            raise InvalidError(f"the value of {key} is {size} bytes; at most {MAX_ENV_VALUE_BYTES}")
        total += size
    if total > MAX_ENV_BYTES:
        raise InvalidError(f"{what} holds {total} bytes; at most {MAX_ENV_BYTES}")
    return dict(values)


# scheme://host[:port], the host a name or an IPv6 literal in brackets.
ORIGIN_PATTERN = re.compile(r"https?://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?\Z")


def check_cors_origins(origins: Any) -> None:
    if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
        raise InvalidError(
            "cors_origins must be a list of origins, e.g. cors_origins=['https://app.example.com']"
        )
    for origin in origins:
        if origin != "*" and not ORIGIN_PATTERN.match(origin):
            raise InvalidError(
                f"cors_origins: {origin!r} is not an origin; write scheme://host[:port] with "
                "no path, e.g. 'https://app.example.com' or 'http://localhost:3000', or '*'"
            )


ROLLOUTS = ("rolling", "recreate")
MAX_GANG_NODES = 64  # members of one gang
MAX_GANG_PORTS = 1024  # ports each member of a gang listens on
MAX_GANG_PORTS_IN_ALL = 2048  # of all its members: what one workspace's gangs may hold
GANG_INPUTS = ("rank0", "every_rank")


@dataclass(frozen=True)
class EndpointSettings:
    """Everything a user can set on `@ember.endpoint`, validated in `__post_init__`."""

    name: str | None = None
    min_replicas: int = 0
    max_replicas: int = 4
    concurrency: int = 1
    # Inputs per replica the autoscaler sizes for (None: `concurrency`); a replica takes
    # up to `concurrency` while new replicas start, so a burst waits for none.
    target_concurrency: int | None = None
    scaledown_window: float = 60.0
    buffer_replicas: int = 0  # extra ready replicas while the endpoint has work
    timeout: float = 300.0
    retries: int = 2
    gpu: str | list[str] | None = None  # "H100", "H100:2", or choices in order of preference
    cpu: float = 0.25
    memory: int = 512  # MiB the scheduler reserves for each replica
    memory_limit: int | None = None  # MiB a replica may use before the OOM killer ends it
    cpu_limit: float | None = None  # CPUs' worth of time a replica may use (a CFS quota)
    public: bool = False
    snapshot: bool = True
    weights: dict[str, str] = field(default_factory=dict)
    secrets: list[str] = field(default_factory=list)  # names from `ember secret set`
    s3_endpoint_url: str | None = None  # for s3:// weights; else the AWS settings decide
    schedule: dict[str, Any] | None = None  # Cron(...).to_dict() or Period(...).to_dict()
    # Retries(...).backoff(): inputs whose code raised are retried too, after these delays
    retry_backoff: dict[str, float] | None = None
    # Web pages that may call it from a browser: origins such as "https://app.example.com",
    # or "*" for any.
    cors_origins: list[str] = field(default_factory=list)
    # Environment variables of every replica (not secret: they are in the code; values
    # that are go in `secrets`, whose variables win over these).
    env: dict[str, str] = field(default_factory=dict)
    # MiB a request body may hold (uploads): the server's limit (8 by default) when None.
    max_body_mb: float | None = None
    # Inputs that may wait for a replica before callers get 429 (None: the server's
    # --max-queue), and seconds a synchronous call may wait before it gets 504 (None: as
    # long as its caller does).
    max_queue: int | None = None
    queue_timeout: float | None = None
    # Inputs one replica takes before it retires and a fresh one takes over (None: no
    # limit); retried inputs count.
    max_inputs: int | None = None
    # Seconds a replica may take from its start to ready (boot or restore, and its
    # `enter` hooks) before it is killed as a failed start (None: the server's 600).
    startup_timeout: float | None = None
    # pip requirement lines of this endpoint's own (beside the app's requirements.txt):
    # its replicas run in an environment made with both.
    requirements: list[str] = field(default_factory=list)
    # Labels a node must carry (all of them) to run its replicas: `ember worker --label`.
    node_labels: dict[str, str] = field(default_factory=dict)
    # Replicas spread over zones (the nodes' `zone` label) and nodes, so that losing one
    # leaves the others serving; False packs them onto the fewest nodes.
    spread: bool = True
    # Nodes one replica spans (a gang: a process on each, started and ended together, the
    # first taking the inputs), and the ports each member may listen on for its peers.
    nodes: int = 1
    gang_ports: int = 32
    # Which members of a gang run each input: "rank0" (the others follow its lead through
    # their process group) or "every_rank" (each runs it; rank 0's result is the answer).
    gang_inputs: str = "rank0"
    # How a redeploy replaces replicas: "rolling" (the old version serves until the new
    # one's are ready) or "recreate" (the old ones drain at once; calls wait for the new).
    rollout: str = "rolling"
    # Where each replica's engine metrics are: "prometheus" (its process's registry) or a
    # loopback URL; and MetricTarget(...).to_dict(), a target on one of them to scale on.
    engine_metrics: str | None = None
    scale_on: dict[str, Any] | None = None
    # Image(...).to_dict(): the root file system its replicas are to run on (None: the
    # worker's own system, with `requirements` in an environment of their own).
    image: dict[str, Any] | None = None
    # KiB a second of each replica's output kept in its log (None: the node's, 1024 by
    # default); lower only: a node ships no more than its own limit.
    log_rate: int | None = None
    # How inputs pick a replica: None (the least busy, or an affinity key's home) or
    # "prefix" (the one whose engine most likely caches the longest prefix of the prompt).
    route_by: str | None = None

    def __post_init__(self) -> None:
        if self.name is not None:
            check_name("endpoint", self.name)
        self._check_int("min_replicas", self.min_replicas, 0, 1000)
        self._check_int("max_replicas", self.max_replicas, 1, 1000)
        if self.max_replicas < self.min_replicas:
            raise InvalidError(
                f"max_replicas={self.max_replicas} is below min_replicas={self.min_replicas}; "
                f"raise max_replicas to at least {self.min_replicas} or lower min_replicas"
            )
        self._check_int("concurrency", self.concurrency, 1, 10_000)
        if self.target_concurrency is not None:
            self._check_int("target_concurrency", self.target_concurrency, 1, 10_000)
            if self.target_concurrency > self.concurrency:
                raise InvalidError(
                    f"target_concurrency={self.target_concurrency} is above concurrency="
                    f"{self.concurrency}: the target is what the autoscaler aims for within "
                    "what a replica may take; raise concurrency or lower the target"
                )
        self._check_int("buffer_replicas", self.buffer_replicas, 0, 100)
        if self.buffer_replicas and self.buffer_replicas >= self.max_replicas:
            # While there is work one replica at least serves it, and max_replicas caps
            # the total: a buffer this big could never be kept.
            raise InvalidError(
                f"buffer_replicas={self.buffer_replicas} leaves no room under max_replicas="
                f"{self.max_replicas}: the buffer is kept beside the replicas that serve; "
                f"lower buffer_replicas below {self.max_replicas} (`ember scale --buffer`) "
                "or raise max_replicas"
            )
        self._check_int("retries", self.retries, 0, 10)
        self._check_int("nodes", self.nodes, 1, MAX_GANG_NODES)
        self._check_int("gang_ports", self.gang_ports, 2, MAX_GANG_PORTS)
        if self.nodes * self.gang_ports > MAX_GANG_PORTS_IN_ALL:
            raise InvalidError(
                f"nodes={self.nodes} x gang_ports={self.gang_ports} is "
                f"{self.nodes * self.gang_ports} ports; a gang may hold at most "
                f"{MAX_GANG_PORTS_IN_ALL}: lower gang_ports"
            )
        if self.gang_inputs not in GANG_INPUTS:
            raise InvalidError(
                f"gang_inputs={self.gang_inputs!r}: use 'rank0' (rank 0 runs each input, the "
                "others follow it through their process group) or 'every_rank' (each member "
                "runs each input, and rank 0's result is the answer)"
            )
        self._check_number("scaledown_window", self.scaledown_window, 0.0, 86_400.0)
        self._check_number("timeout", self.timeout, 0.001, 86_400.0)
        self._check_number("cpu", self.cpu, 0.01, 512.0)
        self._check_int("memory", self.memory, 16, 4 * 1024 * 1024)
        if self.memory_limit is not None:
            self._check_int("memory_limit", self.memory_limit, 16, 4 * 1024 * 1024)
            if self.memory_limit < self.memory:
                raise InvalidError(
                    f"memory_limit={self.memory_limit} is below memory={self.memory}: the "
                    "limit (MiB a replica may use) must be at least what it reserves"
                )
        if self.cpu_limit is not None:
            self._check_number("cpu_limit", self.cpu_limit, 0.01, 512.0)
            if self.cpu_limit < self.cpu:
                raise InvalidError(
                    f"cpu_limit={self.cpu_limit:g} is below cpu={self.cpu:g}: the limit "
                    "(CPUs a replica may use) must be at least what it reserves"
                )
        parse_gpu_choices(self.gpu)
        for flag in ("public", "snapshot", "spread"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidError(f"{flag} must be True or False, not {getattr(self, flag)!r}")
        if not isinstance(self.weights, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.weights.items()
        ):
            raise InvalidError(
                "weights must map names to URLs, e.g. weights={'model': 's3://bucket/model/'}"
            )
        for name, url in self.weights.items():
            check_weights_entry(name, url)
        if not isinstance(self.secrets, list) or not all(isinstance(s, str) for s in self.secrets):
            raise InvalidError("secrets must be a list of secret names, e.g. secrets=['openai']")
        for secret in self.secrets:
            check_name("secret", secret)
        if len(set(self.secrets)) != len(self.secrets):
            raise InvalidError(f"secrets={self.secrets!r} names a secret twice")
        if self.schedule is not None:
            schedule_from_dict(self.schedule)
        check_cors_origins(self.cors_origins)
        check_environment("env", self.env)
        if self.log_rate is not None:
            self._check_int("log_rate", self.log_rate, 1, 1024 * 1024)
        if self.route_by not in ROUTE_BY:
            raise InvalidError(
                f"route_by={self.route_by!r}: use route_by='prefix' (requests go to the replica "
                "whose engine most likely caches the longest prefix of their prompt), or leave "
                "it out"
            )
        if self.max_body_mb is not None:
            self._check_number("max_body_mb", self.max_body_mb, 0.001, MAX_BODY_MB)
        if self.max_queue is not None:
            self._check_int("max_queue", self.max_queue, 1, 1_000_000)
        if self.queue_timeout is not None:
            self._check_number("queue_timeout", self.queue_timeout, 0.001, 86_400.0)
        check_node_labels("node_labels", self.node_labels)
        check_requirements(self.requirements)
        if self.startup_timeout is not None:
            self._check_number("startup_timeout", self.startup_timeout, 1.0, 86_400.0)
        if self.max_inputs is not None:
            self._check_int("max_inputs", self.max_inputs, 1, 1_000_000_000)
        if self.rollout not in ROLLOUTS:
            raise InvalidError(
                f"rollout={self.rollout!r}: use 'rolling' (the old version serves until the "
                "new one is ready) or 'recreate' (calls wait for the new version)"
            )
        check_engine_metrics(self.engine_metrics)
        if self.scale_on is not None:
            MetricTarget.from_dict(self.scale_on)
            if self.engine_metrics is None:
                raise InvalidError(
                    "scale_on reads the engine's metrics: set engine_metrics='prometheus' "
                    "(or the engine's loopback URL) too"
                )
        if self.image is not None:
            Image.from_dict(self.image)
        if self.retry_backoff is not None:
            if not isinstance(self.retry_backoff, dict) or set(self.retry_backoff) != set(
                Retries(0).backoff()
            ):
                raise InvalidError(f"retry_backoff={self.retry_backoff!r} is not Retries' form")
            Retries(self.retries, **self.retry_backoff)
        if self.s3_endpoint_url is not None:
            scheme = urlsplit(str(self.s3_endpoint_url)).scheme
            if not isinstance(self.s3_endpoint_url, str) or scheme not in ("http", "https"):
                raise InvalidError(
                    f"s3_endpoint_url={self.s3_endpoint_url!r} must be an http(s) URL, "
                    "e.g. 'https://s3.example.internal'"
                )

    @staticmethod
    def _check_int(name: str, value: Any, low: int, high: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidError(f"{name} must be a whole number, not {value!r}")
        if not low <= value <= high:
            raise InvalidError(f"{name}={value} is out of range; use {low} to {high}")

    @staticmethod
    def _check_number(name: str, value: Any, low: float, high: float) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise InvalidError(f"{name} must be a number of seconds/units, not {value!r}")
        if not low <= value <= high:
            raise InvalidError(f"{name}={value} is out of range; use {low:g} to {high:g}")

    @property
    def scaling_concurrency(self) -> int:
        """The inputs per replica the autoscaler sizes for."""
        return self.concurrency if self.target_concurrency is None else self.target_concurrency

    @property
    def image_digest(self) -> str | None:
        return None if self.image is None else str(self.image["digest"])

    @property
    def metric_target(self) -> MetricTarget | None:
        return None if self.scale_on is None else MetricTarget.from_dict(self.scale_on)

    @property
    def parsed_schedule(self) -> Schedule | None:
        return None if self.schedule is None else schedule_from_dict(self.schedule)

    @property
    def gpu_choices(self) -> tuple[tuple[str, int], ...]:
        return parse_gpu_choices(self.gpu)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EndpointSettings:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)
