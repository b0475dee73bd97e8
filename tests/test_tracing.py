"""Tracing (docs/tracing.md), with the SDK's in-memory exporter: the span tree of a trigger
with a `traceparent`, a skip, a failed run, a lease run and an email's send; nothing traced
while tracing is not configured; an exporter that blocks slows no trigger."""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import asyncpg
import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from cronlock import tracing
from cronlock.delivery.mailer import create_mailer
from cronlock.delivery.sender import Sender
from cronlock.instance import Cronlock
from cronlock.service import build
from cronlock.settings import Settings
from tests import trace_jobs
from tests.support.asgi import Dispatch, InProcess, serve
from tests.util import AUTH, wait_for

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"

Start = Callable[..., Any]


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace_jobs.TRACER = provider.get_tracer("tests.trace_jobs")
    return provider


@pytest.fixture
async def start(
    make_settings: Callable[..., Settings], dispatch: Dispatch
) -> AsyncIterator[Callable[..., Any]]:
    """`await start(name, tracer_provider=..., **settings)`: a service on tests.trace_jobs."""
    async with contextlib.AsyncExitStack() as stack:

        async def start_one(name: str, provider: Any = None, **overrides: Any) -> InProcess:
            settings = make_settings(instance_name=name, cron_jobs="tests.trace_jobs", **overrides)
            cron = Cronlock(settings, housekeeping=False, tracer_provider=provider)
            served = await stack.enter_async_context(serve(build(cron), name))
            dispatch.add(served)
            async with httpx.AsyncClient(transport=served.transport, base_url=served.url) as c:

                async def ready() -> bool:
                    return (await c.get("/readyz")).status_code == 200

                await wait_for(ready, 30, f"{name} ready")
            return served

        yield start_one


