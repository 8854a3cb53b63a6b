"""The code's own metrics: `ember.Counter` and `ember.Gauge` in a replica, and how the
control plane exports what heartbeats report."""

from __future__ import annotations

import pytest

import ember
from ember import user_metrics
from ember_platform.observability.metrics import PlatformMetrics


def _series(name: str) -> list[dict]:
    return [row for row in user_metrics.snapshot() if row["name"] == name]


def test_counters_and_gauges_hold_their_series() -> None:
    served = ember.Counter("t_served", "Inputs served", ["model"])
    served.inc(model="a")
    served.inc(2.5, model="a")
    served.inc(model="b")
    assert served.value(model="a") == 3.5 and served.value(model="b") == 1.0
    used = ember.Gauge("t_used", "Share in use")
    used.set(0.5)
    used.inc(0.25)
    used.dec()
    assert used.value() == -0.25
    assert {(r["labels"]["model"], r["value"]) for r in _series("t_served")} == {
        ("a", 3.5),
        ("b", 1.0),
    }
    assert _series("t_used") == [
        {"name": "t_used", "kind": "gauge", "help": "Share in use", "labels": {}, "value": -0.25}
    ]
    # The same definition again (a module imported twice) is the same metric.
    assert ember.Counter("t_served", "Inputs served", ["model"]).value(model="a") == 3.5


def test_mistakes_are_said_at_once() -> None:
    for make, said in (
        (lambda: ember.Counter("Bad-Name"), "use 1-64 lower-case"),
        (lambda: ember.Counter("t_x", labels=["app"]), "the platform's"),
        (lambda: ember.Counter("t_x", labels=["a", "a"]), "each once"),
        (lambda: ember.Counter("t_x", labels=["1a"]), "not a label name"),
    ):
        with pytest.raises(ember.InvalidError, match=said):
            make()
    ember.Counter("t_kind", labels=["a"])
    with pytest.raises(ember.InvalidError, match="already a counter"):
        ember.Gauge("t_kind", labels=["a"])
    counter = ember.Counter("t_checked", labels=["model"])
    with pytest.raises(ember.InvalidError, match="takes the labels"):
        counter.inc()
    with pytest.raises(ember.InvalidError, match=">= 0"):
        counter.inc(-1, model="a")
    with pytest.raises(ember.InvalidError, match="set to a number"):
        ember.Gauge("t_gauge").set("high")  # type: ignore[arg-type]


def test_series_beyond_the_cap_are_dropped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(user_metrics, "MAX_SERIES", len(user_metrics._values) + 2)
    ids = ember.Counter("t_ids", labels=["request"])
    for index in range(5):
        ids.inc(request=str(index))
    assert len(_series("t_ids")) == 2
    assert capsys.readouterr().out.count("new label values are dropped") == 1


def _report(metrics: PlatformMetrics, replica: str, value: float, gauge: float | None) -> None:
    rows: list[object] = [
        {"name": "hits", "kind": "counter", "help": "Hits", "labels": {"m": "x"}, "value": value}
    ]
    if gauge is not None:
        rows.append({"name": "load", "kind": "gauge", "help": "Load", "labels": {}, "value": gauge})
    metrics.user.report(replica, "app", "ep", rows)


def _exported(metrics: PlatformMetrics) -> dict[str, str]:
    lines = metrics.exposition().decode().splitlines()
    return {
        line.rsplit(" ", 1)[0]: line.rsplit(" ", 1)[1]
        for line in lines
        if line.startswith("ember:user_")
    }


def test_counters_sum_replicas_and_outlive_them_and_gauges_go_with_theirs() -> None:
    metrics = PlatformMetrics()
    _report(metrics, "r-1", 3, 0.5)
    _report(metrics, "r-1", 5, 0.7)  # +2
    _report(metrics, "r-2", 4, 0.1)  # +4
    _report(metrics, "r-2", 1, None)  # a smaller total: a new count, +1
    exported = _exported(metrics)
    assert exported['ember:user_hits_total{app="app",endpoint="ep",m="x"}'] == "10.0"
    assert exported['ember:user_load{app="app",endpoint="ep",replica="r-1"}'] == "0.7"
    assert not any("r-2" in key for key in exported)  # its gauge is gone from its report
    metrics.forget_replica("r-1")
    exported = _exported(metrics)
    assert list(exported) == ['ember:user_hits_total{app="app",endpoint="ep",m="x"}']


def test_malformed_reports_and_a_name_of_two_kinds_are_skipped() -> None:
    metrics = PlatformMetrics()
    good = {"name": "ok", "kind": "counter", "help": "", "labels": {}, "value": 1}
    bad_rows = [
        "nonsense",
        {**good, "name": "Bad Name"},
        {**good, "kind": "histogram"},
        {**good, "value": float("nan")},
        {**good, "value": True},
        {**good, "labels": {"k": 1}},
        {**good, "kind": "gauge"},  # "ok" is a counter already
    ]
    metrics.user.report("r-1", "app", "ep", [good, *bad_rows])
    assert _exported(metrics) == {'ember:user_ok_total{app="app",endpoint="ep"}': "1.0"}


