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
import heapq
import itertools
import logging
import re
import signal
import socket
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Response
from fastapi.responses import PlainTextResponse
from nats.aio.msg import Msg
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared import api_errors
from shared.aio import Window
from shared.auth import Authenticator, Principal, authorize, caller
from shared.eventlog import EventLog, Record, Undecodable
from shared.events import Envelope, Event
from shared.instance import INSTANCE_BUCKET, INSTANCE_TTL_S, InstanceLock, InstanceTaken
from shared.projection import Projection, SnapshotUnusable, digest_parts, encode_json, state_digest
from shared.telemetry import current_traceparent

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger("gpuorch.runtime")

STOP_TIMEOUT_S = 15  # the most a service may take to stop before it is cancelled (run_process)
TIMER_RECANCEL_S = 0.1  # a stopping service cancels a timer again this often while it runs on (_stop_timers)


class NotCaughtUp(api_errors.Unavailable):
    """The service has not folded an event it waited for (its own append, the log's head) within the timeout."""

    def __init__(self, service: str, folded: int, wanted: int, timeout: float, advice: str = "retry") -> None:
        super().__init__(f"the {service} service has not caught up with the log (seq {folded} < {wanted}) within "
                         f"{timeout:.2g} s; {advice}")
        self.service, self.folded, self.wanted = service, folded, wanted


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
        self.lag = Gauge("gpuorch_projection_lag_events", "Events in the log not folded yet: the stream's last sequence "
                         "minus the projection's, at scrape time", ["service"], registry=r)
        self._owned: dict[str, Any] = {}

    def own(self, key: str, make: Callable[[CollectorRegistry], Any]) -> Any:
        """A service's own metrics or collector on this registry, made once per process: two replicas of a service in
        one process (tests) share them rather than registering the same series twice."""
        if key not in self._owned:
            self._owned[key] = make(self.registry)
        return self._owned[key]

    async def update_lag(self, services: "list[Service]", timeout: float = 1.0) -> None:
        """Each service's lag behind the log's head (one stream-info request per event log); left as it was when the
        log does not answer within ``timeout``."""
        heads: dict[int, int | None] = {}
        for s in services:
            if s.log is None or not s.follows_log:  # an agent folds no log: it has no lag to tell
                continue
            if id(s.log) not in heads:
                try:
                    heads[id(s.log)] = await asyncio.wait_for(s.log.last_seq(), timeout)
                except Exception as e:  # noqa: BLE001 - NATS away: /readyz says so; the scrape still answers
                    log.debug("event=lag_unknown service=%s error=%r", s.name, e)
                    heads[id(s.log)] = None
            head = heads[id(s.log)]
            if head is not None:
                self.lag.labels(s.name).set(max(0, head - s.projection.seq))


Reaction = Callable[[Envelope], Awaitable[None]]
T = TypeVar("T")


class Fold:
    """A projection and the services of one process that read it (``fold_once``): each event is folded once,
    by whichever of their consumers delivers it first; to the others it is already folded, and they run their
    reactions only, as for a redelivery. Restored and replayed once, by the first service to start; snapshotted
    under one name."""

    def __init__(self, projection: Projection, snapshot_name: str) -> None:
        self.projection = projection
        self.snapshot_name = snapshot_name
        self.services: list[Service] = []
        self.starting = asyncio.Lock()  # one service restores and replays; the others wait, then replay the rest
        self.restored = False
        self.since_snapshot = 0  # events folded since the last snapshot
        self.running = 0  # services consuming: the last one to stop takes the snapshot
        # set while folds may run; cleared while a thread reads the projection for a snapshot (save_snapshot): every
        # fold of the process waits for it, so that the snapshot is the state at one sequence
        self.open = asyncio.Event()
        self.open.set()
        self.readers = 0  # threads reading the projection now (Service.read_in_thread): open again at none
        # folds waiting for those readers; while there are any, no new reader starts (``read_gate``): reads that
        # kept overlapping (32 clients polling /v1/queues) held every fold, and every POST waiting for one, seconds
        self.folds_waiting = 0
        self.drained = asyncio.Event()  # set while no fold waits
        self.drained.set()
        self.snapshotting = asyncio.Lock()  # one snapshot at a time
        self.digesting = asyncio.Lock()  # one encoding of the digests' parts at a time (``statuses``)

    async def turn(self) -> None:
        """Until no thread reads the projection: a fold's turn. The readers that arrive meanwhile wait for it."""
        self.folds_waiting += 1
        self.drained.clear()
        try:
            while not self.open.is_set():
                await self.open.wait()
        finally:
            self.folds_waiting -= 1
            if not self.folds_waiting:
                self.drained.set()

    async def read_gate(self) -> None:
        """Until no fold waits: a reader's turn (readers alone would take turns forever, and no fold would run)."""
        while self.folds_waiting:
            await self.drained.wait()