def named(spans: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def one(spans: Sequence[ReadableSpan], name: str) -> ReadableSpan:
    found = named(spans, name)
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    found: int = span.context.span_id
    return found


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def test_a_trigger_with_a_traceparent_is_its_child_and_the_jobs_spans_nest_in_the_run(
    start: Start,
    client: httpx.AsyncClient,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
) -> None:
    """trigger (server span, child of the request's traceparent) > run > the job's own span."""
    app = await start("a", provider)
    r = await client.post(f"{app.url}/cron/traced", headers={**AUTH, "traceparent": TRACEPARENT})
    assert r.status_code == 200, r.text
    spans = exporter.get_finished_spans()
    trigger, run, query = (
        one(spans, "trigger traced"),
        one(spans, "run traced"),
        one(spans, "SELECT"),
    )
    assert {s.context.trace_id for s in (trigger, run, query) if s.context} == {int(TRACE_ID, 16)}
    assert trigger.kind == SpanKind.SERVER
    assert trigger.parent is not None
    assert trigger.parent.is_remote
    assert parent_of(trigger) == int(PARENT_ID, 16)
    assert parent_of(run) == span_id(trigger)
    assert parent_of(query) == span_id(run)
    run_id = r.json()["run_id"]
    assert attrs(trigger) | {"cronlock.run_id": run_id} == {
        "cronlock.job": "traced",
        "cronlock.source": "http",
        "cronlock.outcome": "succeeded",
        "cronlock.trigger": "manual",  # no schedule: each run is a request
        "cronlock.run_id": run_id,
        "cronlock.duration_ms": attrs(trigger)["cronlock.duration_ms"],
    }
    assert attrs(run)["cronlock.run_id"] == run_id
    assert attrs(run)["cronlock.attempt"] == 1
    assert attrs(run)["cronlock.outcome"] == "succeeded"
    assert trigger.status.status_code == run.status.status_code == StatusCode.UNSET


async def test_a_trigger_without_traceparent_starts_a_trace(
    start: Start, client: httpx.AsyncClient, provider: TracerProvider, exporter: Any
) -> None:
    app = await start("a", provider)
    assert (await client.post(f"{app.url}/cron/traced", headers=AUTH)).status_code == 200
    trigger = one(exporter.get_finished_spans(), "trigger traced")
    assert trigger.parent is None
    assert trigger.kind == SpanKind.SERVER


async def test_a_skip_is_a_trigger_span_with_its_reason_and_no_run(
    start: Start, client: httpx.AsyncClient, provider: TracerProvider, exporter: Any
) -> None:
    app = await start("a", provider)
    first = await client.post(f"{app.url}/cron/traced-yearly", headers=AUTH)
    assert first.status_code == 200, first.text
    exporter.clear()
    again = await client.post(
        f"{app.url}/cron/traced-yearly", headers={**AUTH, "traceparent": TRACEPARENT}
    )
    assert again.json()["skipped"] is True
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["trigger traced-yearly"]
    skip = attrs(spans[0])
    assert skip["cronlock.outcome"] == "skipped"
    assert skip["cronlock.skip_reason"] == "already done"
    assert skip["cronlock.slot"] == again.json()["slot"].replace("Z", "+00:00")
    assert "cronlock.run_id" not in skip
    assert spans[0].status.status_code == StatusCode.UNSET


async def test_a_failed_run_marks_its_run_and_trigger_spans_as_errors(
    start: Start, client: httpx.AsyncClient, provider: TracerProvider, exporter: Any
) -> None:
    app = await start("a", provider)
    r = await client.post(f"{app.url}/cron/traced-fails", headers=AUTH)
    assert r.status_code == 500
    spans = exporter.get_finished_spans()
    trigger, run = one(spans, "trigger traced-fails"), one(spans, "run traced-fails")
    assert parent_of(run) == span_id(trigger)
    assert parent_of(one(spans, "SELECT")) == span_id(run)
    for span in (trigger, run):
        assert span.status.status_code == StatusCode.ERROR
        assert span.status.description == "failing on purpose"
        assert attrs(span)["cronlock.outcome"] == "failed"
        assert attrs(span)["cronlock.reason"] == "failing on purpose"


async def test_a_lease_run_has_a_span_per_step_under_its_run(
    start: Start, client: httpx.AsyncClient, provider: TracerProvider, exporter: Any
) -> None:
    app = await start("a", provider)
    r = await client.post(
        f"{app.url}/cron/traced-lease", headers={**AUTH, "traceparent": TRACEPARENT}
    )
    assert r.status_code == 202, r.text

    async def finished() -> bool:
        return bool(named(exporter.get_finished_spans(), "run traced-lease"))

    await wait_for(finished, 20, "the lease run's span")
    spans = exporter.get_finished_spans()
    trigger, run = one(spans, "trigger traced-lease"), one(spans, "run traced-lease")
    assert attrs(trigger)["cronlock.outcome"] == "accepted"
    assert parent_of(trigger) == int(PARENT_ID, 16)
    assert parent_of(run) == span_id(trigger)
    assert attrs(run)["cronlock.run_id"] == r.json()["run_id"]
    assert attrs(run)["cronlock.attempt"] == 1
    assert attrs(run)["cronlock.outcome"] == "succeeded"
    steps = sorted(named(spans, "step traced-lease"), key=lambda s: attrs(s)["cronlock.step"])
    assert [attrs(s)["cronlock.step"] for s in steps] == [1, 2]
    assert all(parent_of(s) == span_id(run) for s in steps)
    queries = named(spans, "SELECT")
    assert sorted(parent_of(q) or 0 for q in queries) == sorted(span_id(s) for s in steps)


async def test_fanout_items_are_spans_under_their_runs_span_on_the_instance_that_works_them(
    start: Start,
    client: httpx.AsyncClient,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    db: asyncpg.Connection,
) -> None:
    """The run's span covers the planning; its context, stored with the fan-out, is the
    parent of each item's span on both instances; a retry's items go under the retry's run."""
    fast = {"fanout_poll_interval": 0.2, "fanout_concurrency": 2}
    a = await start("a", provider, **fast)
    await start("b", provider, **fast)
    trace_jobs.FAILING = {2}
    r = await client.post(
        f"{a.url}/cron/traced-fanout", headers={**AUTH, "traceparent": TRACEPARENT}
    )
    assert r.status_code == 202, r.text
    first = r.json()["run_id"]

    async def items(n: int = 3) -> bool:
        return len(named(exporter.get_finished_spans(), "item traced-fanout")) >= n

    await wait_for(items, 20, "the items' spans")
    spans = exporter.get_finished_spans()
    trigger, run = one(spans, "trigger traced-fanout"), one(spans, "run traced-fanout")
    assert parent_of(run) == span_id(trigger)
    assert attrs(run)["cronlock.run_id"] == first
    assert attrs(run)["cronlock.outcome"] == "accepted"
    stored = await db.fetchval("SELECT traceparent FROM cronlock.fanouts WHERE run_id = $1", first)
    assert run.context is not None
    assert stored == f"00-{run.context.trace_id:032x}-{run.context.span_id:016x}-01"
    found = sorted(named(spans, "item traced-fanout"), key=lambda s: attrs(s)["cronlock.item"])
    assert [attrs(s)["cronlock.item"] for s in found] == [0, 1, 2]
    for item in found:
        assert item.parent is not None
        assert item.parent.is_remote  # from the stored context
        assert parent_of(item) == span_id(run)
        assert item.context is not None
        assert item.context.trace_id == int(TRACE_ID, 16)
        assert attrs(item)["cronlock.run_id"] == first
        assert attrs(item)["cronlock.attempt"] == 1
        assert attrs(item)["cronlock.instance"] in ("a", "b")
    # The item's own statements nest under its span.
    queries = named(spans, "SELECT")
    assert sorted(parent_of(q) or 0 for q in queries) == sorted(span_id(s) for s in found)
    assert [attrs(s)["cronlock.outcome"] for s in found] == ["succeeded", "succeeded", "failed"]
    assert [s.status.status_code for s in found] == [StatusCode.UNSET] * 2 + [StatusCode.ERROR]
    assert found[2].status.description == "RuntimeError: item 2 fails"

    # Retried: the new attempt has a run span of its own, its item's parent.
    exporter.clear()
    trace_jobs.FAILING = set()

    async def failed() -> bool:
        status = await db.fetchval("SELECT status FROM cronlock.runs WHERE id = $1", first)
        return bool(status == "failed")

    await wait_for(failed, 20, "the run to fail")
    again = await client.post(f"{a.url}/cron/runs/{first}/items/retry", headers=AUTH)
    assert again.status_code == 202, again.text
    await wait_for(lambda: items(1), 20, "the retried item's span")
    spans = exporter.get_finished_spans()
    retry, item = one(spans, "run traced-fanout"), one(spans, "item traced-fanout")
    assert attrs(retry)["cronlock.run_id"] == again.json()["run_id"]
    assert attrs(retry)["cronlock.attempt"] == 2
    assert attrs(retry)["cronlock.retry_of"] == first
    assert parent_of(item) == span_id(retry)
    assert attrs(item)["cronlock.item"] == 2
    assert attrs(item)["cronlock.outcome"] == "succeeded"


async def test_an_emails_send_is_a_client_span_linked_to_the_run_that_queued_it(
    start: Start,
    client: httpx.AsyncClient,
    provider: TracerProvider,
    exporter: Any,
    make_settings: Callable[..., Settings],
    database_url: str,
) -> None:
    app = await start("a", provider)
    assert (await client.post(f"{app.url}/cron/traced-mail", headers=AUTH)).status_code == 200
    run = one(exporter.get_finished_spans(), "run traced-mail")
    exporter.clear()
    settings = make_settings(outbox_enabled=True, email_backend="log")
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=4)
    mailer = create_mailer(settings)
    try:
        sender = Sender(pool, settings, mailer, tracing=tracing.Tracing(provider))
        assert await sender.drain_once() == 1
    finally:
        await mailer.aclose()
        await pool.close()
    send = one(exporter.get_finished_spans(), "email send")
    assert send.kind == SpanKind.CLIENT
    assert send.parent is None
    assert run.context is not None
    linked = [(link.context.trace_id, link.context.span_id) for link in send.links]
    assert linked == [(run.context.trace_id, run.context.span_id)]
    assert attrs(send)["cronlock.outcome"] == "sent"


