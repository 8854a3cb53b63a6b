"""Latency over the run as a PNG: each request's TTFT and E2E against its send time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ember.errors import EmberError
from ember.loadgen.records import RequestRecord
from ember.loadgen.stats import percentile

ROLLING_WINDOW = 20  # requests per rolling percentile


class PlotUnavailableError(EmberError):
    """matplotlib is not installed."""


def rolling_percentile(values: Sequence[float], q: float, window: int) -> list[float]:
    """The q-th percentile of each value and up to `window - 1` values before it."""
    return [percentile(values[max(0, i - window + 1) : i + 1], q) for i in range(len(values))]


def plot_latencies(records: Sequence[RequestRecord], origin: float, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailableError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'ember[bench]')"
        ) from None
    ok = sorted((r for r in records if r.ok), key=lambda r: r.sent_at)
    sent = [r.sent_at - origin for r in ok]
    figure, axes = plt.subplots(2, 1, sharex=True, figsize=(10, 7))
    for axis, name in zip(axes, ("ttft", "e2e"), strict=True):
        values = [getattr(r, name) * 1000 for r in ok]
        axis.scatter(sent, values, s=8, alpha=0.4, label=f"{name.upper()} per request")
        if values:
            for q, style in ((50, "-"), (99, "--")):
                rolling = rolling_percentile(values, q, ROLLING_WINDOW)
                axis.plot(sent, rolling, style, label=f"rolling P{q} ({ROLLING_WINDOW} requests)")
        axis.set_ylabel(f"{name.upper()} (ms)")
        axis.grid(alpha=0.3)
        axis.legend(loc="upper left")
    axes[-1].set_xlabel("send time (s since the run started)")
    figure.suptitle("ember bench: latency over the run")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
