"""Which failed exports of spans are sent again: against a real OTLP/HTTP server on
loopback that answers as it is told to."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from ember.calling.tracing import TraceContext
from ember_platform.calls.spans import SpanExporter
from ember_platform.observability.request_stats import RequestStats


class Collector:
    """Answers each export with `status` after `delay` s, and keeps the span ids of every
    export it read, answered in time or not."""

    def __init__(self) -> None:
        self.status = 200
        self.delay = 0.0
        self.received: list[list[str]] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                spans = body["resourceSpans"][0]["scopeSpans"][0]["spans"]
                collector.received.append([span["spanId"] for span in spans])
                time.sleep(collector.delay)
                answer = b'{"error": "no"}' if collector.status >= 400 else b"{}"
                self.send_response(collector.status)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def collector() -> Iterator[Collector]:
    running = Collector()
    yield running
    running.server.shutdown()
    running.server.server_close()


def _stats(span_id: str) -> RequestStats:
    stats = RequestStats("req-1", "app", "echo", "__call__", False, arrived=100.0)
    stats.trace = TraceContext("4bf92f3577b34da6a3ce929d0e0e4736", span_id, None, "01")
    stats.finish(200, "r-1", 0.05)
    stats.ended = 100.5
    return stats


async def _exports(collector: Collector, script: list[tuple[int, float]]) -> list[list[str]]:
    """One span recorded and one flush for each (status, delay) of `script`."""
    exporter = SpanExporter(collector.url, send_timeout=0.5)
    exporter.start()
    try:
        for n, (status, delay) in enumerate(script):
            collector.status, collector.delay = status, delay
            exporter.record(_stats(f"{n:016x}"))
            await exporter.flush()
    finally:
        collector.status, collector.delay = 200, 0.0
        await exporter.close()
    return collector.received


def test_a_refused_batch_is_dropped_not_sent_again(collector: Collector) -> None:
    received = asyncio.run(_exports(collector, [(400, 0.0), (200, 0.0)]))
    assert received == [["0000000000000000"], ["0000000000000001"]]


def test_an_unavailable_collector_gets_the_batch_again(collector: Collector) -> None:
    received = asyncio.run(_exports(collector, [(503, 0.0), (429, 0.0), (200, 0.0)]))
    first, second = "0000000000000000", "0000000000000001"
    assert received == [[first], [first, second], [first, second, "0000000000000002"]]


def test_a_slow_collector_is_not_sent_its_spans_twice(collector: Collector) -> None:
    received = asyncio.run(_exports(collector, [(200, 1.0), (200, 0.0)]))
    assert received == [["0000000000000000"], ["0000000000000001"]]
