"""The outbox's shared request window and the provider's rate headers (cronlock/delivery/pace.py),
against real PostgreSQL; the senders that use them are in tests/test_outbox.py and
tests/test_batch.py, the figures in tests/test_pacing.py."""

from __future__ import annotations

import asyncio
import math

import asyncpg
import httpx
import pytest

from cronlock.delivery import pace
from cronlock.delivery.mailer import RateInfo, classify_batch, classify_response, parse_rate
from cronlock.delivery.pace import Room, Window


def test_the_window_for_a_rate() -> None:
    assert pace.window(0) is None
    assert pace.window(2) == Window(2, 1 + pace.MARGIN)
    assert pace.window(2.9) == Window(2, 1 + pace.MARGIN)  # never above the rate in a second
    assert pace.window(0.5) == Window(1, 2 + pace.MARGIN)  # one per two seconds
    assert pace.window(math.inf) is None
    assert pace.window(math.nan) is None


def test_room_counts_starts_that_leave_the_window_within_one() -> None:
    win = Window(2, 1.05)
    assert pace.room_in([], 0.0, None, win, 10) == Room(2, 0.0)
    assert pace.room_in([-2.0, -1.5], 0.0, None, win, 10) == Room(2, 0.0)
    assert pace.room_in([-0.5, 0.9], 0.0, None, win, 10) == Room(1, 0.0)
    # Two reserved ahead: the next start is after the older of them leaves.
    room = pace.room_in([0.2, 0.4], 0.0, None, win, 10)
    assert room.free == 0
    assert room.wait == pytest.approx(0.2)
    assert pace.room_in([], 0.0, None, win, 1) == Room(1, 0.0)
    # The provider's limit below ours narrows the window; a pause holds everything.
    assert pace.room_in([-0.5], 0.0, 1, win, 10) == Room(1, 0.0)
    assert pace.room_in([0.5], 0.0, 1, win, 10).free == 0
    assert pace.room_in([], 3.0, None, win, 10).wait == pytest.approx(1.95)
    assert pace.room_in([], 3.0, None, None, 10) == Room(0, 3.0)
    assert pace.room_in([], 0.0, None, None, 10) == Room(10, 0.0)


async def _reserve_many(database_url: str, win: Window, each: int, conns: int) -> list[float]:
    """Start times reserved by `conns` connections at once, as seconds (database clock)."""
    opened = [await asyncpg.connect(database_url) for _ in range(conns)]
    try:

        async def take(conn: asyncpg.Connection) -> list[float]:
            got = []
            for _ in range(each):
                turn = await pace.reserve(conn, schema="cronlock", win=win, ahead=60)
                assert turn.granted
                assert turn.at is not None
                got.append(turn.at.timestamp())
            return got

        batches = await asyncio.gather(*(take(c) for c in opened))
    finally:
        for conn in opened:
            await conn.close()
    return sorted(t for batch in batches for t in batch)


async def test_no_window_ever_holds_more_than_its_share(database_url: str) -> None:
    """8 connections reserving at once: any n + 1 start times lie a window apart, and the
    starts follow each other without gaps (n per window)."""
    win = Window(5, 0.2)
    starts = await _reserve_many(database_url, win, 6, 8)
    assert len(starts) == 48
    gaps = [starts[i + win.n] - starts[i] for i in range(len(starts) - win.n)]
    assert min(gaps) >= win.span - 1e-6
    # Greedy: each start as early as the window allows (no time lost between them).
    assert starts[-1] - starts[0] <= (len(starts) / win.n) * win.span + 0.1


async def test_a_turn_too_far_ahead_is_not_taken(db: asyncpg.Connection) -> None:
    win = Window(1, 10.0)
    first = await pace.reserve(db, schema="cronlock", win=win, ahead=1)
    assert first.granted
    assert first.wait == 0
    second = await pace.reserve(db, schema="cronlock", win=win, ahead=1)
    assert not second.granted
    assert second.wait == pytest.approx(10, abs=0.5)
    kept = await db.fetchval("SELECT cardinality(starts) FROM cronlock.email_outbox_rate")
    assert kept == 1  # a refused turn is not recorded


async def _paused_for(db: asyncpg.Connection) -> float:
    value = await db.fetchval(
        "SELECT extract(epoch FROM greatest(paused_until, now()) - clock_timestamp())::float8 "
        "FROM cronlock.email_outbox_rate"
    )
    return max(0.0, float(value))


