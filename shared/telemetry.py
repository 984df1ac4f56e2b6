"""Structured logs (key=value, one line per decision) and OpenTelemetry traces.

Tracing is off unless OTEL_TRACES_EXPORTER names an exporter: then ``setup_tracing`` installs the SDK's tracer
provider. Off, no provider is installed and every helper here returns at its first line (no span, no context).
A trace's context travels in each event it causes (W3C ``traceparent``, docs/observability.md).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import socket
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ContextManager

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from shared.events import Envelope

log = logging.getLogger("gpuorch.telemetry")
_propagator = TraceContextTextMapPropagator()


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "nats", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def setup_tracing(service: str, instance: str | None = None) -> None:
    """Install a tracer provider for this process (resource ``service.name``, ``service.instance.id``) when
    OTEL_TRACES_EXPORTER names exporters (otlp, console; default none: tracing off). The SDK reads the rest of the
    standard settings itself: OTEL_TRACES_SAMPLER(_ARG) (default parentbased_always_on), OTEL_EXPORTER_OTLP_*
    (endpoint, headers, protocol: http/protobuf by default here; grpc with opentelemetry-exporter-otlp-proto-grpc
    installed), OTEL_BSP_* (the batch span processor), OTEL_RESOURCE_ATTRIBUTES."""
    if tracing_on():
        return  # installed already (a test's provider, or a second call)
    wanted = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "none").split(",") if n.strip()]
    if not wanted or wanted == ["none"] or os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return
    from opentelemetry.sdk._configuration import _get_exporter_entry_point, _import_exporters
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if not (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")):
        wanted = ["otlp_proto_http" if n == "otlp" else n for n in wanted]  # the spec's default; the SDK's is grpc
    try:
        exporters, _, _ = _import_exporters([_get_exporter_entry_point(n, "traces") for n in wanted], [], [])
    except (RuntimeError, ImportError) as e:  # an exporter whose package is missing: the service runs on, untraced, and says why
        log.error("event=tracing_off reason=%r advice='pip install opentelemetry-exporter-otlp-proto-grpc for "
                  "OTEL_EXPORTER_OTLP_PROTOCOL=grpc'", str(e))
        return
    instance = instance or f"{socket.gethostname()}-{os.getpid()}"
    provider = TracerProvider(resource=Resource.create({"service.name": service, "service.instance.id": instance}))
    for exporter in exporters.values():
        provider.add_span_processor(BatchSpanProcessor(exporter()))
    trace.set_tracer_provider(provider)
    # the exporters' modules (protobuf's) are many objects that live as long as the process: frozen, the cyclic
    # collector stops walking them at every full collection (unfrozen, they made a batched append 20 % slower
    # with tracing on than off: bench.eventlog; docs/observability.md)
    gc.freeze()
    log.info("event=tracing_on service=%s exporters=%s", service, ",".join(exporters))


def tracing_on() -> bool:
    return isinstance(trace.get_tracer_provider(), TracerProvider)


def in_trace() -> bool:
    """Tracing is on and a span is current: what happens now belongs to a trace."""
    return tracing_on() and trace.get_current_span().get_span_context().is_valid


@functools.lru_cache(maxsize=4)
def _tracer(provider: trace.TracerProvider) -> trace.Tracer:
    return provider.get_tracer("gpuorch")


def current_traceparent() -> str | None:
    """The current span's W3C traceparent (what the propagator would inject, without its machinery)."""
    if not tracing_on():
        return None
    ctx = trace.get_current_span().get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}" if ctx.is_valid else None


def _context(traceparent: str | None) -> Context | None:
    return _propagator.extract({"traceparent": traceparent}) if traceparent else None