async def test_nothing_is_traced_unless_configured(
    start: Start, client: httpx.AsyncClient, provider: TracerProvider, exporter: Any, db: Any
) -> None:
    """No provider set (or TRACING=off with one): no span, no traceparent kept with emails."""
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert tracing.Tracing.detect(Settings(_env_file=None)) is tracing.OFF
    assert tracing.Tracing.detect(Settings(_env_file=None, tracing="off"), provider) is tracing.OFF
    plain = await start("plain")
    off = await start("off", provider, tracing="off")
    for app in (plain, off):
        headers = {**AUTH, "traceparent": TRACEPARENT}
        assert (await client.post(f"{app.url}/cron/traced", headers=headers)).status_code == 200
        assert (await client.post(f"{app.url}/cron/traced-lease", headers=AUTH)).status_code == 202
        assert (await client.post(f"{app.url}/cron/traced-mail", headers=AUTH)).status_code == 200

        async def lease_ended() -> bool:  # before the next app's trigger: not "already running"
            running = "SELECT count(*) FROM cronlock.runs WHERE job = 'traced-lease'"
            return bool(await db.fetchval(running + " AND status = 'running'") == 0)

        await wait_for(lease_ended, 10, "the lease run to end")
    assert await db.fetchval("SELECT count(*) FROM cronlock.email_outbox") == 2
    assert await db.fetchval("SELECT count(traceparent) FROM cronlock.email_outbox") == 0
    # The jobs' own spans are their tracer's business: none of cronlock's.
    assert {s.name for s in exporter.get_finished_spans()} <= {"SELECT"}


