"""OpenTelemetry spans for triggers, runs, lease steps, fan-out items and outbox sends
(docs/tracing.md). Off unless a tracer provider is configured; OpenTelemetry is imported only
then, so cronlock runs without the `otel` extra and pays next to nothing while tracing is off.

Who decides: a `Tracing` per Cronlock (and per outbox sender), made once at start by
`Tracing.detect`: with TRACING=auto (the default) it traces with the process's global tracer
provider when one was set (a host app's, `opentelemetry-instrument`'s, or the standalone
service's own from OTEL_TRACES_EXPORTER: `sdk_from_env`); otherwise, or with TRACING=off,
it is `OFF`, whose methods hand back one shared no-op context manager.

Lease steps' spans need no Tracing object: `step_span` nests under the run that is current in
the calling task (a ContextVar the run's span sets; asyncio copies it into the tasks a run
starts), and does nothing outside a traced run. A fan-out's items run on any instance, long
after the run's span (its planning) ended there: `Tracing.item` makes each item's span a
child of the run's span through the context stored with the fan-out (`traceparent()` at
planning), as an email's send links to the run that queued it.

Export never happens on the caller's path: the SDK's BatchSpanProcessor only queues a finished
span (and drops it when its queue is full); its worker thread talks to the exporter.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from cronlock.errors import ConfigurationError
from cronlock.version import __version__

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider as SDKTracerProvider
    from opentelemetry.trace import Span as OTelSpan
    from opentelemetry.trace import Tracer, TracerProvider

    from cronlock.settings import Settings

log = logging.getLogger("cronlock.tracing")

TRACER_NAME = "cronlock"
# Attribute names: ours, under one prefix (no semantic convention covers scheduled jobs).
PREFIX = "cronlock."


class Span:
    """What cronlock does with one of its spans: attributes (None values left out) and an
    error status. `recording` is False for the no-op span tracing-off hands out."""

    __slots__ = ("_span",)
    recording = True

    def __init__(self, span: OTelSpan) -> None:
        self._span = span

    def set(self, **attributes: object) -> None:
        self._span.set_attributes(
            {PREFIX + name: _value(v) for name, v in attributes.items() if v is not None}
        )

    def fail(self, description: str | None) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_status(Status(StatusCode.ERROR, description))


class _NoSpan(Span):
    __slots__ = ()
    recording = False

    def __init__(self) -> None:
        pass

    def set(self, **attributes: object) -> None:
        pass

    def fail(self, description: str | None) -> None:
        pass


NO_SPAN: Span = _NoSpan()
# One object for every span of tracing-off: a nullcontext can be entered again and again.
_NO_SPAN_CM: AbstractContextManager[Span] = contextlib.nullcontext(NO_SPAN)
_NOTHING: AbstractContextManager[None] = contextlib.nullcontext()


def _value(value: object) -> str | bool | int | float:
    if isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


@dataclass(frozen=True, slots=True)
class _Run:
    """The traced run the current task belongs to: its tracer, and its span for links."""

    tracer: Tracer
    span: OTelSpan


_CURRENT_RUN: ContextVar[_Run | None] = ContextVar("cronlock_traced_run", default=None)


class Tracing:
    """Spans for one Cronlock (or sender), with one tracer provider; `OFF` has none."""

    def __init__(self, provider: TracerProvider | None) -> None:
        self.tracer: Tracer | None = (
            provider.get_tracer(TRACER_NAME, __version__) if provider is not None else None
        )
        # An attribute, not a property: read on every trigger.
        self.on = self.tracer is not None

    @classmethod
    def detect(cls, settings: Settings, provider: TracerProvider | None = None) -> Tracing:
        """`provider` if given (a test's, a host app's own), else the global one if set; OFF
        with TRACING=off or when there is none."""
        if settings.tracing == "off":
            return OFF
        if provider is None:
            provider = global_provider()
        return OFF if provider is None else cls(provider)

    def request(self, headers: Mapping[str, str]) -> AbstractContextManager[None]:
        """Within it, the trigger request's trace context (W3C `traceparent`, through the
        global propagator) is the parent of what starts, unless a span is current already:
        an instrumented host app's server span, itself a child of that `traceparent`."""
        if self.tracer is None:
            return _NOTHING
        return _remote_parent(headers)

    def trigger(self, job: str, source: str) -> AbstractContextManager[Span]:
        """One trigger's span: a server span for an HTTP trigger with no local parent. Its
        outcome (key, slot, skip reason...) is set at its end (cronlock/core/outcome.py)."""
        if self.tracer is None:
            return _NO_SPAN_CM
        return _trigger_span(self.tracer, job, source)

    def run(
        self,
        job: str,
        run_id: int,
        *,
        attempt: int,
        slot: datetime | None,
        key: str | None,
        trigger: str,
    ) -> AbstractContextManager[Span]:
        """One run's span, current while the job runs: the job's own (instrumented) database
        spans, its steps' and its items' nest under it, and the emails it queues link to it."""
        if self.tracer is None:
            return _NO_SPAN_CM
        attributes = {"job": job, "run_id": run_id, "attempt": attempt, "slot": slot, "key": key}
        attributes["trigger"] = trigger
        return _span(self.tracer, f"run {job}", attributes, run=True)

    def item(
        self, job: str, run_id: int, n: int, *, attempt: int, parent: str | None
    ) -> AbstractContextManager[Span]:
        """A fan-out item's span, current while the item runs (its own spans nest under it,
        the emails it queues link to it): a child of `parent`, the span of the attempt working
        the fan-out (a W3C traceparent stored with it, from whichever instance planned or
        retried it); the root of a trace of its own when that attempt was not traced."""
        if self.tracer is None:
            return _NO_SPAN_CM
        attributes = {"job": job, "run_id": run_id, "item": n, "attempt": attempt}
        return _span(
            self.tracer, f"item {job}", attributes, parent=parent, root=parent is None, run=True
        )

    def send(
        self, what: str, queued_by: Sequence[str | None], **attributes: object
    ) -> AbstractContextManager[Span]:
        """A provider request of the outbox: a client span of its own trace, linked to the
        runs that queued its emails (their `traceparent()` at enqueue)."""
        if self.tracer is None:
            return _NO_SPAN_CM
        return _span(self.tracer, what, attributes, kind="CLIENT", links=queued_by, root=True)


