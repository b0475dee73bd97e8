"""Every route fuzzed from the OpenAPI document by every schemathesis phase (examples,
coverage, fuzzing, stateful), at one instance as a new user meets it: no 5xx but the
documented answers of jobs that fail on purpose (left out), nothing internal in any answer,
and the document's links followed. bench/fuzz.py runs the same for longer, seeds at random;
tests/test_hostile.py through nginx and PgBouncer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import asyncpg

from tests.support import fuzz

# With these, the code before issue 18 answered 503 to a NUL in `GET /cron/runs?job=` and in
# a job's params (jsonb), as other seeds did to a `before` beyond bigint; about 20 s here.
SEED = 6
EXAMPLES = 50
# Stateful steps per scenario: enough that each of the document's three links is taken (at 10,
# the next-page link was missed in about one run in four).
STEPS = 25


async def test_every_phase_on_every_route_finds_nothing(
    start_instance: Callable[..., Any], db: asyncpg.Connection
) -> None:
    instance = start_instance("fuzz")
    # More finished runs than the largest page (500): every page of runs has a next page to
    # follow, whatever the fuzzer's own triggers made.
    await db.execute(
        "INSERT INTO cronlock.runs (job, trigger, instance, status, started_at, finished_at)"
        " SELECT 'fast', 'manual', 'seed', 'succeeded', t, t"
        " FROM generate_series(1, 600) AS g, LATERAL (SELECT now() - g * interval '1 s') AS s(t)"
    )
    report = fuzz.run(instance.url, seed=SEED, max_examples=EXAMPLES, max_steps=STEPS)
    assert report.problems == [], "\n".join([report.summary(), *report.problems[:30]])
    # Every phase ran (none skipped for want of examples or links) on every route the
    # document lists, the triggers of the jobs that succeed included.
    assert report.phases == {
        **{p: "ran" for p in ("probing", "schema_analysis", "auth_bootstrap")},
        **{p: "ran" for p in ("examples", "coverage", "fuzzing", "stateful")},
    }, report.summary()
    assert {"coverage", "fuzzing", "stateful"} <= set(report.requests), report.summary()
    routes = {op.split(" ", 1)[1] for op in report.operations}
    assert {"/cron/jobs", "/cron/runs", "/cron/runs/{run_id}", "/cron/locks", "/healthz"} <= routes
    assert {f"/cron/{job}" for job in fuzz.FAST_JOBS} <= routes
    # The stateful phase went from answers to requests by every link: a 202's run, the next
    # page of runs, a page's newest run.
    assert report.links_followed() == set(fuzz.LINKS), report.summary()
    # Bad input was sent, and answered as such.
    assert report.statuses[422] > 0, report.summary()
    assert report.statuses[202] > 0, report.summary()
    instance.check_alive()
