"""The replica's scrape of its engine's metrics (`engine_metrics=`): every
`SCRAPE_SECONDS`, from this process's prometheus_client registry ("prometheus": an
in-process engine such as vLLM's AsyncLLM registers its metrics there) or from a URL on
the replica's loopback (an engine serving them from a subprocess), read inside the
replica's sandbox and sent on its channel as an `EngineMetrics` message.

The work stays bounded: the registry is read, and a fetched page parsed (with
prometheus_client's text parser), in one helper thread that the event loop waits for at
most `SCRAPE_TIMEOUT` seconds (a scrape still running skips the next); a page is at most
`MAX_BYTES`, a scrape at most `MAX_SERIES` samples (the rest are left out, said once).
prometheus_client is imported only here, when a scrape first runs: the engine's
environment has it (vLLM depends on it), and the SDK does not need it otherwise.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx

from ember.declarations import engine_metrics as limits
from ember.wire import messages as wire

Send = Callable[[wire.FromReplica, str], Awaitable[None]]  # a header and its body
KINDS = frozenset({"counter", "gauge", "histogram", "summary", "info", "unknown"})
# Samples of these suffixes are OpenMetrics' timestamps of a series' creation: not sent.
CREATED = "_created"


class ScrapeError(Exception):
    """Why a scrape gave nothing: sent to the control plane and said once in the log."""


def families_of(metrics: Iterable[Any]) -> tuple[list[wire.EngineFamily], str | None]:
    """prometheus_client's metric families as the wire carries them, within the limits;
    and what was left out, if anything (a name that is not Prometheus', or Ember's; a
    kind the text format has not; samples past `MAX_SERIES`; values not finite)."""
    families: list[wire.EngineFamily] = []
    left_out: list[str] = []
    budget = limits.MAX_SERIES
    for metric in metrics:
        name, kind = str(metric.name), str(metric.type)
        if kind not in KINDS or len(name) > limits.MAX_NAME or not limits.METRIC_NAME.match(name):
            left_out.append(f"{name[:60]} (a name or kind Ember cannot export)")
            continue
        if name.startswith(limits.RESERVED_PREFIX):
            left_out.append(f"{name} (names starting with {limits.RESERVED_PREFIX} are Ember's)")
            continue
        if len(families) >= limits.MAX_FAMILIES or budget <= 0:
            left_out.append(
                f"{name} and what follows (over {limits.MAX_FAMILIES} families or "
                f"{limits.MAX_SERIES} samples)"
            )
            break
        samples = []
        for sample in metric.samples:
            if sample.name == name + CREATED or not math.isfinite(sample.value):
                continue
            if len(sample.labels) > limits.MAX_LABELS or any(
                len(k) > limits.MAX_NAME for k in sample.labels
            ):
                continue
            if budget <= 0:
                left_out.append(f"{name}'s samples past the first {limits.MAX_SERIES}")
                break
            labels = {str(k): str(v)[: limits.MAX_LABEL_VALUE] for k, v in sample.labels.items()}
            samples.append(wire.EngineSample(sample.name, labels, float(sample.value)))
            budget -= 1
        if samples:
            text = str(metric.documentation or "")[: limits.MAX_HELP]
            families.append(wire.EngineFamily(name, kind, samples, text))
    return families, "; ".join(left_out[:5]) or None


def _prometheus_client() -> Any:
    try:
        import prometheus_client
        import prometheus_client.parser
    except ImportError:
        raise ScrapeError(
            "engine_metrics= needs prometheus_client in the replica's environment (add "
            "'prometheus-client' to requirements=)"
        ) from None
    return prometheus_client


def read_registry() -> tuple[list[wire.EngineFamily], str | None]:
    """This process's prometheus_client default registry, as its own exposition shows it;
    in prometheus_client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, which an engine
    with several server processes sets), what all the processes wrote, as theirs does."""
    client = _prometheus_client()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = client.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return families_of(registry.collect())
    return families_of(client.REGISTRY.collect())


def parse_page(text: str) -> tuple[list[wire.EngineFamily], str | None]:
    """A page of Prometheus' text format, parsed with prometheus_client's parser."""
    parser = _prometheus_client().parser
    try:
        return families_of(parser.text_string_to_metric_families(text))
    except ValueError as error:  # not the text format
        raise ScrapeError(f"the page is not Prometheus' text format: {error}") from None


async def fetch_page(client: httpx.AsyncClient, url: str) -> str:
    """The engine's metrics page, at most `MAX_BYTES`."""
    try:
        async with client.stream("GET", url, headers={"Accept": "text/plain"}) as response:
            if response.status_code != 200:
                raise ScrapeError(f"{url} answered {response.status_code}")
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limits.MAX_BYTES:
                    raise ScrapeError(f"{url} sent more than {limits.MAX_BYTES} bytes")
                chunks.append(chunk)
    except httpx.HTTPError as error:
        raise ScrapeError(f"{url}: {type(error).__name__}: {error}") from None
    return b"".join(chunks).decode("utf-8", errors="replace")


class EngineScraper:
    """Scrapes `source` ("prometheus" or a loopback URL) and sends what it finds."""

    def __init__(self, source: str, send: Send) -> None:
        self.source = source
        self.send = send
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ember-engine-metrics")
        self._running: Future[Any] | None = None  # a scrape's thread work still under way
        self._said: set[str] = set()

    async def run(self) -> None:
        """Every `SCRAPE_SECONDS` until cancelled (the first right away)."""
        client = None
        if self.source != limits.PROMETHEUS:
            # Loopback only, never through a proxy the environment names.
            client = httpx.AsyncClient(
                trust_env=False, timeout=limits.SCRAPE_TIMEOUT, follow_redirects=False
            )
        try:
            while True:
                await self.send(*await self.scrape(client))
                await asyncio.sleep(limits.SCRAPE_SECONDS)
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)
            if client is not None:
                await client.aclose()

    async def scrape(self, client: httpx.AsyncClient | None) -> tuple[wire.EngineMetrics, str]:
        """One scrape as its message: its header, and its body (the families)."""
        try:
            async with asyncio.timeout(limits.SCRAPE_TIMEOUT):
                if client is None:
                    families, left_out = await self._in_thread(read_registry)
                else:
                    page = await fetch_page(client, self.source)
                    families, left_out = await self._in_thread(parse_page, page)
        except ScrapeError as error:
            return self._failed(str(error))
        except TimeoutError:
            return self._failed(f"a scrape took over {limits.SCRAPE_TIMEOUT:g} s")
        except Exception as error:  # a collector of the engine's that raised
            return self._failed(f"{type(error).__name__}: {error}")
        if left_out:
            self._say(f"engine metrics left out: {left_out}")
        body = wire.engine_body(families)
        if len(body) > limits.MAX_WIRE_BYTES:
            return self._failed(f"a scrape of over {limits.MAX_WIRE_BYTES} bytes as JSON")
        return wire.EngineMetrics(), body

    async def _in_thread(self, work: Callable[..., Any], *args: Any) -> Any:
        if self._running is not None and not self._running.done():
            raise ScrapeError("the previous scrape has not finished")
        self._running = self._executor.submit(work, *args)
        return await asyncio.wrap_future(self._running)

    def _failed(self, reason: str) -> tuple[wire.EngineMetrics, str]:
        self._say(f"engine metrics ({self.source}): {reason}")
        return wire.EngineMetrics(error=reason[:500]), ""

    def _say(self, text: str) -> None:
        if text not in self._said and len(self._said) < 20:  # once each: every 2 s else
            self._said.add(text)
            print(f"ember: {text}", file=sys.stderr, flush=True)
