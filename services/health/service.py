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
import json
import logging
import time
from typing import Any

import nats
from nats.js import api

from services.health import rules
from services.health.api import router
from services.health.heartbeats import Heartbeats
from services.health.projection import SOURCE, HealthProjection
from services.health.rules import Fault, GpuWatch, HealthPolicy
from shared import events as ev
from shared.eventlog import HEARTBEAT_BUCKET, TELEMETRY_STREAM, ConcurrencyConflict
from shared.events import Envelope
from shared.leadership import Leadership
from shared.aio import wait_event
from shared.runtime import Metrics, Service
from shared.settings import Settings

log = logging.getLogger("gpuorch.health")

HEARTBEAT_TTL_S = 60  # as the agents create the bucket
TIME_LIMIT_REASON = "time limit exceeded"
RELEVANT = ("node.", "gpu.", "job.task_", "job.placed", "job.preempt", "job.requeued")


class Health:
    def __init__(self, settings: Settings, metrics: Metrics | None = None, policy: HealthPolicy | None = None) -> None:
        self.policy = policy or HealthPolicy(heartbeat_timeout_s=settings.heartbeat_timeout_s)
        self.tick = min(1.0, self.policy.heartbeat_timeout_s / 4)
        self.debounce = settings.debounce_s
        self.wake = asyncio.Event()
        self.leadership = Leadership("health", on_acquired=self.wake.set)
        self.heartbeats = Heartbeats()
        self.kv: Any = None
        self.gpus: dict[str, GpuWatch] = {}  # gpu uuid -> what the telemetry rules remember
        self.bad_seen: dict[str, float] = {}  # node -> last time telemetry still looked unhealthy
        self.svc = Service(
            "health",
            HealthProjection(),
            reaction=self.react,
            timers=[self.leadership.hold, self.watch_heartbeats, self.read_telemetry, self.decide_loop],
            router=router,
            snapshot_every=settings.snapshot_every,
            metrics=metrics,
            instance=settings.instance,
        )

    @property
    def proj(self) -> HealthProjection:
        return self.svc.projection  # type: ignore[return-value]

    @property
    def leader(self) -> asyncio.Event:
        return self.leadership.leader

    async def react(self, env: Envelope) -> None:
        if env.data.TYPE.startswith(RELEVANT):
            self.wake.set()

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
                    await self.on_telemetry(msg.data)
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

    async def on_telemetry(self, body: bytes) -> None:
        try:
            doc = json.loads(body)
            node_id, t = str(doc["node_id"]), float(doc["t"])
        except (ValueError, KeyError, TypeError):
            log.debug("telemetry unreadable body=%r", body[:200])
            return
        faults: list[Fault] = []
        if "xid" in doc:
            action = doc.get("recovery_action")
            fault = rules.xid_fault(node_id, str(doc.get("gpu_uuid") or ""), int(doc["xid"]), t,
                                    int(action) if action is not None else None)
            if fault is None:
                log.info("event=xid_ignored node=%s gpu=%s xid=%s", node_id, doc.get("gpu_uuid"), doc["xid"])
            faults = [fault] if fault else []
        hot = False
        for g in doc.get("gpus") or ():
            uuid = str(g.get("uuid", ""))
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
        node = self.proj.nodes.get(fault.node_id)
        if node is None or fault.gpu_uuid in node.unhealthy:
            return
        base = f"{fault.node_id}-{fault.gpu_uuid}-{fault.key}"
        why = f"gpu {fault.gpu_uuid}: {fault.kind}{'' if fault.xid is None else f' {fault.xid}'} ({fault.detail})"
        decisions: list[tuple[ev.Event, str]] = [
            (ev.GpuUnhealthy(node_id=fault.node_id, gpu_uuid=fault.gpu_uuid, kind=fault.kind, xid=fault.xid, detail=fault.detail),
             f"{base}-unhealthy"),
        ]
        if not node.cordoned:
            decisions.append((ev.NodeCordoned(node_id=fault.node_id, reason=why), f"{base}-cordon"))
        if fault.kind in self.policy.drain_on and not node.draining:
            decisions.append((ev.NodeDrainRequested(node_id=fault.node_id, grace_s=self.policy.fault_grace_s, reason=why),
                              f"{base}-drain"))
        last = 0
        for event, event_id in decisions:
            last = await self.append(event, event_id) or last
        log.info("event=gpu_unhealthy node=%s gpu=%s kind=%s xid=%s detail=%r", fault.node_id, fault.gpu_uuid, fault.kind,
                 fault.xid, fault.detail)
        self.wake.set()
        await self.svc.caught_up(last, timeout=5)

    async def decide_loop(self, svc: Service) -> None:
        while not svc.stop_event.is_set():
            await self.nap()
            await asyncio.sleep(self.debounce)  # a burst of events makes one round, not one each
            self.wake.clear()
            if not self.leader.is_set() or not svc.ready.is_set():
                continue
            try:
                last = await self.decide_once(time.time())
                if last:
                    await svc.caught_up(last, timeout=5)
            except Exception:  # noqa: BLE001 - a failed round is logged and retried on the next tick
                log.exception("event=health_round_failed")

    async def nap(self) -> None:
        await wait_event(self.wake, self.tick)

    async def decide_once(self, now: float) -> int:
        """One round: lost nodes, their jobs, time limits, drains, auto-resume. Returns the last sequence appended."""
        return max(
            await self.find_lost_nodes(),
            await self.requeue_lost_jobs(),
            await self.enforce_time_limits(now),
            await self.drain_nodes(),
            await self.auto_resume(now),
        )

    async def find_lost_nodes(self) -> int:
        watched = {n: self.proj.registrations.get(n, 0) for n, s in self.proj.nodes.items()
                   if not s.lost and (s.info.agent_url or n in self.heartbeats.seen)}
        last = 0
        for node_id, silent_s in rules.lost_nodes(self.heartbeats.last_beats(watched), time.monotonic(),
                                                  self.policy.heartbeat_timeout_s):
            if self.kv is None or not await self.heartbeats.still_silent(self.kv, node_id):
                continue
            reason = f"no heartbeat for {silent_s:.1f}s (timeout {self.policy.heartbeat_timeout_s:g}s)"
            last = max(last, await self.append(ev.NodeLost(node_id=node_id, reason=reason), f"{node_id}-lost-{watched[node_id]}") or 0)
            log.info("event=node_lost node=%s reason=%r", node_id, reason)
        return last

    async def requeue_lost_jobs(self) -> int:
        last, jobs = 0, self.proj.job_views()
        for node_id, node in self.proj.nodes.items():
            if not node.lost:
                continue
            for lost in rules.plan_lost_node(node_id, jobs):
                job = self.proj.jobs[lost.job_id]
                event: ev.Event = ev.JobRequeued(job_id=lost.job_id, reason=lost.reason) if lost.requeue else \
                    ev.JobFailed(job_id=lost.job_id, reason=lost.reason)
                event_id = f"{lost.job_id}-lost-{node_id}-{self.proj.registrations.get(node_id, 0)}"
                last = max(last, await self.append(event, event_id, job.seq) or 0)
                log.info("event=%s job=%s node=%s reason=%r", event.TYPE.split(".")[1], lost.job_id, node_id, lost.reason)
        return last

    async def enforce_time_limits(self, now: float) -> int:
        """A job past its limit is stopped with grace and ends failed, never requeued.

        job.timed_out tells its agents to stop it; job.failed follows at once, so the
        scheduler, reacting to the task's exit, finds it already ended and cannot
        requeue it or call it a success. Its GPUs are freed at the failure, as for a
        cancel, while the agents enforce the grace.
        """
        last = 0
        for over in rules.overdue_jobs(self.proj.job_views(frozenset({"running"})), now):
            job = self.proj.jobs[over.job_id]
            attempt = round((job.started_at or 0) * 1000)
            expected: int | None = job.seq
            if not over.timed_out:
                expected = await self.append(ev.JobTimedOut(job_id=job.job_id, grace_s=self.policy.time_limit_grace_s),
                                             f"{job.job_id}-timed-out-{attempt}", expected)
                if expected is None:
                    continue
            failed = await self.append(ev.JobFailed(job_id=job.job_id, reason=TIME_LIMIT_REASON),
                                       f"{job.job_id}-time-limit-{attempt}", expected)
            last = max(last, expected, failed or 0)
            log.info("event=timed_out job=%s limit_s=%s overrun_s=%.1f grace_s=%d", job.job_id, job.spec.time_limit_s,
                     over.overrun_s, self.policy.time_limit_grace_s)
        return last

    async def drain_nodes(self) -> int:
        last, jobs = 0, self.proj.job_views()
        for node_id, node in self.proj.nodes.items():
            if not node.draining:
                continue
            drain = self.proj.drains.get(node_id, {"grace_s": self.policy.fault_grace_s, "reason": "", "seq": 0})
            plan = rules.plan_drain(node_id, jobs)
            if plan.drained:
                last = max(last, await self.append(ev.NodeDrained(node_id=node_id), f"{node_id}-drained-{drain['seq']}") or 0)
                log.info("event=node_drained node=%s", node_id)
                continue
            if node.lost:
                continue  # its jobs are requeued as lost, without a grace nobody could honour
            reason = f"node {node_id} draining" + (f": {drain['reason']}" if drain["reason"] else "")
            for job_id in plan.preempt:
                job = self.proj.jobs[job_id]
                event = ev.JobPreempting(job_id=job_id, reason=reason, grace_s=drain["grace_s"])
                last = max(last, await self.append(event, f"{job_id}-drain-{node_id}-{drain['seq']}", job.seq) or 0)
                log.info("event=preempting job=%s node=%s grace_s=%d reason=%r", job_id, node_id, drain["grace_s"], reason)
        return last

    async def auto_resume(self, now: float) -> int:
        after = self.policy.auto_resume_after_s
        if after is None:
            return 0
        last = 0
        for node_id in list(self.proj.nodes):
            view = self.proj.node_view(node_id, self.bad_seen.get(node_id))
            if rules.resume_due(view, now, after):
                event_id = f"{node_id}-auto-resume-{round((view.last_fault_at or 0) * 1000)}"
                last = max(last, await self.append(ev.NodeResumed(node_id=node_id), event_id) or 0)
                log.info("event=auto_resumed node=%s healthy_for_s=%.0f", node_id, now - (view.last_fault_at or now))
        return last

    async def append(self, event: ev.Event, event_id: str, expected_last_subject_seq: int | None = None) -> int | None:
        """Append one decision as the leader; None if the aggregate moved on since it was read."""
        assert self.svc.log is not None
        env = Envelope(event, id=event_id, source=SOURCE, epoch=self.leadership.epoch)
        try:
            return await self.svc.log.append(env, expected_last_subject_seq)
        except ConcurrencyConflict:
            log.info("event=decision_conflict type=%s subject=%s action=redecide", event.TYPE, env.subject)
            self.wake.set()
            return None


def build(settings: Settings, metrics: Metrics | None = None) -> Service:
    return Health(settings, metrics).svc