def fold_once(services: list["Service"]) -> None:
    """Let the services of one process share one projection: an instance of every one of their projection
    classes (cooperative subclasses of one base, combined by multiple inheritance), folded once per event. Each
    service's digest stays that of its own class's state. Call before they run."""
    if len(services) < 2:
        return
    classes = list(dict.fromkeys(type(s.projection) for s in services))
    leaves = tuple(c for c in classes if not any(o is not c and issubclass(o, c) for o in classes))
    try:
        kind = leaves[0] if len(leaves) == 1 else type("ProcessProjection", leaves, {"name": "process"})
    except TypeError as e:  # no consistent method order: these projections cannot be one
        log.warning("fold_once=off services=%s reason=%r", ",".join(s.name for s in services), str(e))
        return
    fold = Fold(kind(), "+".join(sorted(s.name for s in services)))
    for s in services:
        s.state_keys = frozenset(type(s.projection)().state()) if kind is not type(s.projection) else None
        s.fold = fold
        fold.services.append(s)


class SnapshotStore:
    """Snapshots in a local directory (one file per service), for a process that may not write the bus's store."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    async def load_snapshot(self, name: str) -> tuple[int, bytes] | None:
        try:
            blob = (self.directory / f"{name}.snapshot").read_bytes()
        except FileNotFoundError:
            return None
        return 0, blob

    async def save_snapshot(self, name: str, seq: int, state: bytes) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.directory / f"{name}.snapshot.tmp"
        tmp.write_bytes(state)
        tmp.replace(self.directory / f"{name}.snapshot")


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
        snapshots: "SnapshotStore | None" = None,
        exclusive: bool = True,
        follows_log: bool = True,
        reactions_at_once: int = 1,
        watch: Callable[[Envelope], None] | None = None,
    ) -> None:
        """``snapshots``: where this service keeps its snapshot (default: the bus's object store); ``exclusive``:
        hold the instance name while running (``shared.instance``), so that no two processes share a consumer;
        ``follows_log``: False for a process that reads no event log (a node agent): only its timers run;
        ``reactions_at_once``: reactions that may run together, each settling its own event, while the folds go on
        in order (for a reaction that is correct in any order, such as inventory's work writes); ``watch``: called
        with each event as this process first folds it, live (not on replay, not again on a redelivery), by
        whichever service of the process delivered it: for what needs no delivery guarantee (wake a loop, note a
        trace). A service whose only reaction is a watch needs no consumer beside one that has a reaction."""
        self.name = name
        self.exclusive = exclusive
        self.follows_log = follows_log
        self.reactions_at_once = reactions_at_once
        self.reacting = Window(reactions_at_once)  # reactions running beside the fold (reactions_at_once > 1)
        self.snapshots = snapshots
        # each replica has its own durable consumer: replicas sharing one would split the stream between them
        self.instance = re.sub(r"[^A-Za-z0-9_-]", "_", instance if instance is not None else socket.gethostname())
        self.fold = Fold(projection, name)
        self.fold.services.append(self)
        self.state_keys: frozenset[str] | None = None  # this service's part of a shared projection's state
        self.reaction = reaction
        self.watch = watch
        self.timers = timers or []
        self.router_factory = router
        self.snapshot_every = snapshot_every
        self.max_deliver = max_deliver
        self.log: EventLog | None = None
        self.metrics = metrics or Metrics()
        m = self.metrics  # the hot path's labelled series, looked up once
        self._applied = m.applied.labels(name)
        # read at scrape time: the projection may be folded by another service of the process (fold_once)
        m.seq.labels(name).set_function(lambda: self.projection.seq)
        m.invalid.labels(name).set_function(lambda: self.projection.invalid_count)
        self.ready = asyncio.Event()
        self.stop_event = asyncio.Event()
        self.changed = asyncio.Event()  # set on every folded event: timers wait on it to debounce
        self.catch_up_timeout_s = 2.0  # how long caught_up waits for the fold by default
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []  # heap of caught_up calls: (seq, tie, wake)
        self._tie = itertools.count()

    @property
    def projection(self) -> Projection:
        return self.fold.projection

    # --- lifecycle -------------------------------------------------------------------

    async def run(self, log_: EventLog) -> None:
        """Take the instance name, restore, replay, then consume live until ``stop()``; snapshot on the way out.
        Raises InstanceTaken if another live process holds the name (or takes it while this one stalls)."""
        if not self.exclusive:
            return await self._serve(log_)
        lock = InstanceLock(await log_.kv(INSTANCE_BUCKET, ttl=INSTANCE_TTL_S), self.name, self.instance or "-")
        await lock.acquire()
        keeper = asyncio.create_task(lock.keep(), name=f"{self.name}-instance")
        keeper.add_done_callback(lambda t: t.cancelled() or self.stop())  # it ends by itself only when the name is lost
        try:
            await self._serve(log_)
        finally:
            lost = keeper.exception() if keeper.done() and not keeper.cancelled() else None
            lock.stopping = True
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            await lock.release()
        if lost is not None:
            raise lost

    async def _serve(self, log_: EventLog) -> None:
        self.log = log_
        if not self.follows_log:
            return await self._run_timers()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        restored = False
        async with self.fold.starting:
            if not self.fold.restored:
                self.fold.restored = restored = await self._restore(log_)
            async for rec in log_.replay(self.projection.seq + 1):
                if not self.fold.open.is_set():  # another service of the process is taking a snapshot
                    await self.fold.turn()
                self._fold(rec)
        self.metrics.replay_seconds.labels(self.name).set(loop.time() - t0)
        log.info("service=%s ready seq=%d replay_s=%.3f restored=%s", self.name, self.projection.seq, loop.time() - t0, restored)
        self.ready.set()
        self.metrics.ready.labels(self.name).set(1)
        timers = self._start_timers()
        self.fold.running += 1
        try:
            if self.rides_along():
                await self.stop_event.wait()
            else:
                await log_.consume(
                    f"svc-{self.name}-{self.instance}" if self.instance else f"svc-{self.name}",
                    self._on_message,
                    start_seq=self.projection.seq + 1,
                    max_deliver=self.max_deliver,
                    stop=self.stop_event,
                )
        finally:
            await self.reacting.drain(5)  # reactions under way settle their events (or come again at the next start)
            await self._stop_timers(timers)
            self.fold.running -= 1
            if not self.fold.running:
                await self.save_snapshot()

    def rides_along(self) -> bool:
        """True for a service without a reaction (a watch at most) whose projection another service of the process
        folds with a consumer of its own (``fold_once``): a consumer of its own would only deliver and ack every
        event again (quota, autoscaler and health beside the scheduler in ``gpuorch up``: three in five deliveries
        of every event)."""
        return self.reaction is None and any(s is not self and s.reaction is not None and s.follows_log
                                             for s in self.fold.services)

    async def _run_timers(self) -> None:
        self.ready.set()
        self.metrics.ready.labels(self.name).set(1)
        timers = self._start_timers()
        try:
            await self.stop_event.wait()
        finally:
            await self._stop_timers(timers)

    def _start_timers(self) -> list[asyncio.Task]:
        return [asyncio.create_task(t(self), name=f"{self.name}-timer") for t in self.timers]

    async def _stop_timers(self, timers: list[asyncio.Task]) -> None:
        """Cancel the timers, again every TIMER_RECANCEL_S while one runs on, up to 5 s: a cancellation can be lost
        (Python 3.11's ``asyncio.wait_for``, inside nats-py's requests, returns the result that arrived with it), and
        a timer that loops for ever then never ended (the split scheduler's ``keep_history`` held every Ctrl-C 5 s)."""
        loop = asyncio.get_running_loop()
        deadline, stuck = loop.time() + 5, set(timers)
        while stuck and loop.time() < deadline:
            for t in stuck:
                t.cancel()
            _, stuck = await asyncio.wait(stuck, timeout=min(TIMER_RECANCEL_S, max(0.0, deadline - loop.time())))
        for t in stuck:
            where = " -> ".join(awaiting(t.get_coro()))
            log.error("service=%s timer=%s did not stop within 5 s (at %s)", self.name, t.get_coro(), where)

    async def _restore(self, log_: EventLog) -> bool:
        """Load the latest snapshot, parsed in a thread (the event loop keeps answering); False if there is none
        this code can read."""
        found = await (self.snapshots or log_).load_snapshot(self.fold.snapshot_name)
        if found is None:
            return False
        try:
            self.projection.adopt(await asyncio.to_thread(self.projection.loaded, found[1]))
        except SnapshotUnusable as e:  # a snapshot is a shortcut: the log alone rebuilds the same state
            log.warning("service=%s snapshot ignored reason=%r action=full_replay", self.name, str(e))
            return False
        return True

    def stop(self) -> None:
        self.stop_event.set()

    async def save_snapshot(self) -> None:
        """Save the projection's snapshot. It is written in a thread (0.5 s and more for 20,000 jobs: on the event
        loop, every request waited that long), while every fold of the process waits (``Fold.open``): the
        thread reads the projection as it is at one sequence. The loop keeps serving meanwhile; only folding waits."""
        if self.log is None or self.projection.seq == 0:
            return
        fold = self.fold
        fold.since_snapshot = 0
        async with fold.snapshotting:
            try:
                seq, blob = await self._snapshot_in_thread()
                await (self.snapshots or self.log).save_snapshot(fold.snapshot_name, seq, blob)
            except Exception as e:  # noqa: BLE001 - a failed snapshot costs replay time, not correctness
                log.warning("service=%s snapshot failed error=%r", self.name, e)

    async def _snapshot_in_thread(self) -> tuple[int, bytes]:
        """(sequence, snapshot): its document copied out in a thread while no fold runs (``read_in_thread``), then
        encoded in a thread while the folds go on (it shares nothing with the projection). Under load the held part
        is what every request waiting for a fold waits out: it was the whole encoding (645 ms seen at 10,000 jobs)."""
        proj = self.projection
        seq, doc = await self.read_in_thread(lambda: (proj.seq, proj.snapshot_document()))
        return seq, await asyncio.to_thread(encode_json, doc)

    async def read_in_thread(self, read: Callable[[], T]) -> T:
        """``read()`` (which reads the projection and changes nothing) in a thread while no fold of the process
        runs: the event loop keeps answering meanwhile, where a long read on it (a snapshot, a scheduling cycle
        over 20,000 pending jobs) held every request up to seconds. The folds resume when the last such thread is
        done, not before, even if this is cancelled (a stop that took too long): the thread still reads."""
        fold = self.fold
        await fold.read_gate()
        fold.readers += 1
        fold.open.clear()

        def release(_: object = None) -> None:
            fold.readers -= 1
            if not fold.readers:
                fold.open.set()
        try:
            done = asyncio.get_running_loop().run_in_executor(None, read)
        except BaseException:
            release()
            raise
        done.add_done_callback(release)
        return await asyncio.shield(done)

    # --- events ----------------------------------------------------------------------

    def _fold(self, rec: Record) -> Envelope | None:
        """Fold one record; the envelope for the reaction, or None: unreadable, or recorded invalid."""
        if isinstance(rec, Undecodable):
            if rec.seq > self.projection.seq:
                self.projection.skip(rec.seq, rec.subject)
                reason = "unknown_type" if rec.unknown_type else "malformed"
                self.metrics.skipped.labels(self.name, reason).inc()
                log.warning("service=%s skipped seq=%d reason=%r", self.name, rec.seq, rec.reason)
                self._folded(changed=False)
            return None
        if rec.seq and rec.seq <= self.projection.seq:  # a redelivery: its reaction runs again, unless it was rejected
            return None if self.projection.was_rejected(rec.seq) else rec
        valid = self.projection.apply(rec)
        self._applied.inc()  # a rejected event is folded too: the position moved past it
        self.fold.since_snapshot += 1
        self._folded(changed=True)
        return rec if valid else None

    def _folded(self, changed: bool) -> None:
        """Tell every service reading this projection that it moved: its timers, its caught_up calls."""
        for s in self.fold.services:
            if changed:
                s.changed.set()
            s._wake()

    async def _on_message(self, rec: Record, msg: Msg) -> None:
        if not self.fold.open.is_set():  # a thread reads the projection (a snapshot, a cycle, a GET): no fold now
            await self.fold.turn()
        first = not isinstance(rec, Undecodable) and rec.seq > self.projection.seq
        env = self._fold(rec)
        if first and env is not None:
            self._watched(env)
        if env is not None and self.reaction is not None and self.reactions_at_once > 1:
            await self.reacting.start(self._react, env, msg)  # the next fold waits for a free place, not this reaction
        elif env is not None and self.reaction is not None:
            await self._react(env, msg)
        else:
            await msg.ack()
        if self.fold.since_snapshot >= self.snapshot_every:
            await self.save_snapshot()

    def _watched(self, env: Envelope) -> None:
        for s in self.fold.services:
            if s.watch is not None:
                try:
                    s.watch(env)
                except Exception as e:  # noqa: BLE001 - a watch is best effort: the fold and reactions go on
                    log.warning("service=%s watch failed seq=%d type=%s error=%r", s.name, env.seq, env.type, e)

    async def _react(self, env: Envelope, msg: Msg) -> None:
        """Run the reaction, then settle the event: ack; or, failed, nak to retry, dead-letter at the last try."""
        from shared.telemetry import processing  # the reaction runs in the event's trace: what it appends too

        try:
            with processing(msg.subject, env.traceparent, self.name):
                await self.reaction(env)  # type: ignore[misc]
        except Exception as e:  # noqa: BLE001 - any reaction failure is retried, then dead-lettered
            self.metrics.reaction_errors.labels(self.name).inc()
            attempts = msg.metadata.num_delivered
            log.warning("service=%s reaction failed seq=%d type=%s attempt=%d error=%r", self.name, env.seq, env.type, attempts, e)
            if attempts >= self.max_deliver:
                await self._dead_letter(msg, f"{type(e).__name__}: {e}")
            else:
                await msg.nak(delay=min(0.1 * 2**attempts, 5))
            return
        await msg.ack()

    async def _dead_letter(self, msg: Msg, reason: str) -> None:
        """Copy to the dead letters and terminate; if even that fails, terminate anyway: a reaction that keeps
        failing never takes its process down."""
        assert self.log is not None
        try:
            await self.log.dead_letter(msg, self.name, reason)
            self.metrics.dead.labels(self.name).inc()
        except Exception as e:  # noqa: BLE001
            log.error("service=%s dead-letter failed seq=%d reason=%r error=%r: terminated without a copy",
                      self.name, msg.metadata.sequence.stream, reason, e)
            with contextlib.suppress(Exception):
                await msg.term()

    async def caught_up(self, seq: int, timeout: float | None = None, advice: str = "retry") -> None:
        """Wait until this service has folded ``seq`` (read-your-writes for an API that just appended); raise
        NotCaughtUp, ending with ``advice``, after ``timeout`` (default ``catch_up_timeout_s``): an API answers 503
        rather than from stale state."""
        timeout = self.catch_up_timeout_s if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.projection.seq < seq:
            left = deadline - loop.time()
            if left <= 0:
                raise NotCaughtUp(self.name, self.projection.seq, seq, timeout, advice)
            # woken once, by the fold that reaches ``seq`` (many callers polling would each cost a wake-up every few
            # ms); the short slice re-checks a position that moved otherwise (a snapshot restored, a test's hand)
            wake = loop.create_future()
            heapq.heappush(self._waiting, (seq, next(self._tie), wake))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake, min(left, 0.05))

    def _wake(self) -> None:
        """Resolve the caught_up calls whose sequence the fold has reached."""
        while self._waiting and self._waiting[0][0] <= self.projection.seq:
            wake = heapq.heappop(self._waiting)[2]
            if not wake.done():
                wake.set_result(None)

    async def emit(self, *events: Event, expected_last_subject_seq: int | None = None, epoch: int | None = None,
                   actor: str | None = None) -> list[int]:
        """Append events as this service (source ``/gpuorch/<name>``); one with an expected sequence is checked.
        ``actor``: the user whose request caused them (recorded on each, the audit trail)."""
        assert self.log is not None, "service is not running"
        envs = [self.envelope(e, epoch, actor) for e in events]
        if len(envs) == 1:
            return [await self.log.append(envs[0], expected_last_subject_seq)]
        return await self.log.append_many(envs)

    def envelope(self, event: Event, epoch: int | None = None, actor: str | None = None) -> Envelope:
        """``event`` as this service appends it (``emit``): its source, and the current trace as its parent."""
        return Envelope(event, source=f"/gpuorch/{self.name}", epoch=epoch, traceparent=current_traceparent(), actor=actor)

    def status(self) -> dict[str, Any]:
        return self.status_at(self.projection.position(), self.projection.digest(self.state_keys))

    def status_at(self, pos: tuple[int, int, int], digest: str) -> dict[str, Any]:
        seq, applied, invalid = pos
        return {"service": self.name, "ready": self.ready.is_set(), "seq": seq, "applied": applied, "digest": digest,
                "invalid_transitions": invalid}


async def statuses(services: list[Service]) -> list[dict[str, Any]]:
    """Every service's status, its digest of its projection's state: the services that share a projection
    (fold_once) read it once, in a thread while the folds are held, and only for as long as the state takes to
    copy out (``Projection.digest_document``); its encoding and hashing, most of the work, in a thread while the
    folds go on, once for all of them; kept until the projection moves (at 20,000 queued jobs five services'
    digests took 1.8-2 s, the folds held)."""
    out: dict[str, dict[str, Any]] = {}
    for fold in {id(s.fold): s.fold for s in services}.values():
        proj = fold.projection
        mine = [s for s in services if s.fold is fold]

        def read() -> tuple[tuple[int, int, int], dict[str, str] | None, dict[str, Any]]:
            pos = proj.position()
            parts = proj.digest_parts_at(pos)  # encoded already at this position: nothing to copy
            return pos, parts, {} if parts is not None else proj.digest_document()

        def hashed(pos: tuple[int, int, int], parts: dict[str, str] | None, doc: dict[str, Any]
                   ) -> tuple[dict[str, str], dict[str, str]]:
            parts = digest_parts(doc) if parts is None else parts
            return parts, {s.name: state_digest(pos, parts, s.state_keys) for s in mine}
        async with fold.digesting:  # callers at once wait for one encoding, then find it kept if nothing moved
            pos = proj.position()  # on the loop, where the folds run: what is kept needs no thread
            digests = {s.name: proj.digest_kept(pos, s.state_keys) for s in mine}
            if None in digests.values():
                pos, parts, doc = await mine[0].read_in_thread(read)
                parts, digests = await asyncio.to_thread(hashed, pos, parts, doc)
                for s in mine:
                    proj.keep_digest(pos, parts, s.state_keys, digests[s.name])
        for s in mine:
            out[s.name] = s.status_at(pos, digests[s.name])  # type: ignore[arg-type]
    return [out[s.name] for s in services]


def ops_router(services: list[Service]) -> APIRouter:
    """/healthz, /readyz and /metrics for the services of this process; /v1/whoami."""
    r = APIRouter()

    @r.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @r.get("/v1/whoami", tags=["ops"])
    async def whoami(p: Annotated[Principal, Depends(caller)]) -> dict[str, Any]:
        return {"user": p.user, "groups": list(p.groups), "role": p.role, "via": p.via}

    if not services:  # a gateway answers readiness and metrics for the processes behind it
        return r

    @r.get("/metrics", tags=["ops"], response_class=PlainTextResponse,
           responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        for m in {id(s.metrics): s.metrics for s in services}.values():
            await m.update_lag([s for s in services if s.metrics is m])
        registries = {id(s.metrics.registry): s.metrics.registry for s in services}

        def scrape() -> bytes:
            return b"".join(generate_latest(reg) for reg in registries.values())
        # the collectors walk every job (at 20,000 queued jobs a scrape took 90-220 ms, the loop held): in a thread
        # while the folds are held, when one projection is all they read (fold_once), else on the loop as before
        folds = {id(s.fold) for s in services}
        body = await services[0].read_in_thread(scrape) if len(folds) == 1 else scrape()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @r.get("/readyz", tags=["ops"], responses={503: {"description": "not caught up with the log yet, or the log is unreachable"}})
    async def readyz(response: Response) -> dict[str, Any]:
        """200 once every service has caught up with the log, and only while the log is reachable."""
        connected = all(s.log is not None and s.log.nc.is_connected for s in services)
        ready = connected and all(s.ready.is_set() for s in services)
        response.status_code = 200 if ready else 503
        return {"ready": ready, "log_connected": connected, "services": {s.name: s.ready.is_set() for s in services}}

    @r.get("/v1/services", tags=["ops"])
    async def service_status() -> list[dict[str, Any]]:
        return await statuses(services)

    return r


def build_app(services: list[Service], extra_routers: list[APIRouter] = (), *, auth: "Authenticator | None",
              max_body_bytes: int | None = None) -> FastAPI:
    """The HTTP API of these services; every route is checked against the role table (shared/auth.py), every
    error answers shared.api_errors.ErrorBody, and a body above ``max_body_bytes`` (default: the setting,
    GPUORCH_MAX_BODY_BYTES) answers 413. ``auth=None`` serves the public routes only (a process that holds no
    token store)."""
    from shared.settings import Settings

    app = FastAPI(title="gpuorch", version="0.1.0", dependencies=[Depends(authorize)], docs_url=None, redoc_url=None)
    offline_docs(app)
    api_errors.install(app, Settings().max_body_bytes if max_body_bytes is None else max_body_bytes)
    app.state.auth = auth
    app.include_router(ops_router(services))
    for s in services:
        if s.router_factory is not None:
            app.include_router(s.router_factory(s), dependencies=[Depends(caught_up_with_the_log(s))])
    for r in extra_routers:
        app.include_router(r)
    return app


STARTING = "x-gpuorch-starting"  # a 503's header: the service has not caught up with the log yet (ask again soon)


def caught_up_with_the_log(s: Service) -> Callable[[], Awaitable[None]]:
    """A service's routes answer 503 (Retry-After: 1, and STARTING) until it has caught up with the log: a process
    started again serves HTTP while it connects and replays, and its projection is empty or stale meanwhile (a
    job read there would be "unknown"; a submission would have no log to append to)."""
    async def dependency() -> None:
        if s.log is None or not s.ready.is_set():
            raise HTTPException(503, f"{s.name} is starting: it has not caught up with the event log yet",
                                headers={"Retry-After": "1", STARTING: s.name})
    return dependency


def offline_docs(app: FastAPI) -> None:
    """/docs: Swagger UI with its files served here, from the fastapi-offline package (FastAPI's default loads them
    from a CDN; /redoc is left out: ReDoc's page still fetches a logo from its CDN). Plain Starlette routes,
    outside the role table like /openapi.json: they describe the API, nothing more."""
    from importlib.resources import files

    from fastapi.openapi.docs import get_swagger_ui_html
    from starlette.staticfiles import StaticFiles

    app.mount("/docs/assets", StaticFiles(directory=str(files("fastapi_offline") / "static")), name="docs-assets")

    async def docs(request: Any) -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="gpuorch API",
                                   swagger_js_url="/docs/assets/swagger-ui-bundle.js",
                                   swagger_css_url="/docs/assets/swagger-ui.css",
                                   swagger_favicon_url="/docs/assets/favicon.png")

    app.add_route("/docs", docs, include_in_schema=False)


async def run_process(
    services: list[Service],
    log_: EventLog,
    host: str,
    port: int,
    extra_routers: list[APIRouter] = (),
    started: Callable[[], None] | None = None,
    signals: "StopSignals | None" = None,
    auth: "Authenticator | None" = None,
    before_stop: Callable[[], Awaitable[None]] | None = None,
    sock: socket.socket | None = None,
) -> None:
    """Serve the services' HTTP API on host:port (``sock``: that port, bound earlier by ``listen``) and run them
    until SIGINT/SIGTERM (``signals``: installed earlier). ``before_stop``: awaited once the HTTP server has
    stopped, while the services still run (`gpuorch up` stops its agents then, so that the services record what
    the agents report as they stop)."""
    server = http_server(build_app(services, list(extra_routers), auth=auth), host, port, sock)
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
        if before_stop is not None:
            await before_stop()
    finally:
        for s in services:
            s.stop()
        # a service stops within about a second (its last fetch, its timers, its snapshot); one that does not is
        # named with where it waits, and cancelled, so that a stop never hangs the process
        _, stuck = await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
        for t in stuck:
            where = " > ".join(f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno}" for f in t.get_stack(limit=8))
            log.error("event=service_stop_stuck service=%s seconds=%d action=cancel where=%r", t.get_name(),
                      STOP_TIMEOUT_S, where)
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        watcher.cancel()
    taken = [r for r in results if isinstance(r, InstanceTaken)]
    if taken:  # an operator's mistake: the reason, no traceback
        raise SystemExit(f"error: {taken[0]}")


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (0: a free port), bound now: `gpuorch up` binds its API port before it
    starts anything, so that none of the connections it opens meanwhile takes that port as its own."""
    return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=2048)


def http_server(app: FastAPI, host: str, port: int, sock: socket.socket | None = None) -> "uvicorn.Server":
    """``sock``: serve on this socket, bound earlier by ``listen``, instead of binding host:port."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn minus its own signal capture, which re-raises the signal after shutdown
        (a SIGTERM would then kill the process before the services drain and snapshot)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

        async def serve(self, sockets: list[socket.socket] | None = None) -> None:
            await super().serve(sockets or ([sock] if sock is not None else None))

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


def awaiting(coro: Any) -> list[str]:
    """Where a coroutine waits: each frame of its chain of awaits, outermost first (a stuck timer's log line)."""
    where = []
    while coro is not None and len(where) < 20:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            where.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
    return where
