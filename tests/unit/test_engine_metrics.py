"""Engine metrics from a replica to Ember's /metrics: the replica's scrape (its process's
prometheus_client registry, or a page on loopback parsed with prometheus_client's
parser, within the limits) and the control plane's export (labels added, checked again,
names that would break the scrape dropped, stale and gone replicas left out)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ember.declarations import engine_metrics as limits
from ember.wire import messages as wire
from ember_platform.observability.engine_metrics import STALE_SECONDS, EngineMetrics
from ember_platform.observability.metrics import PlatformMetrics
from ember_worker.replica import engine_scrape
from ember_worker.replica.engine_scrape import EngineScraper, families_of, parse_page


def engine_registry() -> CollectorRegistry:
    """What a vLLM-like engine registers: a gauge, a counter, a histogram."""
    registry = CollectorRegistry()
    waiting = Gauge(
        "vllm:num_requests_waiting", "Requests waiting", ["model_name"], registry=registry
    )
    waiting.labels("smol").set(3)
    hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits", ["model_name"], registry=registry)
    hits.labels("smol").inc(7)
    ttft = Histogram(
        "vllm:time_to_first_token_seconds",
        "TTFT",
        ["model_name"],
        buckets=(0.1, 1.0),
        registry=registry,
    )
    ttft.labels("smol").observe(0.05)
    return registry


def scraped(registry: CollectorRegistry) -> tuple[wire.EngineMetrics, str]:
    families, left_out = families_of(registry.collect())
    assert left_out is None
    # Through the wire and back, as the control plane decodes it.
    header, body = wire.from_replica(wire.frame(wire.EngineMetrics(), wire.engine_body(families)))
    assert isinstance(header, wire.EngineMetrics)
    return header, body


def sent(*families: wire.EngineFamily) -> tuple[wire.EngineMetrics, str]:
    return wire.EngineMetrics(), wire.engine_body(list(families))


def exposition(engine: EngineMetrics) -> dict[str, float]:
    # After the platform's own, as /metrics serves them: the whole text parses.
    text = (PlatformMetrics().exposition() + engine.exposition()).decode()
    found = {}
    for family in text_string_to_metric_families(text):  # the scrape parses whole
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}"] = sample.value
    return found


def test_a_replica_s_registry_is_exported_with_its_labels() -> None:
    engine = EngineMetrics(alive=lambda replica: True)
    engine.report("r-1", "main-app", "generate", *scraped(engine_registry()))
    engine.report("r-2", "team-a--shop", "generate", *scraped(engine_registry()))
    found = exposition(engine)
    labels = "app=main-app,endpoint=generate,model_name=smol,replica=r-1"
    assert found[f"vllm:num_requests_waiting{{{labels}}}"] == 3.0
    assert found[f"vllm:prefix_cache_hits_total{{{labels}}}"] == 7.0
    bucket = "app=main-app,endpoint=generate,le=0.1,model_name=smol,replica=r-1"
    assert found[f"vllm:time_to_first_token_seconds_bucket{{{bucket}}}"] == 1.0
    assert found[f"vllm:time_to_first_token_seconds_count{{{labels}}}"] == 1.0
    # Another workspace's app: its workspace and its own name, as the platform's metrics.
    other = "app=shop,endpoint=generate,model_name=smol,replica=r-2,workspace=team-a"
    assert found[f"vllm:num_requests_waiting{{{other}}}"] == 3.0
    assert not any("_created" in name for name in found)
    assert engine.value("r-1", "vllm:num_requests_waiting") == 3.0
    assert engine.value("r-1", "vllm:prefix_cache_hits_total") == 7.0
    assert engine.value("r-1", "vllm:num_requests_running") is None


def test_stale_failed_and_gone_replicas_are_left_out() -> None:
    now = [1000.0]
    alive = {"r-1", "r-2", "r-3"}
    engine = EngineMetrics(alive=lambda replica: replica in alive, clock=lambda: now[0])
    for replica in sorted(alive):
        engine.report(replica, "app", "generate", *scraped(engine_registry()))
    now[0] += 0.5  # sooner than a replica scrapes: not even read
    engine.report("r-1", "app", "generate", wire.EngineMetrics(error="connection refused"), "")
    now[0] += 1.0
    engine.report("r-2", "app", "generate", wire.EngineMetrics(error="connection refused"), "")
    alive.discard("r-3")
    assert engine.value("r-1", "vllm:num_requests_waiting") == 3.0
    assert engine.value("r-2", "vllm:num_requests_waiting") is None
    assert engine.value("r-3", "vllm:num_requests_waiting") is None
    replicas = {key.split("replica=")[1].rstrip("}") for key in exposition(engine)}
    assert replicas == {"r-1"}
    now[0] += STALE_SECONDS + 1
    assert engine.value("r-1", "vllm:num_requests_waiting") is None
    assert exposition(engine) == {}


def family(name: str, kind: str, *samples: tuple[str, dict[str, str], float]) -> wire.EngineFamily:
    return wire.EngineFamily(name, kind, [wire.EngineSample(*s) for s in samples], "help")


def test_what_would_break_the_scrape_or_take_ember_s_names_is_dropped() -> None:
    engine = EngineMetrics(alive=lambda replica: True)
    hostile = sent(
        *[
            family("ember:num_requests_waiting", "gauge", ("ember:num_requests_waiting", {}, 1)),
            family("ember:user_hits", "counter", ("ember:user_hits_total", {}, 1)),
            family("not a name", "gauge", ("not a name", {}, 1)),
            family("odd", "stateset", ("odd", {}, 1)),
            family("foreign", "gauge", ("other_name", {}, 1)),  # not its own sample
            family("bad_label", "gauge", ("bad_label", {"__name__": "x"}, 1)),
            family("hits", "counter", ("hits_total", {}, 2)),
            family("hits_total", "gauge", ("hits_total", {}, 5)),  # hits' exported name
            family("dup", "gauge", ("dup", {"a": "1"}, 1), ("dup", {"a": "1"}, 9)),
            family("platform", "gauge", ("platform", {"app": "x", "replica": "y"}, 4)),
            family("twice", "gauge", ("twice", {"app": "x", "exported_app": "y"}, 4)),
        ]
    )
    engine.report("r-1", "app", "ep", *hostile)
    # Another engine's family of a name already taken with another kind.
    engine.report("r-2", "app", "ep", *sent(family("dup", "counter", ("dup_total", {}, 1))))
    with pytest.raises(wire.WireError, match="at most"):
        engine.report("r-3", "app", "ep", wire.EngineMetrics(), " " * (limits.MAX_WIRE_BYTES + 1))
    with pytest.raises(wire.WireError):
        engine.report("r-4", "app", "ep", wire.EngineMetrics(), '[{"name": 3}]')
    infinite = '[{"name": "inf", "type": "gauge", "samples": [["inf", {}, 1e999]]}]'
    with pytest.raises(wire.WireError, match="out of range"):
        engine.report("r-5", "app", "ep", wire.EngineMetrics(), infinite)
    found = exposition(engine)
    assert not any(name.startswith("ember:") and "r-1" in name for name in found)
    base = "endpoint=ep,replica=r-1"
    assert found == {
        f"hits_total{{app=app,{base}}}": 2.0,
        f"dup{{a=1,app=app,{base}}}": 1.0,
        "platform{app=app,endpoint=ep,exported_app=x,exported_replica=y,replica=r-1}": 4.0,
    }


def test_a_replica_sends_at_most_max_series_samples() -> None:
    registry = CollectorRegistry()
    wide = Gauge("wide", "Too many series", ["i"], registry=registry)
    for i in range(limits.MAX_SERIES + 10):
        wide.labels(str(i)).set(1)
    Gauge("after", "Left out too", registry=registry).set(1)
    families, left_out = families_of(registry.collect())
    assert sum(len(f.samples) for f in families) == limits.MAX_SERIES
    assert left_out is not None and "wide" in left_out and "after" in left_out
    engine = EngineMetrics(alive=lambda replica: True)
    engine.report("r-1", "app", "ep", *sent(*families))
    assert engine.value("r-1", "wide") == limits.MAX_SERIES


def test_a_replica_leaves_out_ember_s_names_and_odd_values() -> None:
    registry = CollectorRegistry()
    Gauge("ember:num_requests_waiting", "Not the engine's", registry=registry).set(1)
    Gauge("nan_gauge", "Not a number", registry=registry).set(float("nan"))
    Gauge("fine", "Kept", registry=registry).set(2)
    families, left_out = families_of(registry.collect())
    assert [(f.name, [s.value for s in f.samples]) for f in families] == [("fine", [2.0])]
    assert left_out is not None and "ember:num_requests_waiting" in left_out


def test_a_page_is_parsed_with_prometheus_client_s_parser() -> None:
    text = generate_latest(engine_registry()).decode()
    families, _ = parse_page(text)
    names = {sample.name for f in families for sample in f.samples}
    assert names >= {"vllm:num_requests_waiting", "vllm:prefix_cache_hits_total"}
    with pytest.raises(engine_scrape.ScrapeError, match="text format"):
        parse_page('vllm:num_requests_waiting{model_name="smol" 3\n')


@contextlib.asynccontextmanager
async def page_server(body: bytes, status: int = 200) -> AsyncIterator[str]:
    """A metrics page on loopback, as an engine's own server gives it."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        head = f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        writer.write(head.encode() + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}/metrics"


