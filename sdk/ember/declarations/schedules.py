"""Schedules for `@ember.endpoint(schedule=...)`: `Cron` (5-field cron in a time zone) and
`Period` (a fixed interval from the deployment), and when each fires next."""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ember.errors import InvalidError

MONTH_NAMES = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
WEEKDAY_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
# Days searched for the next match: more than the 8 years between two February 29ths
# that fall on a given weekday is not needed; an expression that matches no day in
# this span never fires (e.g. "0 0 30 2 *").
SEARCH_DAYS = 366 * 8
SHORTEST_PERIOD_S = 1.0
LONGEST_PERIOD_S = 366 * 86_400.0


@dataclass(frozen=True)
class CronField:
    """One field: the values it allows, and whether it was written as '*...' (cron
    then ignores a '*' day-of-month or day-of-week field when the other one is set)."""

    values: frozenset[int]
    star: bool


def parse_field(text: str, low: int, high: int, names: tuple[str, ...] = ()) -> CronField:
    """'*', 'N', 'N-M', any of these with '/STEP', and comma lists; names as values."""

    def value(token: str) -> int:
        lowered = token.lower()
        if lowered in names:
            return names.index(lowered) + (low if names is MONTH_NAMES else 0)
        if not token.isdigit():
            raise ValueError(f"{token!r} is not a number")
        number = int(token)
        if not low <= number <= high:
            raise ValueError(f"{number} is outside {low}-{high}")
        return number

    values: set[int] = set()
    for item in text.split(","):
        span, slash, step_text = item.partition("/")
        step = 1
        if slash:
            if not step_text.isdigit() or int(step_text) == 0:
                raise ValueError(f"step {step_text!r} must be a whole number above 0")
            step = int(step_text)
        if span == "*":
            first, last = low, high
        elif "-" in span:
            start, _, end = span.partition("-")
            first, last = value(start), value(end)
            if first > last:
                raise ValueError(f"range {span!r} runs backwards")
        else:
            first = value(span)
            last = high if slash else first
        values.update(range(first, last + 1, step))
    return CronField(frozenset(values), text.startswith("*"))


@dataclass(frozen=True)
class CronExpression:
    minutes: CronField
    hours: CronField
    days: CronField
    months: CronField
    weekdays: CronField  # 0 = Sunday

    @classmethod
    def parse(cls, expression: str) -> CronExpression:
        text = MACROS.get(expression.strip().lower(), expression)
        fields = text.split()
        if len(fields) != 5:
            raise ValueError(
                f"it has {len(fields)} fields; cron has 5: minute hour day-of-month month "
                "day-of-week (or @hourly, @daily, @weekly, @monthly, @yearly)"
            )
        parts = []
        for name, text_field, low, high, names in (
            ("minute", fields[0], 0, 59, ()),
            ("hour", fields[1], 0, 23, ()),
            ("day-of-month", fields[2], 1, 31, ()),
            ("month", fields[3], 1, 12, MONTH_NAMES),
            ("day-of-week", fields[4], 0, 7, WEEKDAY_NAMES),
        ):
            try:
                parts.append(parse_field(text_field, low, high, names))
            except ValueError as exc:
                raise ValueError(f"its {name} field {text_field!r}: {exc}") from None
        weekdays = parts[4]
        if 7 in weekdays.values:  # 7 is Sunday too
            weekdays = CronField(frozenset((weekdays.values - {7}) | {0}), weekdays.star)
        return cls(parts[0], parts[1], parts[2], parts[3], weekdays)

    def matches_day(self, day: dt.date) -> bool:
        if day.month not in self.months.values:
            return False
        in_month = day.day in self.days.values
        in_week = (day.weekday() + 1) % 7 in self.weekdays.values
        if self.days.star or self.weekdays.star:
            return in_month and in_week
        return in_month or in_week  # both restricted: either will do, as in cron

    def next_after(self, after: float, zone: dt.tzinfo) -> float | None:
        """The first whole minute later than `after` (a Unix time) that matches, read as
        wall-clock time in `zone`; None when no day matches. A wall-clock time skipped by
        a clock change fires at the same offset after it; one that happens twice fires
        once."""
        local = dt.datetime.fromtimestamp(after, zone).replace(tzinfo=None)
        first_day = local.date()
        hours = sorted(self.hours.values)
        minutes = sorted(self.minutes.values)
        for offset in range(SEARCH_DAYS):
            day = first_day + dt.timedelta(days=offset)
            if not self.matches_day(day):
                continue
            for hour in hours:
                if offset == 0 and hour < local.hour:
                    continue
                for minute in minutes:
                    wall = dt.datetime.combine(day, dt.time(hour, minute))
                    fires_at = wall.replace(tzinfo=zone).timestamp()
                    if fires_at > after:
                        return fires_at
        return None


