"""Service lifecycle: restore snapshot, replay the tail, mark ready, consume live, snapshot, drain.

A service is a projection (state folded from events, deterministic), an optional
reaction (side effects after an event is folded: appends, process launches), timers
(the scheduler's cycle, heartbeats), and a FastAPI router reading its projection.

Delivery is at least once. The fold is guarded by the stream sequence, so a
redelivered event is never applied twice; reactions must be idempotent. A reaction
that keeps raising is dead-lettered after ``max_deliver`` attempts, with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import signal
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from fastapi import APIRouter, FastAPI, Response
from nats.aio.msg import Msg
from pydantic_core import from_json, to_json
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared.eventlog import EventLog, Record, Undecodable
from shared.events import REGISTRY, Envelope, Event
from shared.telemetry import current_traceparent

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger("gpuorch.runtime")


class Projection:
    """State folded from events. ``apply`` is a deterministic function of (state, event).

    Subclasses write ``on_<aggregate>_<verb>(self, env, event)`` methods (for
    ``job.placed``: ``on_job_placed``) and ``state()``/``load()`` for snapshots and
    digests. A method calls ``self.invalid(env, why)`` for a transition that must not
    happen (a GPU already taken, a job already ended): the event is recorded and
    changes nothing.
    """

    name: ClassVar[str] = "projection"
    _dispatch: ClassVar[dict[type[Event], str]] = {}
    MAX_INVALID = 1000

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls._dispatch = {
            ev: f"on_{ev.TYPE.replace('.', '_')}" for ev in REGISTRY.values() if hasattr(cls, f"on_{ev.TYPE.replace('.', '_')}")
        }

    def __init__(self) -> None:
        self.seq = 0
        self.applied = 0
        self.invalid_count = 0
        self.invalid_transitions: list[str] = []
        self.epochs: dict[str, int] = {}

    def apply(self, env: Envelope) -> bool:
        """Fold one event; False if it was at or below the last applied sequence (a redelivery)."""
        if env.seq and env.seq <= self.seq:
            return False
        if env.seq:
            self.seq = env.seq
        if env.epoch is not None:
            seen = self.epochs.get(env.source, 0)
            if env.epoch < seen:
                self.invalid(env, f"stale leader epoch {env.epoch} < {seen}")
                return True
            self.epochs[env.source] = env.epoch
        method = self._dispatch.get(type(env.data))
        self.applied += 1
        if method is not None:
            getattr(self, method)(env, env.data)
        return True

    def skip(self, seq: int) -> None:
        """Advance past an event this code cannot read."""
        self.seq = max(self.seq, seq)

    def invalid(self, env: Envelope, why: str) -> None:
        self.invalid_count += 1
        if len(self.invalid_transitions) < self.MAX_INVALID:
            self.invalid_transitions.append(f"seq={env.seq} {env.type} {env.subject}: {why}")

    # --- state -----------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {}

    def load(self, state: dict[str, Any]) -> None:
        pass

    def digest(self) -> str:
        """sha256 of the canonical state; cached per position, since a poll of /v1/services should not refold."""
        key = (self.seq, self.applied, self.invalid_count)
        if getattr(self, "_digest_key", None) != key:
            body = {"applied": self.applied, "invalid": self.invalid_count, "state": self.state()}
            self._digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
            self._digest_key = key
        return self._digest

    def snapshot(self) -> bytes:
        return to_json(
            {
                "seq": self.seq,
                "applied": self.applied,
                "invalid_count": self.invalid_count,
                "invalid": self.invalid_transitions,
                "epochs": self.epochs,
                "state": self.state(),
            },
        )

    def restore(self, blob: bytes) -> None:
        doc = from_json(blob)
        self.seq, self.applied = doc["seq"], doc["applied"]
        self.invalid_count, self.invalid_transitions = doc["invalid_count"], doc["invalid"]
        self.epochs = doc["epochs"]
        self.load(doc["state"])


class Metrics:
    """Prometheus metrics of one process; every series carries the service's name."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.applied = Counter("gpuorch_events_applied", "Events folded into a projection", ["service"], registry=r)
        self.skipped = Counter("gpuorch_events_skipped", "Events skipped (unknown type, malformed)", ["service", "reason"], registry=r)
        self.invalid = Gauge("gpuorch_invalid_transitions", "Events that asked for an impossible transition", ["service"], registry=r)
        self.dead = Counter("gpuorch_events_dead_lettered", "Events dead-lettered after repeated reaction failures", ["service"], registry=r)
        self.reaction_errors = Counter("gpuorch_reaction_errors", "Reactions that raised", ["service"], registry=r)
        self.seq = Gauge("gpuorch_projection_seq", "Last stream sequence folded", ["service"], registry=r)
        self.ready = Gauge("gpuorch_ready", "1 once the service has caught up with the log", ["service"], registry=r)
        self.replay_seconds = Gauge("gpuorch_replay_seconds", "Seconds the start-up replay took", ["service"], registry=r)
        self.cycle_seconds = Histogram("gpuorch_cycle_seconds", "Duration of a decision cycle", ["service"], registry=r)


