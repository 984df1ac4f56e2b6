"""Structured logs (key=value, one line per decision) and OpenTelemetry tracing."""

from __future__ import annotations

import logging
import sys

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "nats", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def setup_tracing(service: str) -> None:
    """A tracer provider named for the service; exporters come from the standard OTEL_* settings."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider(resource=Resource.create({"service.name": service})))


def current_traceparent() -> str | None:
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent")
