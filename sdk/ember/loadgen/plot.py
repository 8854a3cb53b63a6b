"""Latency over the run as a PNG: each request's TTFT and E2E against its send time."""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

from ember.errors import EmberError
from ember.loadgen.records import RequestRecord
from ember.loadgen.stats import percentile

ROLLING_WINDOW = 20  # requests per rolling percentile
PLOTTED = ("ttft", "e2e")


class PlotUnavailableError(EmberError):
    """matplotlib is not installed."""


def rolling_percentile(values: Sequence[float], q: float, window: int) -> list[float]:
    """The q-th percentile of each value and up to `window - 1` values before it."""
    return [percentile(values[max(0, i - window + 1) : i + 1], q) for i in range(len(values))]


@dataclass(frozen=True)
class Series:
    """One panel's points: send times (s since the run started) and latencies (ms)."""

    name: str
    sent: list[float]
    millis: list[float]


def latency_series(records: Sequence[RequestRecord], origin: float) -> list[Series]:
    """TTFT and E2E of each successful request, in send order. A request without a value
    (a stream that sent no event has no TTFT) is left out of that panel only."""
    ok = sorted((r for r in records if r.ok), key=lambda r: r.sent_at)
    panels = []
    for name in PLOTTED:
        points = [(r.sent_at - origin, getattr(r, name)) for r in ok]
        kept = [(sent, value * 1000) for sent, value in points if value is not None]
        panels.append(Series(name, [sent for sent, _ in kept], [ms for _, ms in kept]))
    return panels


def plot_latencies(records: Sequence[RequestRecord], origin: float) -> bytes:
    """The PNG; the caller writes it, having opened its path before the run."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailableError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'ember[bench]')"
        ) from None
    figure, axes = plt.subplots(2, 1, sharex=True, figsize=(10, 7))
    for axis, series in zip(axes, latency_series(records, origin), strict=True):
        title = series.name.upper()
        axis.scatter(series.sent, series.millis, s=8, alpha=0.4, label=f"{title} per request")
        if series.millis:
            for q, style in ((50, "-"), (99, "--")):
                rolling = rolling_percentile(series.millis, q, ROLLING_WINDOW)
                label = f"rolling P{q} ({ROLLING_WINDOW} requests)"
                axis.plot(series.sent, rolling, style, label=label)
        axis.set_ylabel(f"{title} (ms)")
        axis.grid(alpha=0.3)
        axis.legend(loc="upper left")
    axes[-1].set_xlabel("send time (s since the run started)")
    figure.suptitle("ember bench: latency over the run")
    figure.tight_layout()
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=120)
    plt.close(figure)
    return png.getvalue()