Reaction = Callable[[Envelope], Awaitable[None]]


class Service:
    """A named projection with its reaction, timers and HTTP router, run against the event log."""

    def __init__(
        self,
        name: str,
        projection: Projection,
        *,
        reaction: Reaction | None = None,
        timers: list[Callable[["Service"], Awaitable[None]]] | None = None,
        router: Callable[["Service"], APIRouter] | None = None,
        snapshot_every: int = 10_000,
        max_deliver: int = 5,
        metrics: Metrics | None = None,
        instance: str | None = None,
    ) -> None:
        self.name = name
        # each replica has its own durable consumer: replicas sharing one would split the stream between them
        self.instance = re.sub(r"[^A-Za-z0-9_-]", "_", instance if instance is not None else socket.gethostname())
        self.projection = projection
        self.reaction = reaction
        self.timers = timers or []
        self.router_factory = router
        self.snapshot_every = snapshot_every
        self.max_deliver = max_deliver
        self.log: EventLog | None = None
        self.metrics = metrics or Metrics()
        m = self.metrics  # the hot path's labelled series, looked up once
        self._series = (m.applied.labels(name), m.seq.labels(name), m.invalid.labels(name))
        self.ready = asyncio.Event()
        self.stop_event = asyncio.Event()
        self.changed = asyncio.Event()  # set on every folded event: timers wait on it to debounce
        self._since_snapshot = 0

    # --- lifecycle -------------------------------------------------------------------

    async def run(self, log_: EventLog) -> None:
        """Restore, replay, then consume live until ``stop()``; snapshot on the way out."""
        self.log = log_
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        restored = await log_.load_snapshot(self.name)
        if restored is not None:
            self.projection.restore(restored[1])
        async for rec in log_.replay(self.projection.seq + 1):
            self._fold(rec)
        self.metrics.replay_seconds.labels(self.name).set(loop.time() - t0)
        log.info("service=%s ready seq=%d replay_s=%.3f restored=%s", self.name, self.projection.seq, loop.time() - t0, restored is not None)
        self.ready.set()
        self.metrics.ready.labels(self.name).set(1)
        timers = [asyncio.create_task(t(self), name=f"{self.name}-timer") for t in self.timers]
        try:
            await log_.consume(
                f"svc-{self.name}-{self.instance}" if self.instance else f"svc-{self.name}",
                self._on_message,
                start_seq=self.projection.seq + 1,
                max_deliver=self.max_deliver,
                stop=self.stop_event,
            )
        finally:
            for t in timers:
                t.cancel()
            if timers:
                _, stuck = await asyncio.wait(timers, timeout=5)
                for t in stuck:
                    log.error("service=%s timer=%s did not stop within 5 s", self.name, t.get_coro())
            await self.save_snapshot()

    def stop(self) -> None:
        self.stop_event.set()

    async def save_snapshot(self) -> None:
        if self.log is None or self.projection.seq == 0:
            return
        try:
            await self.log.save_snapshot(self.name, self.projection.seq, self.projection.snapshot())
            self._since_snapshot = 0
        except Exception as e:  # noqa: BLE001 - a failed snapshot costs replay time, not correctness
            log.warning("service=%s snapshot failed error=%r", self.name, e)

    # --- events ----------------------------------------------------------------------

    def _fold(self, rec: Record) -> Envelope | None:
        if isinstance(rec, Undecodable):
            if rec.seq > self.projection.seq:
                self.projection.skip(rec.seq)
                reason = "unknown_type" if rec.unknown_type else "malformed"
                self.metrics.skipped.labels(self.name, reason).inc()
                log.warning("service=%s skipped seq=%d reason=%r", self.name, rec.seq, rec.reason)
            return None
        if self.projection.apply(rec):
            applied, seq, invalid = self._series
            applied.inc()
            seq.set(self.projection.seq)
            invalid.set(self.projection.invalid_count)
            self._since_snapshot += 1
            self.changed.set()
        return rec

    async def _on_message(self, rec: Record, msg: Msg) -> None:
        env = self._fold(rec)
        if env is not None and self.reaction is not None:
            try:
                await self.reaction(env)
            except Exception as e:  # noqa: BLE001 - any reaction failure is retried, then dead-lettered
                self.metrics.reaction_errors.labels(self.name).inc()
                attempts = msg.metadata.num_delivered
                log.warning("service=%s reaction failed seq=%d type=%s attempt=%d error=%r", self.name, env.seq, env.type, attempts, e)
                if attempts >= self.max_deliver:
                    assert self.log is not None
                    await self.log.dead_letter(msg, self.name, f"{type(e).__name__}: {e}")
                    self.metrics.dead.labels(self.name).inc()
                else:
                    await msg.nak(delay=min(0.1 * 2**attempts, 5))
                return
        await msg.ack()
        if self._since_snapshot >= self.snapshot_every:
            await self.save_snapshot()

    async def caught_up(self, seq: int, timeout: float = 2.0) -> bool:
        """Wait until this service has folded ``seq`` (read-your-writes for an API that just appended)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.projection.seq < seq:
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    async def emit(self, *events: Event, expected_last_subject_seq: int | None = None, epoch: int | None = None) -> list[int]:
        """Append events as this service (source ``/gpuorch/<name>``); one with an expected sequence is checked."""
        assert self.log is not None, "service is not running"
        envs = [Envelope(e, source=f"/gpuorch/{self.name}", epoch=epoch, traceparent=current_traceparent()) for e in events]
        if len(envs) == 1:
            return [await self.log.append(envs[0], expected_last_subject_seq)]
        return await self.log.append_many(envs)

    def status(self) -> dict[str, Any]:
        return {
            "service": self.name,
            "ready": self.ready.is_set(),
            "seq": self.projection.seq,
            "applied": self.projection.applied,
            "digest": self.projection.digest(),
            "invalid_transitions": self.projection.invalid_count,
        }


def ops_router(services: list[Service]) -> APIRouter:
    """/healthz, /readyz and /metrics for the services of this process."""
    r = APIRouter()

    @r.get("/healthz", tags=["ops"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @r.get("/metrics", tags=["ops"])
    def metrics() -> Response:
        registries = {id(s.metrics.registry): s.metrics.registry for s in services}
        body = b"".join(generate_latest(reg) for reg in registries.values())
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    if not services:  # a gateway answers readiness for the processes behind it
        return r

    @r.get("/readyz", tags=["ops"])
    def readyz(response: Response) -> dict[str, Any]:
        ready = all(s.ready.is_set() for s in services)
        response.status_code = 200 if ready else 503
        return {"ready": ready, "services": {s.name: s.ready.is_set() for s in services}}

    @r.get("/v1/services", tags=["ops"])
    def service_status() -> list[dict[str, Any]]:
        return [s.status() for s in services]

    return r


def build_app(services: list[Service], extra_routers: list[APIRouter] = ()) -> FastAPI:
    app = FastAPI(title="gpuorch", version="0.1.0")
    app.include_router(ops_router(services))
    for s in services:
        if s.router_factory is not None:
            app.include_router(s.router_factory(s))
    for r in extra_routers:
        app.include_router(r)
    return app


async def run_process(
    services: list[Service],
    log_: EventLog,
    host: str,
    port: int,
    extra_routers: list[APIRouter] = (),
    started: Callable[[], None] | None = None,
    signals: "StopSignals | None" = None,
) -> None:
    """Serve the services' HTTP API on host:port and run them until SIGINT/SIGTERM (``signals``: installed earlier)."""
    server = http_server(build_app(services, list(extra_routers)), host, port)
    tasks = [asyncio.create_task(s.run(log_), name=f"svc-{s.name}") for s in services]

    async def _watch() -> None:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                log.error("service=%s crashed error=%r", t.get_name(), t.exception())
                server.should_exit = True

    watcher = asyncio.create_task(_watch())
    if started is not None:
        started()
    try:
        await serve_until_signal(server, signals)
    finally:
        for s in services:
            s.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        watcher.cancel()


def http_server(app: FastAPI, host: str, port: int) -> "uvicorn.Server":
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn minus its own signal capture, which re-raises the signal after shutdown
        (a SIGTERM would then kill the process before the services drain and snapshot)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))


class StopSignals:
    """SIGINT and SIGTERM, caught from the first line of a process's main coroutine.

    A signal while the process is still starting (connecting, replaying) is kept
    and stops the server the moment it serves: asyncio.run's own handler would
    cancel the main task instead, and a cancellation can be lost inside a library's
    wait_for. A second signal forces the exit.
    """

    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self.server: "uvicorn.Server | None" = None
        self.loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(sig, self.on_signal)

    def on_signal(self) -> None:
        if self.server is not None:
            self.server.force_exit = self.server.should_exit
            self.server.should_exit = True
        self.requested.set()

    def close(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.remove_signal_handler(sig)


async def serve_until_signal(server: "uvicorn.Server", signals: StopSignals | None = None) -> None:
    """Serve until SIGINT or SIGTERM (also one received before serving began); a second signal forces the exit."""
    signals = signals or StopSignals()
    signals.server = server
    server.should_exit = signals.requested.is_set()
    try:
        await server.serve()
    finally:
        signals.close()
