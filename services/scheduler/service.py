"""The scheduler service: a cycle on relevant events (debounced) and on a timer, run by the lease holder.

The cycle itself is the pure ``run_cycle``; this adapter takes the snapshot, reads
the clock once, appends the plan, and waits until its own events are folded before
the next cycle, so it never decides twice on the same free GPUs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from pathlib import Path

from services.scheduler.api import router
from services.scheduler.core import Plan, Policy, run_cycle
from services.scheduler.projection import SchedulerProjection
from services.scheduler.snapshot import snapshot_from_cluster
from shared import events as ev
from shared.cluster import ACTIVE
from shared.fairshare import job_share, leaves, reclaim_requests
from shared.eventlog import ConcurrencyConflict
from shared.events import Envelope
from shared.leadership import Leadership
from shared.readmodel import JobHistory
from shared.aio import wait_event
from shared.runtime import Metrics, Service
from shared.settings import Settings

log = logging.getLogger("gpuorch.scheduler")

RELEVANT = ("job.queued", "job.requeued", "job.succeeded", "job.failed", "job.cancelled", "job.preempted", "node.", "gpu.", "queue.")


class Scheduler:
    def __init__(self, settings: Settings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.policy = Policy(name=settings.policy, reclaim_grace_s=settings.reclaim_grace_s,
                             max_preemptions_per_hour=settings.max_preemptions_per_hour)
        self.interval = settings.cycle_interval_s
        self.debounce = settings.debounce_s
        self.wake = asyncio.Event()
        self.leadership = Leadership("scheduler", on_acquired=self.wake.set)
        self.history = JobHistory(settings.db_url, Path(settings.data_dir))
        self.svc = Service(
            "scheduler",
            SchedulerProjection(),
            reaction=self.react,
            timers=[self.leadership.hold, self.cycle_loop, self.keep_history],
            router=lambda svc: router(svc, self),
            snapshot_every=settings.snapshot_every,
            metrics=metrics,
            instance=settings.instance,
        )

    @property
    def proj(self) -> SchedulerProjection:
        return self.svc.projection  # type: ignore[return-value]

    async def keep_history(self, svc: Service) -> None:
        assert svc.log is not None
        await self.history.follow(svc.log)

    # --- the cycle ----------------------------------------------------------------------

    async def cycle_loop(self, svc: Service) -> None:
        while not svc.stop_event.is_set():
            await wait_event(self.wake, self.interval)
            await asyncio.sleep(self.debounce)  # let a burst of events land before deciding
            self.wake.clear()
            if not self.leadership.leader.is_set():
                continue
            try:
                await self.run_once()
            except Exception:  # noqa: BLE001 - a failed cycle is logged and retried on the next tick
                log.exception("event=cycle_failed")

    async def run_once(self) -> Plan:
        now = time.time()
        t0 = time.perf_counter()
        plan = decide(self.proj, self.policy, now, self.settings.half_life_s, self.settings.reclaim_after_s)
        self.svc.metrics.cycle_seconds.labels("scheduler").observe(time.perf_counter() - t0)
        await self.commit(plan, now)
        return plan

    async def commit(self, plan: Plan, now: float) -> None:
        epoch = self.leadership.epoch
        last = 0
        for job_id, p in plan.placements.items():
            job = self.proj.jobs.get(job_id)
            if job is None or job.state != "queued":
                continue
            event = ev.JobPlaced(job_id=job_id, placements=p.tasks, spread=p.spread, policy=p.policy)
            try:
                last = max(last, *await self.svc.emit(event, expected_last_subject_seq=job.seq, epoch=epoch))
            except ConcurrencyConflict:
                log.info("event=placement_conflict job=%s action=redecide", job_id)
                continue
            nodes = ",".join(sorted({t.node_id for t in p.tasks}))
            log.info("event=placed job=%s nodes=%s spread=%s policy=%s", job_id, nodes, p.spread, p.policy)
        for pre in plan.preemptions:
            job = self.proj.jobs.get(pre.job_id)
            if job is None or job.state not in ("placed", "running"):
                continue
            try:
                event = ev.JobPreempting(job_id=pre.job_id, reason=pre.reason, grace_s=pre.grace_s)
                last = max(last, *await self.svc.emit(event, expected_last_subject_seq=job.seq, epoch=epoch))
                log.info("event=preempting job=%s reason=%r grace_s=%d", pre.job_id, pre.reason, pre.grace_s)
            except ConcurrencyConflict:
                continue
        for job_id, reason in plan.unschedulable.items():
            job = self.proj.jobs.get(job_id)
            if job is not None and job.state == "queued" and job.reason != reason:
                last = max(last, *await self.svc.emit(ev.JobUnschedulable(job_id=job_id, reason=reason), epoch=epoch))
        last = max(last, await self.finish_preemptions(now, epoch))
        if last:
            deadline = time.monotonic() + 10
            while self.proj.seq < last and time.monotonic() < deadline:
                await asyncio.sleep(0.005)

    async def finish_preemptions(self, now: float, epoch: int | None) -> int:
        """A preempting job whose grace is over (plus a margin for its agent's report) is requeued."""
        last = 0
        for job in list(self.proj.jobs.values()):
            if job.state == "preempting" and job.preempting_since is not None and now > job.preempting_since + job.grace_s + 5:
                last = max(last, *await self.requeue(job.job_id, f"grace-{job.seq}", epoch))
        return last

    async def requeue(self, job_id: str, why: str, epoch: int | None = None) -> list[int]:
        envs = [
            Envelope(ev.JobPreempted(job_id=job_id), id=f"{job_id}-preempted-{why}", source="/gpuorch/scheduler", epoch=epoch),
            Envelope(ev.JobQueued(job_id=job_id), id=f"{job_id}-requeued-{why}", source="/gpuorch/scheduler", epoch=epoch),
        ]
        assert self.svc.log is not None
        return await self.svc.log.append_many(envs)

    # --- reactions ----------------------------------------------------------------------

    async def react(self, env: Envelope) -> None:
        """Turn task exits into the job's end. Event ids derive from the trigger, so a
        standby replica or a redelivery appends nothing twice."""
        if env.data.TYPE.startswith(RELEVANT):
            self.wake.set()
        if not isinstance(env.data, ev.JobTaskExited):
            return
        job = self.proj.jobs.get(env.data.job_id)
        if job is None or job.state not in ACTIVE:
            return
        if job.state == "preempting":
            if not job.tasks_running:
                await self.requeue(job.job_id, f"exit-{env.id}")
            return
        e = env.data
        if e.code == 0:
            if len(job.tasks_exited) == job.spec.tasks and all(c == 0 for c in job.tasks_exited.values()):
                await self._decide(env, ev.JobSucceeded(job_id=job.job_id))
            return
        if e.code is not None:
            why = f"task {e.task} exited with code {e.code}"
        elif e.signal is not None:
            why = f"task {e.task} was killed by signal {e.signal}"
        else:
            why = f"task {e.task}: {e.reason or 'ended without an exit status'}"
        await self._decide(env, ev.JobFailed(job_id=job.job_id, code=e.code, reason=why))

    async def _decide(self, trigger: Envelope, event: ev.Event) -> None:
        assert self.svc.log is not None
        env = Envelope(event, id=f"{trigger.id}-{event.TYPE}", source="/gpuorch/scheduler")
        await self.svc.log.append(env)
        log.info("event=%s job=%s", event.TYPE.split(".")[1], getattr(event, "job_id", ""))


def effective_priority(queues: dict, path: str) -> int:
    """A leaf's reclaim priority: its own, else its nearest ancestor's (production > research > exploration)."""
    while path:
        spec = queues.get(path)
        if spec is not None and spec.priority:
            return spec.priority
        path = path.rsplit(".", 1)[0] if "." in path else ""
    return 0


def decide(proj: SchedulerProjection, policy: Policy, now: float, half_life_s: float, reclaim_after_s: float = 0.0) -> Plan:
    """One cycle from the folded state: entitlements and reclaim requests from the fair share, then the core."""
    queues = proj.queues
    division = proj.division(now, half_life_s)
    leaf_ent = {q: division.entitlement.get(q, 0.0) for q in leaves(queues)}
    # reclaim only for work that has waited a while: ordinary churn often frees the GPUs first, without evicting anyone
    alloc, waiting = proj.queue_load(waited_before=now - reclaim_after_s)
    smallest: dict[str, float] = {}
    ratios = proj.share_ratios()
    for job in proj.jobs.values():
        if job.state == "queued":
            smallest[job.spec.queue] = min(smallest.get(job.spec.queue, float("inf")), job_share(job.spec, ratios))
    reclaims = reclaim_requests(queues, alloc, waiting, leaf_ent, smallest)
    policy = replace(
        policy,
        min_runtime_s={q: s.preempt_min_runtime_s for q, s in queues.items() if s.preempt_min_runtime_s},
        queue_priority={q: effective_priority(queues, q) for q in queues},
    )
    return run_cycle(snapshot_from_cluster(proj, now, leaf_ent), policy, now, reclaims)


def build(settings: Settings, metrics: Metrics | None = None) -> Service:
    return Scheduler(settings, metrics).svc