def test_a_url_is_fetched_within_its_limits() -> None:
    async def scenario() -> list[tuple[wire.EngineMetrics, str]]:
        async def send(message: wire.FromReplica, body: str) -> None:
            raise AssertionError("scrape() only returns what run() sends")

        found = []
        async with httpx.AsyncClient(trust_env=False) as client:
            async with page_server(generate_latest(engine_registry())) as url:
                found.append(await EngineScraper(url, send).scrape(client))
            async with page_server(b"x" * (limits.MAX_BYTES + 1)) as url:
                found.append(await EngineScraper(url, send).scrape(client))
            async with page_server(b"gone", status=404) as url:
                found.append(await EngineScraper(url, send).scrape(client))
            found.append(await EngineScraper(url, send).scrape(client))  # nothing listens
        return found

    (good, body), (too_big, _), (not_found, _), (refused, _) = asyncio.run(scenario())
    assert good.error is None
    assert {f.name for f in wire.engine_families(body)} >= {"vllm:num_requests_waiting"}
    assert too_big.error is not None and f"more than {limits.MAX_BYTES} bytes" in too_big.error
    assert not_found.error is not None and "answered 404" in not_found.error
    assert refused.error is not None and "ConnectError" in refused.error


def test_the_process_registry_is_scraped_every_round_until_cancelled() -> None:
    gauge = Gauge("engine_metrics_test_waiting", "In the default registry")
    gauge.set(5)

    async def scenario() -> list[str]:
        bodies: list[str] = []

        async def send(message: wire.FromReplica, body: str) -> None:
            assert message == wire.EngineMetrics()
            bodies.append(body)

        task = asyncio.ensure_future(EngineScraper(limits.PROMETHEUS, send).run())
        while not bodies:
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return bodies

    try:
        (first,) = asyncio.run(scenario())
    finally:
        from prometheus_client import REGISTRY

        REGISTRY.unregister(gauge)
    values = {s.name: s.value for f in wire.engine_families(first) for s in f.samples}
    assert values["engine_metrics_test_waiting"] == 5.0


def test_in_multiprocess_mode_every_process_s_values_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An engine's server process writes its values where PROMETHEUS_MULTIPROC_DIR says.
    writer = (
        "from prometheus_client import Counter\n"
        "Counter('served_by_child', 'Requests another process served').inc(4)\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", writer], env=env, check=True, timeout=60)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    families, _ = engine_scrape.read_registry()
    values = {s.name: s.value for f in families for s in f.samples}
    assert values["served_by_child_total"] == 4.0
