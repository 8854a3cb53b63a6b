"""What a run amounts to: throughput, latency distributions, goodput; as a dict or a table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ember.loadgen.records import RequestRecord
from ember.loadgen.slo import Slos
from ember.loadgen.stats import Summary, summarize

LATENCIES = ("ttft", "itl", "tpot", "e2e")
LATENCY_TITLES = {
    "ttft": "time to first token",
    "itl": "inter-token latency",
    "tpot": "time per output token",
    "e2e": "end-to-end latency",
}


@dataclass(frozen=True)
class Goodput:
    good: int
    requests_per_s: float
    share: float  # of all finished requests, failed ones included


def goodput(records: Sequence[RequestRecord], slos: Slos, duration: float) -> Goodput:
    good = sum(1 for record in records if slos.met_by(record))
    return Goodput(
        good=good,
        requests_per_s=good / duration if duration > 0 else 0.0,
        share=good / len(records) if records else 0.0,
    )


def latency_summaries(records: Sequence[RequestRecord]) -> dict[str, Summary | None]:
    """Over successful requests; ITL pools every gap of every request."""
    ok = [record for record in records if record.ok]
    return {
        "ttft": summarize([r.ttft for r in ok if r.ttft is not None]),
        "itl": summarize([gap for r in ok for gap in r.itls]),
        "tpot": summarize([r.tpot for r in ok if r.tpot is not None]),
        "e2e": summarize([r.e2e for r in ok if r.e2e is not None]),
    }


def build_report(
    records: Sequence[RequestRecord],
    *,
    duration: float,
    slos: Slos,
    interrupted: int = 0,
    first_errors: Sequence[str] = (),
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything machine-readable; latencies in seconds."""
    ok = [record for record in records if record.ok]
    tokens = sum(record.output_tokens for record in ok)
    report: dict[str, Any] = {
        "settings": settings or {},
        "requests": {
            "finished": len(records),
            "ok": len(ok),
            "failed": len(records) - len(ok),
            "interrupted": interrupted,
        },
        "streamed": any(record.streamed for record in ok),
        "duration_s": duration,
        "requests_per_s": len(ok) / duration if duration > 0 else 0.0,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration if duration > 0 else 0.0,
        "latency_s": {
            name: (summary.to_dict() if summary else None)
            for name, summary in latency_summaries(records).items()
        },
        "first_errors": list(first_errors),
    }
    if slos:
        good = goodput(records, slos, duration)
        report["goodput"] = {
            "slos_s": slos.to_dict(),
            "good_requests": good.good,
            "requests_per_s": good.requests_per_s,
            "share": good.share,
        }
    return report


def format_report(report: dict[str, Any]) -> str:
    """The human-readable table (milliseconds for latencies)."""
    counts = report["requests"]
    lines = [
        f"{'requests':<24}{counts['ok']} ok, {counts['failed']} failed"
        + (f", {counts['interrupted']} interrupted" if counts["interrupted"] else ""),
        f"{'duration':<24}{report['duration_s']:.2f} s",
        f"{'requests/s':<24}{report['requests_per_s']:.2f}",
        f"{'output tokens':<24}{report['output_tokens']}"
        + ("" if report["streamed"] else "  (not streamed: one per answer)"),
        f"{'output tokens/s':<24}{report['output_tokens_per_s']:.1f}",
    ]
    if "cost" in report:  # the server's prices: its replicas' cost over the run
        cost = report["cost"]
        per_million = cost["per_million_output_tokens"]
        said = "" if per_million is None else f" ({per_million:.4f} per million output tokens)"
        lines.append(f"{'cost':<24}{cost['cost']:.6f}{said}")
    if "goodput" in report:
        good = report["goodput"]
        slos = ", ".join(f"{name}<={_ms(bound)}ms" for name, bound in good["slos_s"].items())
        lines.append(
            f"{'goodput':<24}{good['requests_per_s']:.2f} req/s ({good['share']:.0%} met {slos})"
        )
    lines.append("")
    lines.append(f"{'latency (ms)':<30}{'mean':>9}{'P50':>9}{'P95':>9}{'P99':>9}")
    for name in LATENCIES:
        summary = report["latency_s"][name]
        title = f"{name.upper()} ({LATENCY_TITLES[name]})"
        if summary is None:
            lines.append(f"{title:<30}{'-':>9}{'-':>9}{'-':>9}{'-':>9}")
            continue
        values = "".join(f"{_ms(summary[key]):>9}" for key in ("mean", "p50", "p95", "p99"))
        lines.append(f"{title:<30}{values}")
    if report["first_errors"]:
        lines.append("")
        lines.append("first errors:")
        lines.extend(f"  {error}" for error in report["first_errors"])
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"
