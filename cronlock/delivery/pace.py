"""The outbox's pace towards the provider: a request window the database keeps for every
sender of every instance, and what the provider said about its own limit.

**The window.** `OUTBOX_RATE_LIMIT` is R requests per second; no more than R requests may
start in any one-second window, across all senders (a provider such as Resend counts them
that way: a token bucket with a second's burst sent twice its limit in some windows). One row
(`<DB_SCHEMA>.email_outbox_rate`, migration 0016) keeps the start times handed to the latest
requests. A sender takes a start when it is about to send (`reserve`, one statement under the
row's lock): now, if fewer than n starts lie within the last window; else it is told when the
oldest of them leaves, sleeps until then and asks again. So the starts of any n + 1 requests
lie at least a window apart, whoever sent them. The start recorded is the database's clock at
that moment; a request that then leaves late (its first connection, a busy process: the
trace of its HTTP request says when it was written out) has its start moved to then
(`correct`), so the next ones count from when it really left. The window is a second plus
`MARGIN`, for what remains: a request reaches the provider a few milliseconds after its start.
A fractional R above 1 counts as its whole part; below 1, one request per 1/R seconds.

Before claiming, a sender looks at the window (`room`, a plain read) and claims no more than
could start within one window; a second sender reading at the same moment may claim as many,
and its requests then wait for later start times (`reserve` is the strict part).

**The provider's word.** Every answer's `ratelimit-limit`, `ratelimit-remaining`,
`ratelimit-reset` and, on a 429, `retry-after` are recorded in the same row (`observe`) and
pace every sender: a 429 stops all of them until its Retry-After (else its reset, else a
second); a limit below R makes the window hold that many; and when the provider says nothing is
left and counts more requests than ours in its window (another client on the same API key),
nobody starts before its reset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

from cronlock.delivery.mailer import RateInfo
from cronlock.sql import Conn, qualify

# Seconds added to every window: what a request's arrival at the provider may lag the moment
# it was written out (late starts are moved to that moment: `correct`).
MARGIN = 0.02
# A request written out later than this after its start has its start moved (`correct`).
LATE = 0.01
# The longest pause any answer can impose (an absurd Retry-After must not stop mail for
# longer than a day; past OUTBOX_RETRY_WINDOW the rows die of their keys' age anyway).
MAX_PAUSE = 86400.0

# The row as seconds from now, by the database's clock (a pause never set is -infinity).
STATE_SQL = """
SELECT ARRAY(SELECT extract(epoch FROM s - c.ts)::float8 FROM unnest(r.starts) AS s) AS starts,
       CASE WHEN r.paused_until > c.ts
            THEN extract(epoch FROM r.paused_until - c.ts)::float8 ELSE 0 END AS paused,
       r.provider_limit
FROM {schema}.email_outbox_rate AS r, (SELECT clock_timestamp() AS ts) AS c
WHERE r.id
"""

# One start time, under the row's lock: the n-th latest start plus the window (or now, or the
# end of a pause). Not granted, and not recorded, when it lies more than $3 seconds ahead (the
# caller's lease would not cover the wait). The row keeps the latest $1 starts.
RESERVE_SQL = """
WITH cur AS (
    SELECT r.starts, r.paused_until, clock_timestamp() AS ts,
           greatest(1, least($1::int, coalesce(r.provider_limit, $1::int))) AS n
    FROM {schema}.email_outbox_rate AS r
    WHERE r.id
    FOR UPDATE
),
pick AS (
    SELECT cur.starts, cur.ts,
           greatest(cur.ts, cur.paused_until,
                    cur.starts[cardinality(cur.starts) - cur.n + 1]
                        + make_interval(secs => $2::float8)) AS at
    FROM cur
)
UPDATE {schema}.email_outbox_rate AS r
SET starts = CASE WHEN p.at <= p.ts + make_interval(secs => $3::float8)
                  THEN (p.starts || p.at)[greatest(1, cardinality(p.starts) + 2 - $1::int):]
                  ELSE p.starts END
FROM pick AS p
WHERE r.id
RETURNING p.at <= p.ts + make_interval(secs => $3::float8) AS granted,
          extract(epoch FROM p.at - p.ts)::float8 AS wait, p.at
"""

# A request that left late (written out whole `$2` seconds after its start `$1`): its start
# is moved to when it left, so the next requests count from there. The starts stay in order.
CORRECT_SQL = """
UPDATE {schema}.email_outbox_rate
SET starts = ARRAY(
    SELECT s FROM unnest(array_replace(starts, $1::timestamptz,
                                       $1::timestamptz + make_interval(secs => $2::float8))) AS s
    ORDER BY s)