OFF = Tracing(None)


def global_provider() -> TracerProvider | None:
    """The process's tracer provider, if anyone set one (the API's proxy means nobody did)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    return provider


def step_span(job: str, run_id: int, step: int) -> AbstractContextManager[Span]:
    """A lease step's span, under the current traced run; no-op outside one."""
    run = _CURRENT_RUN.get()
    if run is None:
        return _NO_SPAN_CM
    return _span(run.tracer, f"step {job}", {"job": job, "run_id": run_id, "step": step})


def traceparent() -> str | None:
    """The current traced run's span (or fan-out item's) as a W3C `traceparent`, to store
    with what the run queues (an email, a fan-out's items) and link to later; None outside a
    traced run."""
    run = _CURRENT_RUN.get()
    if run is None:
        return None
    ctx = run.span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


@contextlib.contextmanager
def _remote_parent(headers: Mapping[str, str]) -> Iterator[None]:
    from opentelemetry import context, propagate, trace

    if trace.get_current_span().get_span_context().is_valid:
        yield
        return
    token = context.attach(propagate.extract(headers))
    try:
        yield
    finally:
        context.detach(token)


def _trigger_span(tracer: Tracer, job: str, source: str) -> AbstractContextManager[Span]:
    from opentelemetry import trace

    parent = trace.get_current_span().get_span_context()
    server = source == "http" and (not parent.is_valid or parent.is_remote)
    attributes = {"job": job, "source": source}
    return _span(tracer, f"trigger {job}", attributes, kind="SERVER" if server else "INTERNAL")


