"""Cron expressions and periods: parsing, errors, and the next due time (time zones
and clock changes included); what `@ember.endpoint(schedule=...)` accepts."""

from __future__ import annotations

import datetime as dt
import re
from zoneinfo import ZoneInfo

import pytest

import ember
from ember.declarations.schedules import (
    Cron,
    CronExpression,
    Period,
    format_seconds,
    parse_field,
    schedule_from_dict,
)
from ember.errors import InvalidError

UTC = dt.UTC
PARIS = ZoneInfo("Europe/Paris")


def at(*parts: int, zone: dt.tzinfo = UTC) -> float:
    return dt.datetime(*parts, tzinfo=zone).timestamp()


def wall(timestamp: float | None, zone: dt.tzinfo = UTC) -> str:
    assert timestamp is not None
    return dt.datetime.fromtimestamp(timestamp, zone).strftime("%Y-%m-%d %a %H:%M%z")


def following(expression: str, after: float, count: int, timezone: str = "UTC") -> list[str]:
    cron, times = Cron(expression, timezone), []
    zone = ZoneInfo(timezone)
    for _ in range(count):
        after = cron.next_after(after, 0.0)
        times.append(wall(after, zone))
    return times


@pytest.mark.parametrize(
    ("text", "low", "high", "values"),
    [
        ("*", 0, 5, {0, 1, 2, 3, 4, 5}),
        ("*/2", 0, 5, {0, 2, 4}),
        ("1-4", 0, 5, {1, 2, 3, 4}),
        ("1-5/2", 0, 5, {1, 3, 5}),
        ("3/2", 0, 9, {3, 5, 7, 9}),
        ("1,4,2-3", 0, 5, {1, 2, 3, 4}),
    ],
)
def test_fields(text: str, low: int, high: int, values: set[int]) -> None:
    assert parse_field(text, low, high).values == values


def test_names_of_months_and_weekdays_and_sunday_as_seven() -> None:
    parsed = CronExpression.parse("0 0 * jan,Mar-apr mon-fri,7")
    assert parsed.months.values == {1, 3, 4}
    assert parsed.weekdays.values == {0, 1, 2, 3, 4, 5}


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("* * * *", "4 fields"),
        ("60 * * * *", "minute field '60': 60 is outside 0-59"),
        ("* 24 * * *", "hour field"),
        ("* * 0 * *", "day-of-month field"),
        ("* * * 13 *", "month field"),
        ("* * * * 8", "day-of-week field"),
        ("*/0 * * * *", "step '0'"),
        ("5-1 * * * *", "runs backwards"),
        ("x * * * *", "'x' is not a number"),
        ("0 0 30 2 *", "never run"),
    ],
)
def test_bad_expressions_say_what_is_wrong(expression: str, problem: str) -> None:
    with pytest.raises(InvalidError, match=re.escape(problem)):
        Cron(expression)


def test_an_unknown_time_zone_is_refused() -> None:
    with pytest.raises(InvalidError, match="IANA"):
        Cron("0 * * * *", timezone="Mars/Olympus")


def test_next_times() -> None:
    start = at(2026, 11, 30, 3, 7)  # a Monday
    assert following("*/15 * * * *", start, 3) == [
        "2026-11-30 Mon 03:15+0000",
        "2026-11-30 Mon 03:30+0000",
        "2026-11-30 Mon 03:45+0000",
    ]
    assert following("0 9 * * mon-fri", start, 2) == [
        "2026-11-30 Mon 09:00+0000",
        "2026-12-01 Tue 09:00+0000",
    ]
    assert following("@monthly", start, 2) == [
        "2026-12-01 Tue 00:00+0000",
        "2027-01-01 Fri 00:00+0000",
    ]
    # Strictly after: a due time is not due again.
    assert following("7 3 * * *", start, 1) == ["2026-12-01 Tue 03:07+0000"]


def test_day_of_month_and_day_of_week_together_mean_either() -> None:
    # The 13th, or any Friday: cron's rule when both fields are restricted.
    assert following("0 0 13 * fri", at(2026, 11, 1), 3) == [
        "2026-11-06 Fri 00:00+0000",
        "2026-11-13 Fri 00:00+0000",
        "2026-11-20 Fri 00:00+0000",
    ]
    # With '*' in one of them, only the other counts.
    assert following("0 0 */10 * *", at(2026, 11, 2), 2) == [
        "2026-11-11 Wed 00:00+0000",
        "2026-11-21 Sat 00:00+0000",
    ]


def test_february_29th_is_found_years_ahead() -> None:
    assert following("0 12 29 2 *", at(2026, 11, 30), 1) == ["2028-02-29 Tue 12:00+0000"]


def test_a_time_zone_and_its_clock_changes() -> None:
    # Paris springs forward on 2027-03-28 at 02:00: 02:30 does not exist that day, and
    # runs an hour later by the clock; other days it is 02:30 local.
    assert following("30 2 * * *", at(2027, 3, 27, 12), 2, "Europe/Paris") == [
        "2027-03-28 Sun 03:30+0200",
        "2027-03-29 Mon 02:30+0200",
    ]
    # It falls back on 2027-10-31: 02:30 happens twice and runs once.
    assert following("30 2 * * *", at(2027, 10, 30, 12), 2, "Europe/Paris") == [
        "2027-10-31 Sun 02:30+0200",
        "2027-11-01 Mon 02:30+0100",
    ]


def test_periods_count_from_their_anchor() -> None:
    period = Period(minutes=1, seconds=30)
    assert period.seconds == 90.0
    assert period.next_after(1000.0, 1000.0) == 1090.0
    assert period.next_after(1090.0, 1000.0) == 1180.0  # strictly after
    assert period.next_after(1100.0, 1000.0) == 1180.0
    assert period.next_after(500.0, 1000.0) == 1090.0  # never before its first due time
    assert str(period) == "every 1m30s" and str(Period(hours=2)) == "every 2h"
    with pytest.raises(InvalidError, match="out of range"):
        Period(seconds=0.5)
    with pytest.raises(InvalidError, match="out of range"):
        Period(days=400)


def test_schedules_go_through_the_manifest_and_back() -> None:
    cron = Cron("0 3 * * *", "Europe/Paris")
    assert schedule_from_dict(cron.to_dict()) == cron
    assert schedule_from_dict(Period(hours=1).to_dict()) == Period(hours=1)
    with pytest.raises(InvalidError, match="neither"):
        schedule_from_dict({"at": "noon"})
    assert format_seconds(1.5) == "1.5s" and format_seconds(86_400 + 60) == "1d1m"


def test_the_decorator_takes_a_schedule_for_functions_without_required_arguments() -> None:
    @ember.endpoint(schedule=ember.Cron("@hourly"))
    def nightly(limit: int = 10) -> dict:
        return {}

    assert nightly.settings.schedule == {"cron": "@hourly", "timezone": "UTC"}
    with pytest.raises(InvalidError, match="needs a default"):

        @ember.endpoint(schedule=ember.Period(minutes=5))
        def needs_input(path: str) -> dict:
            return {}

    with pytest.raises(InvalidError, match="function endpoint"):

        @ember.endpoint(schedule=ember.Period(minutes=5))
        class Model:
            pass

    with pytest.raises(InvalidError, match="cannot stream"):

        @ember.endpoint(schedule=ember.Period(minutes=5))
        def streams():  # type: ignore[no-untyped-def]
            yield 1

    with pytest.raises(InvalidError, match=r"ember\.Cron"):
        ember.endpoint(schedule="0 * * * *")  # type: ignore[arg-type]