WHERE id
"""

# An answer's rate headers: $1 the request's start (NULL: none recorded), $2 limit, $3
# remaining, $4 reset (seconds), $5 a pause asked for (a 429), $6 the window (seconds). The
# provider's "nothing left" pauses everyone until its reset only when it counts more requests
# than ours in its window: when it counts only ours, the window already knows when the next
# one may start, to the millisecond (a reset is whole seconds). Requests of ours started
# after this one count as spent from what it says is left.
OBSERVE_SQL = """
UPDATE {schema}.email_outbox_rate AS r
SET provider_limit = coalesce($2::int, r.provider_limit),
    paused_until = greatest(
        r.paused_until,
        clock_timestamp() + make_interval(secs => $5::float8),
        CASE WHEN $3::int - (SELECT count(*) FROM unnest(r.starts) AS s
                             WHERE s > $1::timestamptz) <= 0
                  AND ($2::int IS NULL OR $1::timestamptz IS NULL
                       OR $2::int - $3::int > (
                           SELECT count(*) FROM unnest(r.starts) AS s
                           WHERE s > $1::timestamptz - make_interval(secs => $6::float8)
                             AND s <= $1::timestamptz))
             THEN clock_timestamp() + make_interval(secs => coalesce($4::float8, $6::float8))
        END)
WHERE r.id
"""


@dataclass(frozen=True, slots=True)
class Window:
    """At most `n` request starts in any `span` seconds."""

    n: int
    span: float


def window(rate: float) -> Window | None:
    """The window for OUTBOX_RATE_LIMIT `rate` (None: 0, no limit of our own)."""
    if not rate > 0 or not math.isfinite(rate):
        return None
    if rate >= 1:
        return Window(int(rate), 1.0 + MARGIN)
    return Window(1, 1.0 / rate + MARGIN)


@dataclass(frozen=True, slots=True)
class Room:
    """How many requests may start within the next window, or how long until one may."""

    free: int
    wait: float


def room_in(
    starts: list[float], paused: float, provider_limit: int | None, win: Window | None, want: int
) -> Room:
    """`room` from the row's values in seconds from now (`starts`: the latest start times;
    `paused`: until the pause ends), separate so the arithmetic can be tested alone."""
    horizon = win.span if win else 0.0
    if paused > horizon:
        return Room(0, paused - horizon)
    if win is None:
        return Room(want, 0.0)
    n = max(1, min(win.n, provider_limit if provider_limit is not None else win.n))
    latest = sorted(starts)[-n:]
    free = n - len(latest) + sum(1 for s in latest if s + win.span <= horizon)
    if free:
        return Room(min(free, want), 0.0)
    return Room(0, latest[0] + win.span - horizon)


async def room(conn: Conn, *, schema: str, win: Window | None, want: int) -> Room:
    """Up to `want` requests that may start within one window (a read, no lock)."""
    row = await conn.fetchrow(qualify(STATE_SQL, schema))
    if row is None:  # the row is missing: never block delivery on it
        return Room(want, 0.0)
    return room_in(list(row["starts"]), row["paused"], row["provider_limit"], win, want)


@dataclass(frozen=True, slots=True)
class Turn:
    """A request's start: `wait` seconds from now; `at` as recorded (None: not granted, or
    not recorded)."""

    granted: bool
    wait: float
    at: datetime | None


async def reserve(conn: Conn, *, schema: str, win: Window, ahead: float) -> Turn:
    """One request's start time in the window, no more than `ahead` seconds from now."""
    row = await conn.fetchrow(qualify(RESERVE_SQL, schema), win.n, win.span, max(0.0, ahead))
    if row is None:
        return Turn(True, 0.0, None)
    return Turn(bool(row["granted"]), max(0.0, float(row["wait"])), row["at"])


async def correct(conn: Conn, *, schema: str, at: datetime, late: float) -> None:
    """Move the start `at` of a request that was written out `late` seconds after it."""
    await conn.execute(qualify(CORRECT_SQL, schema), at, min(late, MAX_PAUSE))


def worth_recording(info: RateInfo, win: Window | None, known_limit: int | None) -> bool:
    """Whether an answer can change the shared pace: a 429, a limit we have not recorded, or
    so little left that a pause may follow."""
    if info.throttled:
        return True
    if info.limit is not None and info.limit != known_limit:
        return True
    return info.remaining is not None and info.remaining <= (win.n if win else 0)


async def observe(
    conn: Conn, *, schema: str, win: Window | None, at: datetime | None, info: RateInfo
) -> None:
    """Record what an answer said about the provider's limit (see OBSERVE_SQL)."""
    pause = None
    if info.throttled:
        pause = next(
            (v for v in (info.retry_after, info.reset) if v is not None), win.span if win else 1.0
        )
    await conn.execute(
        qualify(OBSERVE_SQL, schema),
        at,
        info.limit,
        info.remaining,
        None if info.reset is None else min(info.reset, MAX_PAUSE),
        None if pause is None else min(pause, MAX_PAUSE),
        win.span if win else 1.0,
    )