def test_a_name_whose_samples_another_family_takes_is_skipped() -> None:
    """Two families of one exported name would make a scrape fail for every app."""
    metrics = PlatformMetrics()
    hits = {"name": "hits", "kind": "counter", "help": "", "labels": {}, "value": 1}
    lat = {
        "name": "lat",
        "kind": "histogram",
        "help": "",
        "labels": {},
        "buckets": [1.0],
        "counts": [1, 1],
        "sum": 0.5,
    }
    clashing = [
        {**hits, "name": "hits_total", "kind": "gauge"},  # hits counts as hits_total
        {**hits, "name": "lat_count", "kind": "gauge"},  # the histogram's count
        {**hits, "name": "lat_sum"},
    ]
    metrics.user.report("r-1", "app", "ep", [hits, lat])
    metrics.user.report("r-2", "other", "ep", clashing)
    exposition = metrics.exposition().decode()
    for name in ("hits_total", "lat_count", "lat_sum"):
        assert exposition.count(f"# TYPE ember:user_{name} ") <= 1
    assert "ember:user_lat_sum_total" not in exposition
    assert not any(
        key.startswith('ember:user_hits_total{app="other"') for key in _exported(metrics)
    )


def test_a_histogram_counts_values_per_bucket() -> None:
    steps = ember.Histogram("t_steps", "Step seconds", ["phase"], buckets=[0.1, 1.0])
    for value in (0.05, 0.1, 0.5, 3.0):
        steps.observe(value, phase="decode")
    assert steps.value(phase="decode") == 4
    (row,) = _series("t_steps")
    assert row["buckets"] == [0.1, 1.0] and row["counts"] == [2, 3, 4]  # <=0.1, <=1, +Inf
    assert row["value"] == 4 and row["sum"] == pytest.approx(3.65)
    for buckets in ([], [1.0, 0.5], [1.0, 1.0], [float("inf")]):
        with pytest.raises(ember.InvalidError, match="bucket"):
            ember.Histogram("t_bad_buckets", buckets=buckets)
    with pytest.raises(ember.InvalidError, match="and buckets"):
        ember.Histogram("t_steps", "Step seconds", ["phase"], buckets=[0.2, 1.0])
    with pytest.raises(ember.InvalidError, match="observes numbers"):
        steps.observe(float("nan"), phase="decode")
    with pytest.raises(ember.InvalidError, match="the platform's"):
        ember.Histogram("t_le", labels=["le"])


def _histogram_row(counts: list[float], total: float, buckets: list[float] | None = None) -> dict:
    return {
        "name": "steps",
        "kind": "histogram",
        "help": "Steps",
        "labels": {},
        "value": counts[-1],
        "buckets": buckets or [0.1, 1.0],
        "counts": counts,
        "sum": total,
    }


def test_histograms_are_summed_over_replicas_as_counters_are() -> None:
    metrics = PlatformMetrics()
    metrics.user.report("r-1", "app", "ep", [_histogram_row([1, 2, 2], 0.6)])
    metrics.user.report("r-1", "app", "ep", [_histogram_row([1, 3, 4], 5.0)])  # +0, +1, +2
    metrics.user.report("r-2", "app", "ep", [_histogram_row([0, 1, 1], 0.5)])
    # Other buckets under a name in use: another shape, skipped.
    metrics.user.report("r-3", "app", "ep", [_histogram_row([1, 1, 1], 0.1, [0.5, 2.0])])
    metrics.forget_replica("r-1")  # what it counted stays
    exported = _exported(metrics)
    base = 'app="app",endpoint="ep"'
    assert exported == {
        f'ember:user_steps_bucket{{{base},le="0.1"}}': "1.0",
        f'ember:user_steps_bucket{{{base},le="1.0"}}': "4.0",
        f'ember:user_steps_bucket{{{base},le="+Inf"}}': "5.0",
        f"ember:user_steps_count{{{base}}}": "5.0",
        f"ember:user_steps_sum{{{base}}}": "5.5",
    }
    assert "# TYPE ember:user_steps histogram" in metrics.exposition().decode()


def test_series_of_another_workspace_name_it_apart() -> None:
    from ember_platform.observability.metrics import with_workspaces

    scraped = (
        b'ember:requests_total{app="team-a--shop",endpoint="greet",status="200"} 1.0\n'
        b'ember:requests_total{app="shop",endpoint="greet",status="200"} 2.0\n'
        b'ember:e2e_bucket{le="0.5",app="a-b--c-d",endpoint="e"} 3.0\n'
    )
    assert with_workspaces(scraped).splitlines() == [
        b'ember:requests_total{workspace="team-a",app="shop",endpoint="greet",status="200"} 1.0',
        b'ember:requests_total{app="shop",endpoint="greet",status="200"} 2.0',  # main's
        b'ember:e2e_bucket{le="0.5",workspace="a-b",app="c-d",endpoint="e"} 3.0',
    ]
