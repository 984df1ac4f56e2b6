"""The scheduler service: a cycle on relevant events (at most one per debounce) and on a timer, by the lease holder.

The cycle itself is the pure ``decide`` (decide.py); this adapter reads its clock
once, appends the plan, and waits until its own events are folded before the next
cycle, so it never decides twice on the same free GPUs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from services.scheduler.admission import with_pool_notes
from services.scheduler.api import router
from services.scheduler.core import Placement, Plan, Reservation
from services.scheduler.decide import configured_policy, cycle_input
from services.scheduler.metrics import SchedulerCollector, SchedulerEvents
from services.scheduler.projection import SchedulerProjection
from services.scheduler.reasons import worth_logging
from shared import events as ev
from shared.cluster import ACTIVE, JobRecord
from shared.eventlog import ConcurrencyConflict
from shared.events import Envelope
from shared.leadership import Leadership
from shared.readmodel import JobHistory
from shared.aio import wait_event
from shared.runtime import Metrics, NotCaughtUp, Service
from shared.settings import Settings
from shared.telemetry import JobTraces, span

log = logging.getLogger("gpuorch.scheduler")
# what a shell's exit code says when the task gave no reason of its own
SHELL_CODES = {126: "a command it ran could not be executed", 127: "a command it ran was not found"}
SIGNALS = frozenset(int(s) for s in signal.Signals)

PLACE_AT_ONCE = 256  # placements appended concurrently
# after a cycle that worked for T seconds, an event wakes the next one no sooner than REST x T later (the timer's
# ticks too): a cycle over 10,000 waiting jobs takes 100-200 ms of CPU, and woken by every submission it ran back
# to back, a core's worth beside the API (Slurm's quick scheduler looks at the first 100 jobs for the same reason).
# A small backlog's cycles take milliseconds: their rest stays the debounce. T is the CPU this process spent from
# the cycle's read to the end of its appends (its threads, and the requests served beside it), not the wall time:
# on a machine busy with other processes (16 agents on 2 cores) a cycle of 10 ms waited 200 ms for a core, and its
# rest of 400 ms left 128 freed GPUs idle with the CPU idle too (bench.e2e --timeline).
# Once an event may have freed room (a job's end, a node, a quota: anything but a submission), the rest is REST
# times the cycle's read and decision alone (their threads' CPU): the process's CPU over the cycle is mostly the
# folds of the ends and the appends beside it, and resting for those kept GPUs idle 0.25-0.73 s after each wave of
# 128 jobs ended (bench.e2e, issue 15's thirteenth round). Submissions alone (a flood) rest as before.
REST = 2.0
T = TypeVar("T")

RELEVANT = ("job.queued", "job.released", "job.updated", "job.requeued", "job.succeeded", "job.failed", "job.cancelled",
            "job.preempted", "node.", "gpu.", "queue.")
SUBMISSION = ("job.queued", "job.released", "job.updated")  # of the relevant events, those that free no room


class Scheduler:
    def __init__(self, settings: Settings, metrics: Metrics | None = None, *,
                 clock: Callable[[], float] = time.time) -> None:
        """``clock``: the time every decision is made at (epoch seconds), read once per cycle."""
        self.settings = settings
        self.clock = clock
        self.policy = configured_policy(settings)
        self.interval = settings.cycle_interval_s
        self.debounce = settings.debounce_s
        self.worked_s = 0.0  # the process's CPU over the last cycle, read to appends: the next one rests REST times that
        self.decided_s = 0.0  # the last cycle's read and decision alone: their threads' CPU
        self.freed = False  # an event that may have freed room came since the last cycle began: rest decided_s only
        self.wake = asyncio.Event()
        self.leadership = Leadership("scheduler", source="/gpuorch/scheduler", on_acquired=self.wake.set)
        self.history = JobHistory(settings.db_url, Path(settings.data_dir))
        # a waiting job's reason: the last cycle's words (what the API shows), and when the log last took one
        # (only a change of kind is logged at once, else at most every reason_refresh_s: reasons are state)
        self.live_reasons: dict[str, str] = {}
        self.pool_notes: dict[tuple, list[str]] = {}  # node pools that could grow nodes for a task shape
        self.pool_notes_at: int | None = None  # the projection's shape_version they are for
        self.reservation: Reservation | None = None  # the last cycle's backfill reservation: a job's estimated start
        self.reason_logged_at: dict[str, float] = {}
        self.traces = JobTraces()  # a cycle's decision about a job continues the job's trace
        self.svc = Service(
            "scheduler",
            SchedulerProjection(),
            reaction=self.react,
            timers=[self.leadership.hold, self.cycle_loop, self.keep_history],
            router=lambda svc: router(svc, self),
            snapshot_every=settings.snapshot_every,
            metrics=metrics,
            instance=settings.instance,
            # a job's end is decided once per (job, attempt, kind) and against its last sequence (``react``): right
            # in any order, so many at once; one append after another made a task's exit wait for the others'
            reactions_at_once=32,
        )
        self.events: SchedulerEvents = self.svc.metrics.own("scheduler-events", SchedulerEvents)
        self.svc.metrics.own("scheduler-collector", lambda r: r.register(SchedulerCollector(lambda: self.proj)))

    @property
    def proj(self) -> SchedulerProjection:
        return self.svc.projection  # type: ignore[return-value]

    async def keep_history(self, svc: Service) -> None:
        assert svc.log is not None
        await self.history.follow(svc.log)

    # --- the cycle ----------------------------------------------------------------------

    async def cycle_loop(self, svc: Service) -> None:
        ended = -math.inf  # when the last cycle ended (monotonic)
        while not svc.stop_event.is_set():
            await wait_event(self.wake, self.interval)
            # cycles start at least a debounce apart (after a long one, REST times its work): what arrives meanwhile
            # lands for the next. An event after a quiet spell is decided at once: waiting a debounce after every
            # wake made each job that ends on a full node wait 50 ms before the next one was placed (bench.e2e)
            await asyncio.sleep(max(0.0, ended + max(self.debounce, REST * self.work_s()) - time.monotonic()))
            self.wake.clear()
            self.freed = False
            if not self.leadership.leader.is_set():
                continue
            try:
                await self.run_once()
            except Exception:  # noqa: BLE001 - a failed cycle is logged and retried on the next tick
                log.exception("event=cycle_failed")
            ended = time.monotonic()

    def work_s(self) -> float:
        """The last cycle's work that the next one rests REST times (see REST)."""
        return self.decided_s if self.freed else self.worked_s

    async def run_once(self) -> Plan:
        now = self.clock()
        t0, started = time.perf_counter(), time.time_ns()
        # read in a thread with the folds held, then decided in a thread on that copy while folds go on: a cycle over
        # 10,000 pending jobs takes 100-200 ms, which every request waiting for a fold (a POST) waited out
        cpu0 = time.process_time()
        read, read_s = await self.svc.read_in_thread(lambda: on_cpu(lambda: cycle_input(
            self.proj, self.policy, now, self.settings.half_life_s, self.settings.reclaim_after_s)))
        plan, decide_s = await asyncio.to_thread(on_cpu, read.decide)
        self.decided_s = read_s + decide_s
        self.svc.metrics.cycle_seconds.labels("scheduler").observe(time.perf_counter() - t0)
        self.events.placements.observe(len(plan.placements))
        # a cycle that decided something is a trace of its own (an idle tick makes none); each job's decision is a
        # span in the job's trace, linked to the cycle's
        busy = plan.placements or plan.preemptions or plan.cancellations
        with span("scheduler.cycle", root=True, start_time=started, attributes={
                "gpuorch.placed": len(plan.placements), "gpuorch.preempted": len(plan.preemptions)}) \
                if busy else contextlib.nullcontext():
            await self.commit(plan, now)
        self.worked_s = time.process_time() - cpu0
        return plan

    async def commit(self, plan: Plan, now: float) -> None:
        epoch = self.leadership.epoch

        async def place(job_id: str, p: Placement) -> int:
            job = self.proj.jobs.get(job_id)
            if job is None or job.state != "queued":
                return 0
            event = ev.JobPlaced(job_id=job_id, placements=p.tasks, spread=p.spread, policy=p.policy)
            try:
                with self.traces.span("scheduler.place", job_id, **{"gpuorch.spread": p.spread}):
                    seq = max(await self.svc.emit(event, expected_last_subject_seq=job.seq, epoch=epoch))
            except ConcurrencyConflict:
                log.info("event=placement_conflict job=%s action=redecide", job_id)
                return 0
            nodes = ",".join(sorted({t.node_id for t in p.tasks}))
            log.info("event=placed job=%s nodes=%s spread=%s policy=%s", job_id, nodes, p.spread, p.policy)
            return seq

        # the placements of one plan use disjoint GPUs: appended together, each on its own job's subject, rather
        # than one ack after another (bench.e2e), in slices that keep the connection's pending acks bounded
        last, placements = 0, list(plan.placements.items())
        for i in range(0, len(placements), PLACE_AT_ONCE):
            last = max(last, *await asyncio.gather(*(place(j, p) for j, p in placements[i:i + PLACE_AT_ONCE])))
        for pre in plan.preemptions:
            job = self.proj.jobs.get(pre.job_id)
            if job is None or job.state not in ("placed", "running"):
                continue
            try:
                event = ev.JobPreempting(job_id=pre.job_id, reason=pre.reason, grace_s=pre.grace_s)
                with self.traces.span("scheduler.preempt", pre.job_id, **{"gpuorch.reason": pre.reason}):
                    last = max(last, *await self.svc.emit(event, expected_last_subject_seq=job.seq, epoch=epoch))
                log.info("event=preempting job=%s reason=%r grace_s=%d", pre.job_id, pre.reason, pre.grace_s)
            except ConcurrencyConflict:
                continue
        if self.pool_notes_at != self.proj.shape_version:
            self.pool_notes.clear()
            self.pool_notes_at = self.proj.shape_version
        self.live_reasons = with_pool_notes(self.proj, plan.unschedulable, self.pool_notes)
        self.reservation = plan.reservation
        # the reasons worth logging, appended together: one after another, a first cycle over 900 waiting jobs spent
        # 600 ms on their acks while 128 freed GPUs waited for the next cycle (bench.e2e --timeline)
        logged: list[tuple[str, Envelope]] = []
        for job_id, reason in self.live_reasons.items():
            job = self.proj.jobs.get(job_id)
            if job is None or job.state != "queued":
                continue
            if worth_logging(job.reason, self.reason_logged_at.get(job_id), reason, now, self.settings.reason_refresh_s):
                with self.traces.span("scheduler.unschedulable", job_id):  # the event continues the job's trace
                    logged.append((job_id, self.svc.envelope(ev.JobUnschedulable(job_id=job_id, reason=reason),
                                                             epoch=epoch)))
        for i in range(0, len(logged), PLACE_AT_ONCE):
            last = max(last, *await self.svc.log.append_many(env for _, env in logged[i:i + PLACE_AT_ONCE]))
            self.reason_logged_at.update((job_id, now) for job_id, _ in logged[i:i + PLACE_AT_ONCE])
        for job_id in [j for j in self.reason_logged_at if j not in plan.unschedulable]:
            del self.reason_logged_at[job_id]
        for job_id, reason in plan.cancellations.items():
            with self.traces.span("scheduler.cancel", job_id):
                last = max(last, await self.cancel_unmet(job_id, reason, epoch))
        last = max(last, await self.finish_preemptions(now, epoch))
        if last:
            try:
                await self.svc.caught_up(last, timeout=10)
            except NotCaughtUp as e:  # the next cycle decides on whatever the fold has reached by then
                log.warning("event=cycle_not_caught_up reason=%r", str(e))

    async def cancel_unmet(self, job_id: str, reason: str, epoch: int | None) -> int:
        """Cancel a waiting job whose dependency can never be met, once: the event id is the job's own (a second
        scheduler, or this one after a restart, appends a duplicate the log drops), and the append expects the
        job's last sequence (a job that moved meanwhile is decided again on the next cycle)."""
        job = self.proj.jobs.get(job_id)
        if job is None or job.state != "queued":
            return 0
        env = Envelope(ev.JobCancelled(job_id=job_id, reason=reason), id=f"{job_id}-dependency-never-met",
                       source="/gpuorch/scheduler", epoch=epoch)
        assert self.svc.log is not None
        try:
            seq = await self.svc.log.append(env, expected_last_subject_seq=job.seq)
        except ConcurrencyConflict:
            return 0
        log.info("event=cancelled job=%s reason=%r", job_id, reason)
        return seq

    async def finish_preemptions(self, now: float, epoch: int | None) -> int:
        """A preempting job whose grace is over (plus a margin for its agent's report) is requeued."""
        last = 0
        for job in list(self.proj.jobs.values()):
            if job.state == "preempting" and job.preempting_since is not None and now > job.preempting_since + job.grace_s + 5:
                with self.traces.span("scheduler.requeue", job.job_id):
                    last = max(last, *await self.requeue(job.job_id, attempt_key(job), epoch))
        return last

    async def requeue(self, job_id: str, why: str, epoch: int | None = None) -> list[int]:
        """A preempted job back to the queue, once per attempt (``why``: its attempt), whichever path decides it."""
        envs = [
            Envelope(ev.JobPreempted(job_id=job_id), id=f"{job_id}-preempted-{why}", source="/gpuorch/scheduler", epoch=epoch),
            Envelope(ev.JobQueued(job_id=job_id), id=f"{job_id}-requeued-{why}", source="/gpuorch/scheduler", epoch=epoch),
        ]
        assert self.svc.log is not None
        return await self.svc.log.append_many(envs)

    # --- reactions ----------------------------------------------------------------------

    async def react(self, env: Envelope) -> None:
        """Turn task exits into the job's end, or its requeue when its node stopped under it.

        Each decision is made once per (job, attempt, kind): its id is ``<job>-<attempt>-<kind>``, the attempt
        being the sequence of the job.placed the tasks ran for, so a standby replica, a redelivery after a
        restart or the other exits of a gang append nothing twice; and it expects the job's last sequence it was
        decided on, so a decision on a job that moved meanwhile is refused (its next event decides)."""
        self.events.observe(env, self.proj)
        if env.data.TYPE.startswith(RELEVANT):
            self.wake.set()
            self.freed = self.freed or not env.data.TYPE.startswith(SUBMISSION)
        self.traces.note(env)
        if not isinstance(env.data, ev.JobTaskExited):
            return
        e = env.data
        job = self.proj.jobs.get(e.job_id)
        if job is None or job.state not in ACTIVE or not self.proj.of_this_attempt(job, e):
            return  # ended already (a redelivery), or a late exit of an earlier attempt
        if job.state == "preempting":
            if not job.tasks_running:
                with span("scheduler.requeue", attributes={"gpuorch.job.id": job.job_id}):
                    await self.requeue(job.job_id, attempt_key(job))
            return
        if e.interrupted:
            why = f"task {e.task} interrupted: {e.reason or 'its node stopped'}"
            await self._decide(job, ev.JobRequeued(job_id=job.job_id, reason=why, interrupted=True), "requeued")
            return
        if e.code == 0:
            if len(job.tasks_exited) == job.spec.tasks and all(c == 0 for c in job.tasks_exited.values()):
                await self._decide(job, ev.JobSucceeded(job_id=job.job_id), "succeeded")
            return
        if e.code is not None:
            why = f"task {e.task} exited with code {e.code}" + (
                f": {e.reason}" if e.reason else
                f" ({SHELL_CODES[e.code]}: gpuorch logs {job.job_id} -t {e.task} --stderr)" if e.code in SHELL_CODES
                else "")
        elif e.signal is not None:
            why = f"task {e.task} was killed by signal {e.signal}" + (
                f" ({signal.Signals(e.signal).name})" if e.signal in SIGNALS else "")
        else:
            why = f"task {e.task}: {e.reason or 'ended without an exit status'}"
        await self._decide(job, ev.JobFailed(job_id=job.job_id, code=e.code, reason=why), "failed")

    async def _decide(self, job: JobRecord, event: ev.Event, kind: str) -> None:
        assert self.svc.log is not None
        env = Envelope(event, id=f"{job.job_id}-{attempt_key(job)}-{kind}", source="/gpuorch/scheduler")
        try:
            with span(f"scheduler.{kind}", attributes={"gpuorch.job.id": job.job_id}):
                await self.svc.log.append(env, expected_last_subject_seq=job.seq)
        except ConcurrencyConflict:
            log.info("event=decision_refused job=%s decision=%s attempt=%s reason='the job moved since'", job.job_id,
                     kind, attempt_key(job))
            return
        log.info("event=%s job=%s attempt=%s", event.TYPE.split(".")[1], job.job_id, attempt_key(job))


def on_cpu(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()``, and the CPU seconds this thread spent in it."""
    t = time.thread_time()
    out = fn()
    return out, time.thread_time() - t


def attempt_key(job: JobRecord) -> str:
    """The job's current attempt in decision ids: its job.placed's sequence (a job folded from a snapshot older
    than that field: its last sequence)."""
    return str(job.attempt) if job.attempt else f"seq{job.seq}"


def build(settings: Settings, metrics: Metrics | None = None) -> Service:
    return Scheduler(settings, metrics).svc
