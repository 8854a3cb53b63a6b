"""Engine metrics (`engine_metrics=`) through a real platform: each replica's scrape in
Ember's /metrics with its labels, and an endpoint scaled on one of them
(`scale_on=ember.MetricTarget`) beyond what its queue asks and kept there while its idle
replica's scale-down window passes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from harness import Platform, wait_for
from prometheus_client.parser import text_string_to_metric_families

import ember

APP = "engines"


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> dict[str, str]:
    return platform.deploy(apps_dir / "engines.py", APP)


def scraped(platform: Platform, name: str) -> dict[str, dict[str, str]]:
    """The samples named `name` in Ember's /metrics: replica -> labels (with the value)."""
    with platform.client() as client:
        text = client.get("/metrics").text
    found = {}
    for family in text_string_to_metric_families(text):  # the whole scrape parses
        for sample in family.samples:
            if sample.name == name:
                found[sample.labels["replica"]] = {**sample.labels, "value": str(sample.value)}
    return found


def replicas(platform: Platform, label: str) -> dict[str, int]:
    return platform.endpoint_status(label)["replicas"]


def test_an_endpoint_scales_on_its_engine_s_gauge_and_exports_it(
    platform: Platform, deployed: dict[str, str]
) -> None:
    label = f"{APP}--waiting"
    waiting = ember.Endpoint.lookup(APP, "waiting", config=platform.config())
    # One replica (min_replicas=1); after one call its engine holds 3 waiting: at 2 per
    # replica, a second replica, though nothing is queued or running.
    waiting.call(count=3)
    assert wait_for(lambda: replicas(platform, label) == {"ready": 2}, 60)
    samples = wait_for(lambda: scraped(platform, "fake_engine:num_requests_waiting"), 10)
    (replica, labels) = next(iter(samples.items()))
    assert labels == {
        "app": APP,
        "endpoint": "waiting",
        "model_name": "tiny",
        "replica": replica,
        "value": "3.0",
    }
    counted = scraped(platform, "fake_engine:requests_total")
    assert counted[replica]["value"] == "1.0"
    # The second idle past the 1 s scale-down window: the engine's gauge keeps it.
    time.sleep(2.0)
    assert replicas(platform, label) == {"ready": 2}


def test_an_engine_s_metrics_page_on_loopback_is_fetched_by_its_replica(
    platform: Platform, deployed: dict[str, str]
) -> None:
    served = ember.Endpoint.lookup(APP, "served", config=platform.config()).method("generate")
    assert served.call(tokens=5) == 5
    samples = wait_for(lambda: scraped(platform, "fake_server:generation_tokens_total"), 10)
    ((replica, labels),) = samples.items()
    assert replica.startswith("r-")
    assert (labels["app"], labels["endpoint"], labels["value"]) == (APP, "served", "5.0")


def test_prefix_routing_passes_over_a_replica_whose_engine_has_requests_waiting(
    platform: Platform, deployed: dict[str, str]
) -> None:
    """A conversation's turns go to the replica that served its last turn, until that
    replica's engine says requests wait in its own queue (vllm:num_requests_waiting, by
    its scrape): then to the other, though neither runs an input."""
    label = f"{APP}--chat"
    chat = ember.Endpoint.lookup(APP, "chat", config=platform.config())
    assert wait_for(lambda: replicas(platform, label) == {"ready": 2}, 60)
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    turns = [system, {"role": "user", "content": "first question"}]
    first = chat.call(messages=turns)
    turns += [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "more"}]
    assert chat.call(messages=turns) == first  # its cached prefix
    # The same replica again; its engine now queues 3 requests of its own.
    turns += [{"role": "assistant", "content": "another"}, {"role": "user", "content": "and?"}]
    assert chat.call(messages=turns, waiting=3.0) == first
    holders = {
        labels["me"]: replica
        for replica, labels in wait_for(lambda: scraped(platform, "fake_chat:identity"), 10).items()
    }

    def queued() -> bool:
        samples = scraped(platform, "vllm:num_requests_waiting")
        return samples.get(holders[first], {}).get("value") == "3.0"

    assert wait_for(queued, 20)
    busy_before = routed(platform, label, "busy")
    turns += [{"role": "assistant", "content": "so"}, {"role": "user", "content": "then?"}]
    other = chat.call(messages=turns)
    assert other != first and other in holders
    assert routed(platform, label, "busy") == busy_before + 1


def routed(platform: Platform, label: str, placement: str) -> float:
    """ember:prefix_routed_total for the endpoint and placement, in Ember's /metrics."""
    app, endpoint = label.split("--")
    with platform.client() as client:
        text = client.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "ember:prefix_routed_total"
                and sample.labels.get("endpoint") == endpoint
                and sample.labels.get("app") == app
                and sample.labels.get("placement") == placement
            ):
                return sample.value
    return 0.0
