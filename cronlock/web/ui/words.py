"""What the pages say in words: schedules, durations, countdowns, masked addresses."""

from __future__ import annotations

import re
from datetime import datetime

DAYS = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
EMAIL = re.compile(r"([A-Za-z0-9._%+-])[A-Za-z0-9._%+-]*@([A-Za-z0-9.-]+)")


def _day(text: str) -> str | None:
    if text.isdigit() and 0 <= int(text) <= 7:
        return DAYS[int(text) % 7]
    return None


def _days(field: str) -> str | None:
    if field == "*":
        return None
    if "-" in field and "," not in field:
        low, _, high = field.partition("-")
        first, last = _day(low), _day(high)
        if first and last:
            return f"{first} to {last}"
    names = [_day(p) for p in field.split(",")]
    if all(names):
        return ", ".join(n for n in names if n)
    return f"days of week {field}"


def counted(n: int, noun: str) -> str:
    """`n` and its noun, singular for one: "1 missed slot", "2 runs"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def schedule(expr: str | None) -> str:
    """A cron expression in words where its shape is a common one, else the expression."""
    if expr is None:
        return "no schedule (triggered on demand)"
    fields = expr.split()
    if len(fields) != 5:
        return expr
    minute, hour, dom, month, dow = fields
    if (hour, dom, month, dow) == ("*", "*", "*", "*"):
        if minute == "*":
            return "every minute"
        if minute.startswith("*/") and minute[2:].isdigit():
            return f"every {minute[2:]} minutes"
        if minute.isdigit():
            return f"every hour at minute {int(minute)}"
    if minute.isdigit() and hour.isdigit() and month == "*":
        at = f"at {int(hour):02d}:{int(minute):02d}"
        if dom == "*" and dow == "*":
            return f"every day {at}"
        if dom == "*":
            return f"{at}, {_days(dow)}"
        if dow == "*" and dom.isdigit():
            return f"{at} on day {int(dom)} of every month"
    return f"cron {expr}"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 90:
        return f"{seconds:.1f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def until(at: datetime | None, now: datetime) -> str:
    """A countdown's text as the server renders it; the page's script keeps it current."""
    if at is None:
        return ""
    left = (at - now).total_seconds()
    return f"in {duration(left)}" if left >= 0 else f"{duration(-left)} ago"


def ago(at: datetime | None, now: datetime) -> str:
    if at is None:
        return ""
    return f"{duration(max(0.0, (now - at).total_seconds()))} ago"


def mask(address: str) -> str:
    """An address as the read token sees it: its first letter and its domain."""
    return EMAIL.sub(lambda m: f"{m.group(1)}•••@{m.group(2)}", address)
