"""What the database can take, checked where values come in (the routes, the command line)
before a statement has to refuse them: a refusal is a data exception that says neither which
parameter it was nor why in words a client can use (see `db.translate` for the fallback).

PostgreSQL's limits, as they meet a request:
- bigint: -2**63 .. 2**63 - 1 (asyncpg cannot even encode a larger Python int);
- text and jsonb strings: any character but NUL (U+0000), and only what UTF-8 can encode
  (a lone surrogate, which JSON's `\\ud800` escape can produce, is not a character);
- timestamptz: 4713 BC .. 294276 AD, wider than Python's years 1 .. 9999, so a Python
  datetime always fits, provided its instant in UTC is one (9999-12-31T23:00-05:00 is not).
"""

from __future__ import annotations

import argparse
import math
import unicodedata
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

BIGINT_MAX = 2**63 - 1
INT_MAX = 2**31 - 1  # an `integer` column (a fan-out item's number)


def text_problem(value: str) -> str | None:
    """Why PostgreSQL cannot store `value` as text, or None."""
    if "\x00" in value:
        return "contains NUL (\\u0000), which PostgreSQL cannot store"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone surrogate, which is not a character (not UTF-8)"
    return None


def has_control(value: str) -> bool:
    """Whether `value` has a control character (C0, DEL, C1: a newline, a tab, ESC...)."""
    return any(unicodedata.category(ch) == "Cc" for ch in value)


def json_problem(value: Any) -> tuple[list[str | int], str] | None:
    """The first place in a JSON value (as `json.loads` returns it) that jsonb would refuse,
    with the reason: a string or key `text_problem` refuses, or NaN and Infinity (not JSON,
    though Python's json reads and writes them). Iterative: the depth is the client's."""
    stack: list[tuple[list[str | int], Any]] = [([], value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            problem = text_problem(item)
            if problem is not None:
                return path, problem
        elif isinstance(item, float) and not math.isfinite(item):
            return path, "is not a finite number (jsonb has no NaN or Infinity)"
        elif isinstance(item, dict):
            for key, child in item.items():
                problem = text_problem(key) if isinstance(key, str) else None
                if problem is not None:
                    return [*path, key], f"key {problem}"
                stack.append(([*path, key], child))
        elif isinstance(item, list):
            stack.extend(([*path, i], child) for i, child in enumerate(item))
    return None


def timestamp_problem(value: datetime) -> str | None:
    """Why `value` cannot be a timestamptz parameter, or None."""
    if value.tzinfo is None or value.utcoffset() is None:
        return "needs a time zone offset, e.g. 2026-01-01T07:00:00Z"
    try:
        value.astimezone(UTC)
    except OverflowError:
        return "is out of range: its instant in UTC is outside the years 1 to 9999"
    return None


def check_timestamp(value: datetime) -> datetime:
    """A pydantic AfterValidator: ValueError (a 422 naming the field) for `timestamp_problem`."""
    problem = timestamp_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def check_text(value: str | None) -> str | None:
    """A pydantic AfterValidator: ValueError (a 422 naming the field) for `text_problem`."""
    problem = text_problem(value) if value is not None else None
    if problem is not None:
        raise ValueError(problem)
    return value


# --- argparse types: a bad value is argparse's usage error (exit 2), never a traceback ----------


def int_range(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text[:40]!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}")
        return value

    parse.__name__ = "integer"
    return parse


def seconds(text: str) -> float:
    """A duration in seconds: finite and not negative (`nan` would never compare as passed)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text[:40]!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError("must be a finite, non-negative number of seconds")
    return value


def positive_seconds(text: str) -> float:
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds")
    return value


def timestamp(text: str) -> datetime:
    """An ISO 8601 time with its offset, e.g. 2026-01-01T07:00:00Z."""
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an ISO 8601 time: {text[:40]!r} (e.g. 2026-01-01T07:00:00Z)"
        ) from None
    problem = timestamp_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} {problem}")
    return value


def line(max_length: int) -> Callable[[str], str]:
    """`text`, on one line: no control character (a newline, a tab, ESC...), for a value that
    goes into a file of lines (a crontab) or a terminal."""
    check = text(max_length)

    def parse(value: str) -> str:
        value = check(value)
        if has_control(value):
            raise argparse.ArgumentTypeError("contains a control character (a newline, a tab...)")
        return value

    parse.__name__ = "text"
    return parse


def text(max_length: int) -> Callable[[str], str]:
    def parse(value: str) -> str:
        problem = text_problem(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        if len(value) > max_length:
            raise argparse.ArgumentTypeError(f"longer than {max_length} characters")
        return value

    parse.__name__ = "text"
    return parse
