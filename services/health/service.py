"""The health service: heartbeats, GPU telemetry, time limits and drains, decided by the lease holder.

Every replica folds the log, watches heartbeats and reads telemetry; only the
holder of the ``health`` lease decides. Each decision event's id derives from
what triggered it (a node's registration, a drain request, a job's start, an
XID's timestamp), so a replica taking over or a decision retried never appends
twice; job decisions also carry the job's last sequence, so one that raced
another writer is refused and decided again on the next tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import nats
from nats.js import api

from services.health import decisions, rules
from services.health.decisions import Decision
from services.health.api import router
from services.health.heartbeats import Heartbeats
from services.health.metrics import DcgmCollector, GpuTelemetry
from services.health.projection import SOURCE, HealthProjection
from services.health.rules import Fault, GpuWatch, HealthPolicy
from shared import events as ev
from shared.eventlog import HEARTBEAT_BUCKET, TELEMETRY_STREAM, ConcurrencyConflict
from shared.events import Envelope
from shared.natsauth import node_of_subject
from shared.leadership import Leadership
from shared.aio import wait_event
from shared.runtime import Metrics, NotCaughtUp, Service
from shared.settings import Settings
from shared.telemetry import JobTraces

log = logging.getLogger("gpuorch.health")

HEARTBEAT_TTL_S = 60  # as the agents create the bucket
RELEVANT = ("node.", "gpu.", "job.task_", "job.placed", "job.preempt", "job.requeued")


class Health:
    def __init__(self, settings: Settings, metrics: Metrics | None = None, policy: HealthPolicy | None = None, *,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        """``clock``: the time rounds decide at (epoch seconds: time limits, auto-resume); ``monotonic``: the time
        heartbeats are timed by (a node is lost after ``heartbeat_timeout_s`` of it without a beat)."""
        self.policy = policy or HealthPolicy.of(settings)
        self.clock = clock
        self.tick = min(1.0, self.policy.heartbeat_timeout_s / 4)
        self.debounce = settings.debounce_s
        self.wake = asyncio.Event()
        self.leadership = Leadership("health", source=SOURCE, on_acquired=self.wake.set)
        self.heartbeats = Heartbeats(clock=monotonic)
        self.kv: Any = None
        self.gpus: dict[str, GpuWatch] = {}  # gpu uuid -> what the telemetry rules remember
        self.bad_seen: dict[str, float] = {}  # node -> last time telemetry still looked unhealthy
        self.traces = JobTraces()  # a decision about a job (preempt, requeue, time limit) continues the job's trace
        self.last_samples = GpuTelemetry()  # what /metrics shows under dcgm-exporter's names
        self.svc = Service(
            "health",
            HealthProjection(),
            watch=self.watch,  # no consumer of its own beside the scheduler's in one process (Service.rides_along)
            timers=[self.leadership.hold, self.watch_heartbeats, self.read_telemetry, self.decide_loop],
            router=router,
            snapshot_every=settings.snapshot_every,
            metrics=metrics,
            instance=settings.instance,
        )
        dcgm = DcgmCollector(lambda: self.proj, self.last_samples, self.heartbeats.clock)
        self.svc.metrics.own("health-dcgm", lambda r: r.register(dcgm))

    @property
    def proj(self) -> HealthProjection:
        return self.svc.projection  # type: ignore[return-value]

    @property
    def leader(self) -> asyncio.Event:
        return self.leadership.leader

    def watch(self, env: Envelope) -> None:
        if env.data.TYPE.startswith(RELEVANT):
            self.wake.set()
        self.traces.note(env)

    # --- inputs: heartbeats and telemetry -------------------------------------------------

    async def watch_heartbeats(self, svc: Service) -> None:
        assert svc.log is not None
        self.kv = await svc.log.kv(HEARTBEAT_BUCKET, ttl=HEARTBEAT_TTL_S)
        await self.heartbeats.watch(self.kv, svc.stop_event)

    async def read_telemetry(self, svc: Service) -> None:
        """An ephemeral ordered consumer from now on: samples and XIDs published while no one read them are not replayed."""
        assert svc.log is not None
        while not svc.stop_event.is_set():
            sub = None
            try:
                sub = await svc.log.js.subscribe(
                    "gpuorch.telemetry.>", stream=TELEMETRY_STREAM, ordered_consumer=True,
                    config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.NEW),
                )
                while not svc.stop_event.is_set():  # also ends a loop whose cancellation wait_for swallowed
                    try:
                        msg = await sub.next_msg(timeout=1)
                    except (asyncio.TimeoutError, nats.errors.TimeoutError):
                        continue
                    await self.on_telemetry(msg.subject, msg.data)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - NATS away: subscribe again
                log.info("telemetry subscription restarting error=%r", e)
                await asyncio.sleep(0.5)
            finally:
                if sub is not None:
                    try:
                        await sub.unsubscribe()
                    except Exception:  # noqa: BLE001
                        pass

    async def on_telemetry(self, subject: str, body: bytes) -> None:
        """A sample or an XID, believed only about the node whose subject it came on (the bus checked who
        published there) and only for that node's own GPUs."""
        try:
            doc = json.loads(body)
            node_id, t = str(doc["node_id"]), float(doc["t"])
        except (ValueError, KeyError, TypeError):
            log.debug("telemetry unreadable body=%r", body[:200])
            return
        if node_id != node_of_subject(subject, "gpuorch.telemetry"):
            log.warning("event=telemetry_refused subject=%s node=%s reason=not_this_nodes_subject", subject, node_id)
            return
        node = self.proj.nodes.get(node_id)
        if node is None:
            log.debug("event=telemetry_ignored node=%s reason=not_registered_yet", node_id)
            return
        gpus = {g.uuid for g in node.info.gpus} | {m.uuid for g in node.info.gpus for m in g.mig_slices}
        if ("xid" in doc and str(doc.get("gpu_uuid") or "") not in gpus) or any(
                str(g.get("uuid", "")) not in gpus for g in doc.get("gpus") or ()):
            log.warning("event=telemetry_refused subject=%s node=%s reason=gpu_of_another_node", subject, node_id)
            return
        faults: list[Fault] = []
        if "xid" in doc:
            action = doc.get("recovery_action")
            fault = rules.xid_fault(node_id, str(doc.get("gpu_uuid") or ""), int(doc["xid"]), t,
                                    int(action) if action is not None else None)
            self.last_samples.xid(str(doc.get("gpu_uuid") or ""), int(doc["xid"]))
            if fault is None:
                log.info("event=xid_ignored node=%s gpu=%s xid=%s", node_id, doc.get("gpu_uuid"), doc["xid"])
            faults = [fault] if fault else []
        hot = False
        for g in doc.get("gpus") or ():
            uuid = str(g.get("uuid", ""))
            self.last_samples.sample(node_id, g, self.heartbeats.clock())
            temp, ecc = g.get("temperature_c"), g.get("ecc_uncorrected")
            self.gpus[uuid], found = rules.assess_sample(self.gpus.get(uuid, GpuWatch()), node_id, uuid, t, temp, ecc, self.policy)
            faults += found
            hot = hot or not rules.sample_is_healthy(temp, self.policy)
        if faults or hot:
            self.bad_seen[node_id] = t
        for fault in faults:
            if self.leader.is_set():
                await self.mark(fault)

    # --- decisions ----------------------------------------------------------------------

    async def mark(self, fault: Fault) -> None:
        """gpu.unhealthy, then the node cordoned and, by policy, drained."""
        last = await self.append_all(decisions.mark(self.proj, fault, self.policy))
        if last:
            self.wake.set()
            await self.settle(last)

    async def decide_loop(self, svc: Service) -> None:
        while not svc.stop_event.is_set():
            await self.nap()
            await asyncio.sleep(self.debounce)  # a burst of events makes one round, not one each
            self.wake.clear()
            if not self.leader.is_set() or not svc.ready.is_set():
                continue
            try:
                last = await self.decide_once(self.clock())
                if last:
                    await self.settle(last)
            except Exception:  # noqa: BLE001 - a failed round is logged and retried on the next tick
                log.exception("event=health_round_failed")

    async def settle(self, seq: int) -> None:
        """Wait for the fold to reach this round's own decisions, so the next round does not make them again (if
        it does, their ids deduplicate them)."""
        try:
            await self.svc.caught_up(seq, timeout=5)
        except NotCaughtUp as e:
            log.warning("event=health_not_caught_up reason=%r", str(e))

    async def nap(self) -> None:
        await wait_event(self.wake, self.tick)

    async def decide_once(self, now: float) -> int:
        """One round: lost nodes, their jobs, time limits, drains, auto-resume. Returns the last sequence appended."""
        return max(await self.find_lost_nodes(),
                   await self.append_all(decisions.round_of(self.proj, now, self.policy, self.bad_seen)))

    async def find_lost_nodes(self) -> int:
        """node.lost for each watched node silent for longer than the timeout, on the heartbeats' clock."""
        watched = {n: self.proj.registrations.get(n, 0) for n, s in self.proj.nodes.items()
                   if not s.lost and (s.info.agent_url or n in self.heartbeats.seen)}
        found = []
        for node_id, silent_s in rules.lost_nodes(self.heartbeats.last_beats(watched), self.heartbeats.clock(),
                                                  self.policy.heartbeat_timeout_s):
            if self.kv is not None and await self.heartbeats.still_silent(self.kv, node_id):
                found.append(decisions.node_lost(self.proj, node_id, silent_s, self.policy))
        return await self.append_all(found)

    async def append_all(self, made: list[Decision]) -> int:
        """Append decisions in order (a chained one only after the one before it landed); the last sequence appended."""
        last, prev = 0, None
        for d in made:
            if d.chained and prev is None:
                continue
            prev = await self.append(d.event, d.event_id, prev if d.chained else d.expected)
            last = max(last, prev or 0)
            if prev is not None:
                log.info(decisions.describe(d))
        return last

    async def append(self, event: ev.Event, event_id: str, expected_last_subject_seq: int | None = None) -> int | None:
        """Append one decision as the leader; None if the aggregate moved on since it was read."""
        assert self.svc.log is not None
        env = Envelope(event, id=event_id, source=SOURCE, epoch=self.leadership.epoch)
        job_id = getattr(event, "job_id", None)
        try:
            with self.traces.span(f"health.{event.TYPE}", job_id) if job_id else contextlib.nullcontext():
                return await self.svc.log.append(env, expected_last_subject_seq)
        except ConcurrencyConflict:
            log.info("event=decision_conflict type=%s subject=%s action=redecide", event.TYPE, env.subject)
            self.wake.set()
            return None


def build(settings: Settings, metrics: Metrics | None = None) -> Service:
    return Health(settings, metrics).svc
