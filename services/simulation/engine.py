"""Virtual-time replay through the live scheduler's own decision function.

Jobs arrive, the scheduler decides, jobs end; nothing else. The cluster state is
the fold (``SchedulerProjection``) of exactly the events the live services would
have appended (``job.submitted``, ``job.queued``, ``job.placed``, ``job.succeeded``
...), stamped with virtual time, and each cycle is ``service.decide`` on that
fold, as in the scheduler service (fair-share entitlements, reclaim, then
``run_cycle``). A cycle runs at every instant something the scheduler reacts to
happened (arrivals, ends, node events); nothing else moves the clock.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from services.scheduler.core import Plan, Policy, job_order
from services.scheduler.projection import SchedulerProjection
from services.scheduler.service import decide
from services.scheduler.snapshot import PendingJob
from services.simulation.traces import TraceJob
from shared import events as ev
from shared.cluster import ACTIVE, TERMINAL
from shared.events import Envelope, Event
from shared.model import MILLI, NodeInfo
from shared.settings import Settings

ARRIVE, END, REQUEUE, CANCEL, INFRA = "arrive", "end", "requeue", "cancel", "infra"
Signature = tuple[tuple[str, tuple[str, ...]], ...]  # per task: (node, GPU uuids)


def signature(placements: Sequence[ev.TaskPlacement]) -> Signature:
    """Where a job's tasks went, comparable across runs: (node, sorted GPU uuids) per task."""
    return tuple((p.node_id, tuple(sorted(g.uuid for g in p.gpus))) for p in sorted(placements, key=lambda p: p.task))


@dataclass
class Outcome:
    job_id: str
    submitted: float
    gpu_milli: int
    started: float | None = None  # first placement
    ended: float | None = None
    placement: Signature = ()
    preemptions: int = 0


@dataclass(frozen=True, slots=True)
class Sample:
    t: float
    allocated: int  # GPU milli held
    queued: int
    running: int


@dataclass
class SimResult:
    policy: str
    seed: int
    fifo: bool
    capacity: int  # GPU milli
    outcomes: dict[str, Outcome]
    samples: list[Sample]
    events: int = 0
    cycles: int = 0
    seconds: float = 0.0
    invalid: list[str] = field(default_factory=list)

    def metrics(self, jobs: Collection[str] | None = None, window: tuple[float, float] | None = None
                ) -> dict[str, float | int | None]:
        """Queueing delay (start - submit), completion time (end - submit), utilization, makespan.

        ``jobs``: measure only these (e.g. not the warm-up); ``window``: utilization over this
        span of virtual time (default: first submission to the last instant).
        """
        outs = [o for o in self.outcomes.values() if jobs is None or o.job_id in jobs]
        waits = sorted(o.started - o.submitted for o in outs if o.started is not None)
        jcts = [o.ended - o.submitted for o in outs if o.ended is not None and o.started is not None]
        t0 = min((o.submitted for o in outs), default=0.0)
        ends = [o.ended for o in outs if o.ended is not None]
        t_last = max(ends) if ends and len(ends) == len(outs) else (self.samples[-1].t if self.samples else t0)
        a, b = window or (t0, t_last)
        return {
            "jobs": len(outs),
            "started": len(waits),
            "completed": len(jcts),
            "never_started": len(outs) - len(waits),
            "avg_queue_delay_s": _mean(waits),
            "p50_queue_delay_s": _pct(waits, 50),
            "p99_queue_delay_s": _pct(waits, 99),
            "avg_jct_s": _mean(jcts),
            "makespan_s": round(t_last - t0, 3),
            "utilization_pct": round(100 * self.gpu_seconds(a, b) / (self.capacity * (b - a)), 3) if b > a and self.capacity else None,
            "peak_allocation_pct": round(100 * max((s.allocated for s in self.samples), default=0) / self.capacity, 3) if self.capacity else None,
            "max_queue": max((s.queued for s in self.samples), default=0),
            "simulated_events": self.events,
            "cycles": self.cycles,
            "wall_s": round(self.seconds, 3),
            "events_per_s": round(self.events / self.seconds) if self.seconds > 0 else None,
            "invalid_transitions": len(self.invalid),
        }

    def gpu_seconds(self, a: float = -math.inf, b: float = math.inf) -> float:
        """Allocated GPU milli integrated over [a, b] (the samples are a step function)."""
        total = 0.0
        for s, nxt in zip(self.samples, self.samples[1:]):
            lo, hi = max(s.t, a), min(nxt.t, b)
            if hi > lo:
                total += s.allocated * (hi - lo)
        return total