def zone_named(name: str) -> dt.tzinfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidError(
            f"timezone {name!r} is not an IANA time zone name; write e.g. 'UTC' or 'Europe/Paris'"
        ) from None


@dataclass(frozen=True)
class Cron:
    """Run at the times a cron expression names ("*/15 * * * *", "0 9 * * mon-fri",
    "@daily"), read in `timezone` (an IANA name; UTC unless given)."""

    expression: str
    timezone: str = "UTC"
    # Read once, in __post_init__: next_after runs on every due time.
    _parsed: CronExpression = field(init=False, repr=False, compare=False)
    _zone: dt.tzinfo = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.expression, str) or not isinstance(self.timezone, str):
            raise InvalidError("Cron takes an expression and a timezone name, both strings")
        try:
            parsed = CronExpression.parse(self.expression)
        except ValueError as exc:
            raise InvalidError(
                f"Cron({self.expression!r}) is not a cron expression: {exc}"
            ) from None
        zone = zone_named(self.timezone)
        object.__setattr__(self, "_parsed", parsed)
        object.__setattr__(self, "_zone", zone)
        if parsed.next_after(0.0, zone) is None:
            raise InvalidError(
                f"Cron({self.expression!r}) names no day that exists; it would never run"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"cron": self.expression, "timezone": self.timezone}

    def next_after(self, after: float, anchor: float) -> float | None:
        del anchor  # cron times are fixed by the clock, not by the deployment
        return self._parsed.next_after(after, self._zone)

    def __str__(self) -> str:
        return f"cron '{self.expression}' ({self.timezone})"


@dataclass(frozen=True, init=False)
class Period:
    """Run every `days + hours + minutes + seconds`, counted from the deployment."""

    seconds: float

    def __init__(
        self, *, days: float = 0, hours: float = 0, minutes: float = 0, seconds: float = 0
    ) -> None:
        parts = (days, hours, minutes, seconds)
        if not all(isinstance(p, int | float) and not isinstance(p, bool) for p in parts):
            raise InvalidError(f"Period takes numbers, not {parts!r}")
        total = days * 86_400 + hours * 3_600 + minutes * 60 + seconds
        if math.isnan(total) or not SHORTEST_PERIOD_S <= total <= LONGEST_PERIOD_S:
            raise InvalidError(
                f"Period of {total:g} s is out of range; use {SHORTEST_PERIOD_S:g} s to 366 days"
            )
        object.__setattr__(self, "seconds", float(total))

    def to_dict(self) -> dict[str, Any]:
        return {"every": self.seconds}

    def next_after(self, after: float, anchor: float) -> float:
        """The first `anchor + k * period` (k >= 1) later than `after`."""
        count = max(1, math.floor((after - anchor) / self.seconds) + 1)
        fires_at = anchor + count * self.seconds
        while fires_at <= after:  # floating point rounding
            fires_at += self.seconds
        return fires_at

    def __str__(self) -> str:
        return f"every {format_seconds(self.seconds)}"


Schedule = Cron | Period


def format_seconds(seconds: float) -> str:
    """90 -> "1m30s", 7200 -> "2h", 1.5 -> "1.5s"."""
    if seconds < 60 and seconds != int(seconds):
        return f"{seconds:g}s"
    remaining = round(seconds)
    parts = []
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)):
        count, remaining = divmod(remaining, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts) or "0s"


def schedule_from_dict(data: Any) -> Schedule:
    """A schedule from its manifest form (what `to_dict` wrote)."""
    if isinstance(data, dict) and set(data) <= {"cron", "timezone"} and "cron" in data:
        return Cron(data["cron"], data.get("timezone", "UTC"))
    if isinstance(data, dict) and set(data) == {"every"}:
        return Period(seconds=data["every"])
    raise InvalidError(f"schedule {data!r} is neither a Cron nor a Period")