@contextlib.contextmanager
def span(name: str, parent: str | None = None, *, kind: SpanKind = SpanKind.INTERNAL, root: bool = False,
         link_current: bool = False, start_time: int | None = None,
         attributes: Mapping[str, Any] | None = None) -> Iterator[str | None]:
    """A span, current inside the block: a child of ``parent`` (a traceparent), else of the current span (``root``:
    of none, a new trace); ``link_current``: linked to the current span. Yields its traceparent (None: off)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        yield None
        return
    current = trace.get_current_span().get_span_context()
    links = [Link(current)] if link_current and current.is_valid else []
    ctx = Context() if root else _context(parent)
    with _tracer(provider).start_as_current_span(name, context=ctx, kind=kind, links=links, attributes=attributes,
                                                 start_time=start_time):
        yield current_traceparent()


def _destination(subject: str) -> str:
    return subject.rsplit(".", 1)[0]  # the subject less its id: span names stay few


def publishing(subject: str, parent: str | None, count: int = 1, message_id: str | None = None
               ) -> ContextManager[str | None]:
    """The PRODUCER span of an append (``count`` events on ``subject``'s stream): a child of ``parent``, the
    event's own context, else of the current span; the events carry its traceparent. None outside a trace: an
    append that no request, cycle or event caused (a benchmark's, a registration) starts none."""
    if parent is None and not in_trace():
        return contextlib.nullcontext()
    attributes: dict[str, Any] = {"messaging.system": "nats", "messaging.destination.name": subject,
                                  "messaging.operation.type": "send", "messaging.operation.name": "publish"}
    if count > 1:
        attributes["messaging.batch.message_count"] = count
    if message_id:
        attributes["messaging.message.id"] = message_id
    return span(f"publish {_destination(subject)}", parent, kind=SpanKind.PRODUCER, attributes=attributes)


def processing(subject: str, traceparent: str | None, consumer: str) -> ContextManager[str | None]:
    """The CONSUMER span of handling one event (a reaction, a relay), in the trace of the event's ``traceparent``;
    nothing for an event that carries none."""
    if not traceparent or not tracing_on():
        return contextlib.nullcontext()
    return span(f"process {_destination(subject)}", traceparent, kind=SpanKind.CONSUMER, attributes={
        "messaging.system": "nats", "messaging.destination.name": subject, "messaging.operation.type": "process",
        "messaging.operation.name": "process", "messaging.consumer.group.name": consumer})


def new_trace(name: str, **attributes: Any) -> str | None:
    """A new trace's root span, linked to the current span, ended at once; its traceparent (a job of a batch)."""
    with span(name, root=True, link_current=True, attributes=attributes) as traceparent:
        return traceparent


class JobTraces:
    """Each live job's trace context, noted from its first traced event seen live, so that what a cycle or a round
    decides about the job later (placement, preemption, requeue) continues the job's trace, linked to the cycle.
    A process that started after the job was submitted has none for it: its decision is then a child of the
    current span."""

    ENDED = ("job.succeeded", "job.failed", "job.cancelled", "job.rejected")

    def __init__(self) -> None:
        self.by_job: dict[str, str] = {}

    def note(self, env: "Envelope") -> None:
        job_id = getattr(env.data, "job_id", None)
        if job_id is None or not tracing_on():
            return
        if env.data.TYPE in self.ENDED:
            self.by_job.pop(job_id, None)
        elif env.traceparent:
            self.by_job.setdefault(job_id, env.traceparent)

    def expect(self, envs: "list[Envelope]") -> None:
        """Note the jobs of events about to be appended, in the submitting request's trace: a cycle can place a job
        between the fold of its submission and the reaction that notes it live, and its placement then left the
        job's trace (a test that failed once in CI: every span after the placement in another trace)."""
        if not tracing_on():
            return
        fallback = current_traceparent()
        for env in envs:
            job_id = getattr(env.data, "job_id", None)
            if job_id is not None and (context := env.traceparent or fallback):
                self.by_job.setdefault(job_id, context)

    def forget(self, envs: "list[Envelope]") -> None:
        """Undo ``expect`` for events that were not appended."""
        for env in envs:
            self.by_job.pop(getattr(env.data, "job_id", ""), None)

    def span(self, name: str, job_id: str, **attributes: Any) -> ContextManager[str | None]:
        """A decision's span in the job's trace, linked to the current span (the cycle's)."""
        if not tracing_on():
            return contextlib.nullcontext()
        return span(name, self.by_job.get(job_id), link_current=True,
                    attributes={"gpuorch.job.id": job_id, **attributes})