def _mean(xs: Sequence[float]) -> float | None:
    return round(sum(xs) / len(xs), 3) if xs else None


def _pct(sorted_xs: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile."""
    if not sorted_xs:
        return None
    return round(sorted_xs[max(0, math.ceil(p / 100 * len(sorted_xs)) - 1)], 3)


def live_policy(name: str, seed: int = 0, backfill: bool = True, settings: Settings | None = None) -> Policy:
    """The Policy the scheduler service builds from its settings, with this node scorer and seed."""
    s = settings or Settings()
    return Policy(name=name, seed=seed, backfill=backfill, reclaim_grace_s=s.reclaim_grace_s,
                  max_preemptions_per_hour=s.max_preemptions_per_hour)


class Simulation:
    """One replay of ``jobs`` on ``nodes`` under ``policy``; ``run()`` returns the result.

    ``fifo``: strict first-come-first-served: a job never starts while an earlier
    one waits (the cycle runs without backfill; placements after the first job left
    waiting are dropped). ``infra``: recorded node events (cordon, drain, loss) to
    replay at their times; nodes register at ``start``.
    """

    def __init__(
        self,
        nodes: Sequence[NodeInfo],
        jobs: Sequence[TraceJob],
        policy: Policy,
        fifo: bool = False,
        infra: Sequence[tuple[float, Event]] = (),
        start: float | None = None,
        half_life_s: float | None = None,
    ) -> None:
        self.policy = policy
        self.half_life_s = Settings().half_life_s if half_life_s is None else half_life_s
        self.fifo = fifo
        self.jobs = {j.job_id: j for j in jobs}
        if len(self.jobs) != len(jobs):
            raise ValueError("job ids must be unique")
        self.proj = SchedulerProjection()
        self.queued: set[str] = set()
        self.holding: set[str] = set()
        registered = {n.node_id: n for n in nodes}
        registered.update({e.node_id: e.node for _, e in infra if isinstance(e, ev.NodeRegistered)})
        self.capacity = sum(MILLI for n in registered.values() for g in n.gpus if not g.mig_enabled)
        self.heap: list[tuple[float, int, str, str, int]] = []
        self.order = 0
        self.seq = 0
        self.generation: dict[str, int] = {}
        self.outcomes = {j.job_id: Outcome(j.job_id, j.submit, j.spec.gpu_milli * j.spec.tasks) for j in jobs}
        self.allocated = 0
        self.infra = list(infra)
        t0 = min((j.submit for j in jobs), default=0.0) if start is None else start
        for n in nodes:
            self._push(t0, INFRA, "", len(self.infra))
            self.infra.append((t0, ev.NodeRegistered(node_id=n.node_id, node=n)))
        for i, (t, _) in enumerate(self.infra[: len(infra)]):
            self._push(t, INFRA, "", i)
        for j in jobs:
            self._push(j.submit, ARRIVE, j.job_id)
            if j.cancel_at is not None:
                self._push(j.cancel_at, CANCEL, j.job_id)

    def _push(self, t: float, kind: str, job_id: str, arg: int = 0) -> None:
        self.order += 1
        heapq.heappush(self.heap, (t, self.order, kind, job_id, arg))

    def _fold(self, event: Event, t: float) -> None:
        self.seq += 1
        self.proj.apply(Envelope(event, id=f"sim-{self.seq}", source="/gpuorch/simulate",
                                 time=datetime.fromtimestamp(t, UTC), seq=self.seq))

    # --- what happens at one instant ----------------------------------------------------

    def _handle(self, t: float, kind: str, job_id: str, arg: int) -> bool:
        """Fold one due event; True if the scheduler would react to it."""
        if kind == INFRA:
            event = self.infra[arg][1]
            self._fold(event, t)
            return True
        job = self.proj.jobs.get(job_id)
        if kind == ARRIVE:
            self._fold(ev.JobSubmitted(job_id=job_id, spec=self.jobs[job_id].spec, submitted_at=t), t)
            self._fold(ev.JobQueued(job_id=job_id), t)
            self._track(job_id)
            return True
        if job is None:
            return False
        if kind == END and job.state in ("placed", "running") and arg == self.generation.get(job_id):
            self._release(job_id, ev.JobSucceeded(job_id=job_id), t)
            return True
        if kind == CANCEL and job.state in ("queued", "placed", "running"):
            self._release(job_id, ev.JobCancelled(job_id=job_id, reason="cancelled (recorded)"), t)
            return True
        if kind == REQUEUE and job.state == "preempting" and arg == self.generation.get(job_id):
            self._release(job_id, ev.JobPreempted(job_id=job_id), t, ended=False)
            self._fold(ev.JobQueued(job_id=job_id), t)
            self._track(job_id)
            return True
        return False

    def _track(self, job_id: str) -> None:
        """Keep the counts of waiting and holding jobs in step with the job's state after a fold."""
        self.queued.discard(job_id)
        self.holding.discard(job_id)
        job = self.proj.jobs.get(job_id)
        if job is None or job.state in TERMINAL:
            return
        if job.state == "queued":
            self.queued.add(job_id)
        elif job.state in ACTIVE:
            self.holding.add(job_id)

    def _release(self, job_id: str, event: Event, t: float, ended: bool = True) -> None:
        job = self.proj.jobs[job_id]
        held = list(job.placements) if job.state in ("placed", "running", "preempting") else []
        self._fold(event, t)
        self.allocated -= sum(g.milli for p in held for g in p.gpus)
        self._track(job_id)
        if ended and held:
            self.outcomes[job_id].ended = t

    def _fifo_order(self) -> list[PendingJob]:
        jobs = [self.proj.jobs[j] for j in self.queued]
        return job_order([PendingJob(j.job_id, j.spec, j.submitted_at) for j in jobs])

    def _commit(self, plan: Plan, now: float, pending: Sequence[PendingJob]) -> None:
        placements = plan.placements
        if self.fifo:
            keep = []
            for j in pending:
                if j.job_id not in placements:
                    break
                keep.append(j.job_id)
            placements = {k: placements[k] for k in keep}
        for job_id, p in placements.items():
            self._fold(ev.JobPlaced(job_id=job_id, placements=p.tasks, spread=p.spread, policy=p.policy), now)
            job = self.proj.jobs[job_id]
            if job.state != "placed":
                continue  # the fold refused it; recorded in proj.invalid_transitions
            self._track(job_id)
            self.allocated += sum(g.milli for t in p.tasks for g in t.gpus)
            out = self.outcomes[job_id]
            if out.started is None:
                out.started, out.placement = now, signature(p.tasks)
            gen = self.generation[job_id] = self.generation.get(job_id, 0) + 1
            duration = self.jobs[job_id].duration
            if duration is not None:
                self._push(now + duration, END, job_id, gen)
        for pre in plan.preemptions:
            job = self.proj.jobs.get(pre.job_id)
            if job is None or job.state not in ("placed", "running"):
                continue
            self._fold(ev.JobPreempting(job_id=pre.job_id, reason=pre.reason, grace_s=pre.grace_s), now)
            self._track(pre.job_id)
            self.outcomes[pre.job_id].preemptions += 1
            self._push(now + pre.grace_s, REQUEUE, pre.job_id, self.generation.get(pre.job_id, 0))

    # --- the loop -------------------------------------------------------------------------

    def run(self, progress: Callable[[int, int], None] | None = None, until: float | None = None) -> SimResult:
        """Process every event (up to virtual time ``until``); a cycle after each instant that changed something."""
        t_wall = time.perf_counter()
        samples: list[Sample] = []
        cycles = 0
        done, total = 0, len(self.heap)
        while self.heap and (until is None or self.heap[0][0] <= until):
            now = self.heap[0][0]
            react = False
            while self.heap and self.heap[0][0] == now:
                _, _, kind, job_id, arg = heapq.heappop(self.heap)
                react |= self._handle(now, kind, job_id, arg)
                done += 1
            if react and self.queued:
                order = self._fifo_order() if self.fifo else []
                self._commit(decide(self.proj, self.policy, now, self.half_life_s), now, order)
                cycles += 1
            samples.append(Sample(now, self.allocated, len(self.queued), len(self.holding)))
            if progress is not None:
                total = max(total, done + len(self.heap))
                progress(done, total)
        return SimResult(self.policy.name, self.policy.seed, self.fifo, self.capacity, self.outcomes, samples,
                         events=self.seq, cycles=cycles, seconds=time.perf_counter() - t_wall,
                         invalid=list(self.proj.invalid_transitions))


def simulate_jobs(
    nodes: Sequence[NodeInfo], jobs: Sequence[TraceJob], policy: str = "fgd", seed: int = 0, *,
    backfill: bool = True, fifo: bool = False, progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """Replay ``jobs`` on ``nodes`` under a named policy (FIFO: strict order, no backfill)."""
    return Simulation(nodes, jobs, live_policy(policy, seed, backfill and not fifo), fifo=fifo).run(progress)