@contextlib.contextmanager
def _span(
    tracer: Tracer,
    name: str,
    attributes: Mapping[str, object],
    *,
    kind: str = "INTERNAL",
    links: Sequence[str | None] = (),
    root: bool = False,
    run: bool = False,
    parent: str | None = None,
) -> Iterator[Span]:
    from opentelemetry import context, trace

    with tracer.start_as_current_span(
        name,
        context=_stored(parent) if parent else context.Context() if root else None,
        kind=trace.SpanKind[kind],
        attributes={PREFIX + k: _value(v) for k, v in attributes.items() if v is not None},
        links=_links(links),
    ) as span:
        token = _CURRENT_RUN.set(_Run(tracer, span)) if run else None
        try:
            yield Span(span)
        finally:
            if token is not None:
                _CURRENT_RUN.reset(token)


def _stored(value: str) -> Any:
    """The context of a stored `traceparent`: its span as a remote parent (a malformed value
    gives an empty context, so the span starts a trace of its own)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": value})


def _links(traceparents: Sequence[str | None]) -> list[Any]:
    if not traceparents:
        return []
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    propagator = TraceContextTextMapPropagator()
    links, seen = [], set()
    for value in traceparents:
        if not value or value in seen:
            continue
        seen.add(value)
        ctx = trace.get_current_span(propagator.extract({"traceparent": value}))
        span_context = ctx.get_span_context()
        if span_context.is_valid:
            links.append(trace.Link(span_context))
    return links


@contextlib.contextmanager
def from_env() -> Iterator[None]:
    """The standalone service's (and `outbox drain`'s) own tracer provider for as long as it
    runs, when OTEL_TRACES_EXPORTER asks for one (`sdk_from_env`); flushed at the end for at
    most FLUSH_TIMEOUT seconds, so an exporter that hangs cannot hold the stop up."""
    provider = sdk_from_env()
    try:
        yield
    finally:
        if provider is not None:
            _shut_down(provider, FLUSH_TIMEOUT)


FLUSH_TIMEOUT = 5.0


def _shut_down(provider: SDKTracerProvider, timeout: float) -> None:
    # In a daemon thread: the SDK's own shutdown waits up to 30 s for a worker stuck in export.
    thread = threading.Thread(target=provider.shutdown, name="cronlock-otel-shutdown", daemon=True)
    thread.start()
    thread.join(timeout)


def sdk_from_env() -> SDKTracerProvider | None:
    """A provider of the SDK, set as the global one, when OTEL_TRACES_EXPORTER names exporters
    (`console`, `otlp` once opentelemetry-exporter-otlp is installed, ...) and none is set
    yet: the SDK's batch processor around each, the resource from OTEL_SERVICE_NAME and
    OTEL_RESOURCE_ATTRIBUTES (service name `cronlock` by default). Global, so that a job
    module's own instrumentation (asyncpg, SQLAlchemy, httpx) exports through it too."""
    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",")]
    names = [n for n in names if n and n != "none"]
    if not names or global_provider() is not None:
        return None
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider as SDKTracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ConfigurationError(
            "OTEL_TRACES_EXPORTER is set but OpenTelemetry's SDK is not installed: "
            "pip install 'cronlock[otel]'"
        ) from exc
    found = {e.name: e for e in entry_points(group="opentelemetry_traces_exporter")}
    missing = [n for n in names if n not in found]
    if missing:
        raise ConfigurationError(
            f"OTEL_TRACES_EXPORTER: no exporter named {', '.join(missing)} is installed "
            f"(installed: {', '.join(sorted(found)) or 'none'})"
        )
    resource = Resource.create(
        {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: "cronlock"}
    )
    provider = SDKTracerProvider(resource=resource, shutdown_on_exit=False)
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(found[name].load()()))
    trace.set_tracer_provider(provider)
    log.info("tracing: exporting spans with %s", ", ".join(names))
    return provider