async def test_a_429_pauses_every_sender_for_its_retry_after(db: asyncpg.Connection) -> None:
    win = Window(2, 1.05)
    info = RateInfo(limit=2, remaining=0, reset=1, retry_after=3, throttled=True)
    await pace.observe(db, schema="cronlock", win=win, at=None, info=info)
    assert 2.5 < await _paused_for(db) <= 3
    turn = await pace.reserve(db, schema="cronlock", win=win, ahead=10)
    assert turn.wait > 2.5  # a start is never handed out inside the pause
    room = await pace.room(db, schema="cronlock", win=win, want=5)
    assert room.free == 0


async def test_nothing_left_pauses_only_when_the_provider_counts_more_than_ours(
    db: asyncpg.Connection,
) -> None:
    """remaining 0 after our own two requests of the window: the window already knows when
    the next may start, no pause. remaining 0 after one of ours (another client on the key):
    nobody starts before the reset."""
    win = Window(2, 1.05)
    first = await pace.reserve(db, schema="cronlock", win=win, ahead=10)
    second = await pace.reserve(db, schema="cronlock", win=win, ahead=10)
    ours = RateInfo(limit=2, remaining=0, reset=1)
    await pace.observe(db, schema="cronlock", win=win, at=second.at, info=ours)
    assert await _paused_for(db) == 0
    assert await db.fetchval("SELECT provider_limit FROM cronlock.email_outbox_rate") == 2
    # The provider counted 2 when only `first` was ours in its window.
    foreign = RateInfo(limit=3, remaining=1, reset=2)
    await pace.observe(db, schema="cronlock", win=win, at=first.at, info=foreign)
    # 1 left, but `second` started after `first`: spent; the provider saw one not ours.
    assert 1.5 < await _paused_for(db) <= 2


def test_rate_headers_are_read_from_every_answer() -> None:
    headers = {"ratelimit-limit": "2", "ratelimit-remaining": "0", "ratelimit-reset": "1"}
    ok = classify_response(httpx.Response(200, json={"id": "m1"}, headers=headers))
    assert ok.rate == RateInfo(2, 0, 1.0)
    limited = classify_response(
        httpx.Response(
            429, json={"name": "rate_limit_exceeded"}, headers=headers | {"retry-after": "1"}
        )
    )
    assert limited.status == "retry"
    assert limited.rate == RateInfo(2, 0, 1.0, 1.0, throttled=True)
    batch = classify_batch(httpx.Response(200, json={"data": [{"id": "a"}]}, headers=headers), 1)
    assert batch.request.rate == RateInfo(2, 0, 1.0)
    assert parse_rate(httpx.Response(200)) is None
    assert parse_rate(httpx.Response(429)) == RateInfo(throttled=True)


@pytest.mark.parametrize(
    "headers",
    [
        {"ratelimit-limit": "-1", "ratelimit-remaining": "x", "ratelimit-reset": "nan"},
        {"ratelimit-limit": "1e9", "ratelimit-remaining": "٣".encode(), "ratelimit-reset": "inf"},
        {
            "ratelimit-limit": "99999999999999999999",
            "ratelimit-remaining": " ",
            "ratelimit-reset": "",
        },
    ],
)
def test_unusable_rate_headers_are_left_out(headers: dict[str, str]) -> None:
    """Garbage, negative, non-ASCII digits and numbers too big: ignored, never guessed at."""
    assert parse_rate(httpx.Response(200, headers=headers)) is None
    assert parse_rate(httpx.Response(429, headers=headers)) == RateInfo(throttled=True)


def test_repeated_rate_headers_are_left_out() -> None:
    headers = [("ratelimit-remaining", "5"), ("ratelimit-remaining", "0"), ("retry-after", "1")]
    headers += [("retry-after", "9")]
    assert parse_rate(httpx.Response(429, headers=headers)) == RateInfo(throttled=True)


async def test_an_absurd_pause_is_capped(db: asyncpg.Connection) -> None:
    info = RateInfo(retry_after=1e300, throttled=True)
    await pace.observe(db, schema="cronlock", win=None, at=None, info=info)
    assert await _paused_for(db) <= pace.MAX_PAUSE
