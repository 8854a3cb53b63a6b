"""`engine_metrics=` and `scale_on=ember.MetricTarget(...)` on `@ember.endpoint`: what is
taken, what is refused and how the settings travel in a spec."""

from __future__ import annotations

import math

import pytest

import ember
from ember.declarations.settings import EndpointSettings
from ember.wire.spec import EndpointSpec


def test_declared_settings_travel_in_the_spec() -> None:
    @ember.endpoint(
        engine_metrics="prometheus",
        scale_on=ember.MetricTarget("vllm:num_requests_waiting", per_replica=4),
    )
    def generate() -> int:
        return 1

    settings = generate.settings
    assert settings.engine_metrics == "prometheus"
    assert settings.metric_target == ember.MetricTarget("vllm:num_requests_waiting", 4.0)
    spec = EndpointSpec.from_dict(generate.spec("generate").to_dict())
    assert spec.settings == settings
    assert spec.settings.metric_target is not None
    assert spec.settings.metric_target.per_replica == 4.0


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000/metrics",
        "http://localhost:9400/metrics",
        "http://[::1]:8000/metrics",
        "http://127.0.0.2/metrics",
    ],
)
def test_loopback_urls_are_taken(url: str) -> None:
    assert EndpointSettings(engine_metrics=url).engine_metrics == url


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://10.0.0.5:8000/metrics", "not loopback"),
        ("http://example.com/metrics", "not loopback"),
        ("http://169.254.169.254/latest/meta-data", "not loopback"),
        ("http://127.0.0.1.example.com/metrics", "not loopback"),
        ("https://127.0.0.1:8000/metrics", "loopback"),
        ("file:///etc/passwd", "loopback"),
        ("http://user:pw@127.0.0.1/metrics", "loopback"),
        ("http://127.0.0.1:99999/metrics", "loopback"),
        ("prometheus_client", "loopback"),
        (3, "loopback"),
    ],
)
def test_other_sources_are_refused(url: object, says: str) -> None:
    with pytest.raises(ember.InvalidError, match=says):
        EndpointSettings(engine_metrics=url)  # type: ignore[arg-type]


def test_scale_on_needs_engine_metrics() -> None:
    with pytest.raises(ember.InvalidError, match="set engine_metrics"):
        ember.endpoint(scale_on=ember.MetricTarget("queue_depth", per_replica=2.0))


def test_scale_on_takes_a_metric_target_only() -> None:
    with pytest.raises(ember.InvalidError, match="MetricTarget"):
        ember.endpoint(engine_metrics="prometheus", scale_on="vllm:num_requests_waiting")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "per_replica", "says"),
    [
        ("ember:num_requests_waiting", 1.0, "Ember's"),
        ("9lives", 1.0, "not a Prometheus metric name"),
        ("has space", 1.0, "not a Prometheus metric name"),
        ("x" * 201, 1.0, "not a Prometheus metric name"),
        ("waiting", 0, "above 0"),
        ("waiting", -1.0, "above 0"),
        ("waiting", math.inf, "above 0"),
        ("waiting", math.nan, "above 0"),
        ("waiting", True, "takes a number"),
        ("waiting", "4", "takes a number"),
    ],
)
def test_metric_targets_are_checked(name: str, per_replica: object, says: str) -> None:
    with pytest.raises(ember.InvalidError, match=says):
        ember.MetricTarget(name, per_replica=per_replica)  # type: ignore[arg-type]


def test_a_spec_with_a_malformed_target_is_refused() -> None:
    with pytest.raises(ember.InvalidError, match="MetricTarget's form"):
        EndpointSettings(engine_metrics="prometheus", scale_on={"name": "waiting"})