class Blocking(SpanExporter):
    """An exporter whose every export hangs until released (a minute at most), then fails."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        self.release.wait(60)
        return SpanExportResult.FAILURE


async def latencies(client: httpx.AsyncClient, url: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        began = time.perf_counter()
        r = await client.post(f"{url}/cron/traced", headers={**AUTH, "traceparent": TRACEPARENT})
        out.append(time.perf_counter() - began)
        assert r.status_code == 200, r.text
    return out


async def test_an_exporter_that_blocks_slows_no_trigger(
    start: Start, client: httpx.AsyncClient
) -> None:
    """With the batch processor's worker stuck in export (and its queue overflowing), triggers
    take as long as with tracing off: export is never on their path."""
    blocking = Blocking()
    provider = TracerProvider(shutdown_on_exit=False)
    # A small queue that fills: the spans past it are dropped, not waited for.
    processor = BatchSpanProcessor(
        blocking, max_queue_size=64, max_export_batch_size=8, schedule_delay_millis=10
    )
    provider.add_span_processor(processor)
    # The job's own spans alike in both apps: none.
    trace_jobs.TRACER = trace.NoOpTracer()
    traced, plain = await start("traced", provider), await start("plain")
    try:
        await latencies(client, traced.url, 5)  # warm up, and the exporter is stuck by now
        assert blocking.calls >= 1
        rounds: dict[str, list[float]] = {"traced": [], "plain": []}
        began = time.monotonic()
        for _ in range(3):  # interleaved: load on the shared machine hits both alike
            rounds["plain"] += await latencies(client, plain.url, 30)
            rounds["traced"] += await latencies(client, traced.url, 30)
        blocked = time.monotonic() - began
        assert blocking.calls == 1  # still in its first export: blocked throughout
    finally:
        blocking.release.set()
        processor.shutdown()  # type: ignore[no-untyped-call]
    median = {k: statistics.median(v) for k, v in rounds.items()}
    print(f"exporter blocked for {blocked:.1f} s; median trigger latency (s): {median}")
    assert max(rounds["traced"]) < 2.0, median
    # Beyond noise would be milliseconds; spans cost microseconds.
    assert median["traced"] < median["plain"] * 1.5 + 0.002, median
