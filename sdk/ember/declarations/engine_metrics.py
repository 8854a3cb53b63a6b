"""Engine metrics: what an endpoint declares with `engine_metrics=` and `scale_on=`.

An endpoint that runs an engine with Prometheus metrics of its own (vLLM, SGLang, ...)
names where they are: "prometheus" (the replica process's own prometheus_client
registry, where an in-process engine such as vLLM's AsyncLLM registers its `vllm:*`
metrics) or a loopback URL (an engine that serves them from a subprocess). Each replica
scrapes them every `SCRAPE_SECONDS` from inside its sandbox and sends them on its channel;
the control plane exports them with the endpoint's and the replica's labels, and
`scale_on=ember.MetricTarget(name, per_replica=X)` sizes the endpoint on one of them.

The limits here bound what one replica may send (the control plane checks them again).
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ember.errors import InvalidError

PROMETHEUS = "prometheus"  # the replica process's own prometheus_client registry
SCRAPE_SECONDS = 2.0  # how often a replica scrapes its engine
SCRAPE_TIMEOUT = 2.0  # seconds a render or a fetch may take
MAX_BYTES = 2 * 1024 * 1024  # of one scrape's text
MAX_SERIES = 4000  # samples of one scrape, over all its families
MAX_FAMILIES = 1000
MAX_WIRE_BYTES = 2 * 1024 * 1024  # of one scrape as its replica sends it (JSON)
MAX_NAME = 200  # characters of a metric's or a label's name
MAX_LABELS = 16  # labels of one sample
MAX_LABEL_VALUE = 200  # characters; longer values are cut
MAX_HELP = 300  # characters; longer help is cut
MAX_URL = 300

METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
RESERVED_PREFIX = "ember:"  # Ember's own metrics: an engine's series may not take them


def check_metric_name(what: str, name: Any) -> str:
    """`name` if an engine's series may have it, else InvalidError naming `what`."""
    if not isinstance(name, str) or len(name) > MAX_NAME or not METRIC_NAME.match(name):
        raise InvalidError(
            f"{what}: {name!r} is not a Prometheus metric name (letters, digits, '_' and "
            f"':', not starting with a digit, at most {MAX_NAME} characters)"
        )
    if name.startswith(RESERVED_PREFIX):
        raise InvalidError(f"{what}: {name!r}: names starting with {RESERVED_PREFIX!r} are Ember's")
    return name


def check_engine_metrics(source: Any) -> str | None:
    """`engine_metrics=`: None, "prometheus", or an http URL on the replica's loopback."""
    if source is None or source == PROMETHEUS:
        return source
    hint = (
        f"engine_metrics={source!r}: use 'prometheus' (this process's prometheus_client "
        "registry) or the engine's metrics URL on loopback, e.g. "
        "'http://127.0.0.1:8000/metrics'"
    )
    if not isinstance(source, str) or len(source) > MAX_URL:
        raise InvalidError(hint)
    try:
        parts = urlsplit(source)
        port = parts.port  # raises on a port that is no number
    except ValueError:
        raise InvalidError(hint) from None
    if parts.scheme != "http" or not parts.hostname or parts.username or parts.password:
        raise InvalidError(hint)
    if any(c.isspace() for c in source) or (port is not None and not 0 < port < 65536):
        raise InvalidError(hint)
    if not _loopback(parts.hostname):
        raise InvalidError(
            f"{hint}; {parts.hostname!r} is not loopback: a replica fetches its engine's "
            "metrics from inside its sandbox, never from another host"
        )
    return source


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class MetricTarget:
    """Scale on an engine metric: as many replicas as keep the metric's sum over the
    replicas, divided by their number, near `per_replica` (for example
    `MetricTarget("vllm:num_requests_waiting", per_replica=4.0)`). It adds to queue
    depth: the endpoint gets the larger of the two counts. `name` is a sample's name as
    the engine exports it (a gauge's name; a counter's ends in `_total`)."""

    name: str
    per_replica: float

    def __post_init__(self) -> None:
        check_metric_name("MetricTarget", self.name)
        value = self.per_replica
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidError(f"MetricTarget(per_replica={value!r}) takes a number")
        if not (math.isfinite(value) and 0 < value <= 1e12):
            raise InvalidError(
                f"MetricTarget(per_replica={value!r}): a target above 0, what one replica "
                "should carry of the metric"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "per_replica": float(self.per_replica)}

    @classmethod
    def from_dict(cls, data: Any) -> MetricTarget:
        if not isinstance(data, dict) or set(data) != {"name", "per_replica"}:
            raise InvalidError(f"scale_on={data!r} is not MetricTarget's form")
        return cls(data["name"], data["per_replica"])
