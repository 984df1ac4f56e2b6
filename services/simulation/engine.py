"""Virtual-time replay through the live scheduler's own decision function.

Jobs arrive, the scheduler decides, jobs end; nothing else. The cluster state is
the fold (``SchedulerProjection``) of exactly the events the live services would
have appended (``job.submitted``, ``job.queued``, ``job.placed``, ``job.succeeded``
...), stamped with virtual time, and each cycle is ``scheduler.decide`` on that
fold, as in the scheduler service (fair-share entitlements, reclaim, then
``run_cycle``). A cycle runs at every instant something the scheduler reacts to
happened (arrivals, ends, node events); nothing else moves the clock.

With a ``HealthPolicy`` the health service's own decisions join in
(``services/health/decisions.py`` on the same fold): injected GPU faults are
judged by the XID table, cordon and drain their node, and preempt its jobs with
grace; a lost node (its tasks die with it) is declared lost after the heartbeat
timeout and its jobs requeued while their retries last; a job past its time
limit is stopped. Tasks start at placement (``job.task_started``), so limits
count from there.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from services.health import decisions, rules
from services.health.decisions import Decision
from services.health.projection import SOURCE as HEALTH, HealthProjection
from services.health.rules import HealthPolicy
from services.scheduler.core import Plan, Policy, job_order
from services.scheduler.decide import decide
from services.scheduler.snapshot import PendingJob
from services.simulation.faults import FaultEntry, FaultRate, Faults
from services.simulation.traces import TraceJob
from shared import events as ev
from shared.cluster import ACTIVE, TERMINAL, JobRecord, agent_source
from shared.events import Envelope, Event
from shared.model import MILLI, NodeInfo
from shared.settings import Settings

ARRIVE, END, REQUEUE, CANCEL, INFRA = "arrive", "end", "requeue", "cancel", "infra"
FAULT, DRAW, SILENT, REPAIR, LIMIT = "fault", "draw", "silent", "repair", "limit"  # health: a fault (listed or drawn),
HEALTH_KINDS = frozenset({FAULT, DRAW, SILENT, REPAIR, LIMIT})  # a heartbeat check, a repair, a time limit
PERIODIC = frozenset({DRAW, "tick"})  # events that schedule their successor: they alone keep no replay going
SIM = "/gpuorch/simulate"
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
    requeues: int = 0  # sent back to the queue by health (node lost) and placed again
    state: str = "submitted"  # where it was left: succeeded, failed, cancelled, or still waiting or holding
    interrupted_gpu_s: float = 0.0  # GPU-seconds of runs cut short (preempted, requeued, failed) since their last checkpoint
    saved_s: float = 0.0  # work kept in checkpoints: a restart runs only the rest


@dataclass(frozen=True, slots=True)
class Sample:
    t: float
    allocated: int  # GPU milli held
    queued: int
    running: int
    down: int = 0  # GPU milli out of service: on cordoned, draining or lost nodes, or marked unhealthy


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
    health: dict[str, int | float | dict[str, int]] | None = None  # what the health rules did (None: they did not run)

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
            "failed": sum(1 for o in outs if o.state == "failed"),
            "gpu_hours_interrupted": round(sum(o.interrupted_gpu_s for o in outs) / 3600, 2),
            **({"health": {**self.health, "gpu_hours_out_of_service": round(self.down_gpu_seconds(a, b) / 3600, 2)}}
               if self.health is not None else {}),
        }

    def gpu_seconds(self, a: float = -math.inf, b: float = math.inf, field: str = "allocated") -> float:
        """A sample field (GPU milli allocated, by default) integrated over [a, b] (the samples are a step function)."""
        total = 0.0
        for s, nxt in zip(self.samples, self.samples[1:]):
            lo, hi = max(s.t, a), min(nxt.t, b)
            if hi > lo:
                total += getattr(s, field) * (hi - lo)
        return total

    def down_gpu_seconds(self, a: float = -math.inf, b: float = math.inf) -> float:
        """GPU-seconds out of service over [a, b]."""
        return self.gpu_seconds(a, b, "down") / MILLI


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
    replay at their times; nodes register at ``start``. ``health``: the health
    rules' policy, to run them; ``faults``: what to inject (``faults.py``).
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
        health: HealthPolicy | None = None,
        faults: Faults = (),
        checkpoint_s: float | None = None,
    ) -> None:
        self.policy = policy
        self.checkpoint_s = checkpoint_s  # jobs save their progress this often; None: a restart starts from scratch
        self.half_life_s = Settings().half_life_s if half_life_s is None else half_life_s
        self.fifo = fifo
        self.jobs = {j.job_id: j for j in jobs}
        if len(self.jobs) != len(jobs):
            raise ValueError("job ids must be unique")
        if faults and health is None:
            raise ValueError("injecting faults takes the health rules: give a HealthPolicy")
        self.proj = HealthProjection()  # the scheduler's fold, plus what health remembers of drains and faults
        self.queued: set[str] = set()
        self.holding: set[str] = set()
        registered = {n.node_id: n for n in nodes}
        registered.update({e.node_id: e.node for _, e in infra if isinstance(e, ev.NodeRegistered)})
        self.capacity = sum(MILLI for n in registered.values() for g in n.gpus if not g.mig_enabled)
        self.static_gpus = sum(len(n.gpus) for n in registered.values())
        self.heap: list[tuple[float, int, str, str, int]] = []
        self.order = 0
        self.periodic = 0  # events in the heap that only schedule more of themselves
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
        # health
        self.health = health
        self.tick = min(1.0, health.heartbeat_timeout_s / 4) if health else 1.0  # as the health service's round
        self.decided: Counter[str] = Counter()  # health decisions by event type
        self.injected: Counter[str] = Counter()  # faults by kind
        self.dead: dict[str, float] = {}  # node -> when it stopped beating: its tasks died with it
        self.last_fault: dict[str, float] = {}  # node -> its last fault (a repair answers the last one)
        self.down = 0  # GPU milli out of service
        self.draining = False
        self.rate = faults if isinstance(faults, FaultRate) else None
        self.rng = random.Random(self.rate.seed if self.rate else 0)
        self.faults: list[FaultEntry] = [] if self.rate else list(faults)
        for i, f in enumerate(self.faults):
            self._push(t0 + f.t, FAULT, f.node, i)
        # drawn faults stop when the trace would have ended without them: jobs restarting from scratch can
        # take longer than the mean time between faults, and the replay must end
        self.fault_horizon = max((j.submit + (j.duration or 0.0) for j in jobs), default=t0)
        if self.rate and self.rate.per_1000_gpu_days > 0:
            self._push(t0, DRAW, "", 0)
        if health is not None:  # the simulated health leader's one term: its decisions carry epoch 1
            self._fold(ev.LeaderElected(lease="health", source=HEALTH, epoch=1, holder="simulate"), t0, HEALTH)

    def _push(self, t: float, kind: str, job_id: str, arg: int = 0) -> None:
        self.order += 1
        self.periodic += kind in PERIODIC
        heapq.heappush(self.heap, (t, self.order, kind, job_id, arg))

    def _more(self) -> bool:
        """Something is left to happen besides the periodic events."""
        return len(self.heap) > self.periodic

    def _fold(self, event: Event, t: float, source: str = SIM) -> int:
        self.seq += 1
        self.proj.apply(Envelope(event, id=f"sim-{self.seq}", source=source, time=datetime.fromtimestamp(t, UTC),
                                 seq=self.seq, epoch=1 if source == HEALTH else None))
        return self.seq

    def _fold_job(self, job_id: str, event: Event, t: float, source: str = SIM) -> int:
        """Fold one event of a job, keeping the allocation, the waiting and holding sets and its outcome in step."""
        job = self.proj.jobs.get(job_id)
        held = _held(job)
        began = None if job is None else job.started_at if self.health is not None else job.placed_at  # its tasks ran since
        died = min((self.dead[p.node_id] for p in job.placements if p.node_id in self.dead), default=t) if job else t
        seq = self._fold(event, t, source)
        job = self.proj.jobs[job_id]
        holds = _held(job)
        self.allocated += holds - held
        self.queued.discard(job_id)
        self.holding.discard(job_id)
        if job.state == "queued":
            self.queued.add(job_id)
        elif job.state in ACTIVE:
            self.holding.add(job_id)
        out = self.outcomes[job_id]
        out.state = job.state
        if held and not holds:
            if job.state in TERMINAL:
                out.ended = t
            if job.state not in ("succeeded", "cancelled") and began is not None:
                ran = max(0.0, min(t, died) - began)  # a dead node's tasks stopped when it died
                kept = math.floor(ran / self.checkpoint_s) * self.checkpoint_s if self.checkpoint_s else 0.0
                out.saved_s += kept
                out.interrupted_gpu_s += held / MILLI * (ran - kept)
        return seq

    # --- what happens at one instant ----------------------------------------------------

    def _handle(self, t: float, kind: str, job_id: str, arg: int) -> bool:
        """Fold one due event; True if the scheduler would react to it."""
        if kind == INFRA:
            event = self.infra[arg][1]
            self._fold(event, t)
            self._nodes_changed()
            if self.health is not None and isinstance(event, (ev.NodeLost, ev.NodeDrainRequested)):
                self._round(t)  # health acts on a recorded loss or drain as on its own
            return True
        if kind in HEALTH_KINDS:
            return self._health_event(t, kind, job_id, arg)
        job = self.proj.jobs.get(job_id)
        if kind == ARRIVE:
            self._fold(ev.JobSubmitted(job_id=job_id, spec=self.jobs[job_id].spec, submitted_at=t), t)
            self._fold_job(job_id, ev.JobQueued(job_id=job_id), t)
            return True
        if job is None:
            return False
        current = arg == self.generation.get(job_id) and not self._on_dead_node(job)  # a dead node reports nothing
        if kind == END and job.state in ("placed", "running") and current:
            self._fold_job(job_id, ev.JobSucceeded(job_id=job_id), t)
            return True
        if kind == CANCEL and job.state in ("queued", "placed", "running"):
            self._fold_job(job_id, ev.JobCancelled(job_id=job_id, reason="cancelled (recorded)"), t)
            return True
        if kind == REQUEUE and job.state == "preempting" and current:
            self._fold_job(job_id, ev.JobPreempted(job_id=job_id), t)
            self._fold_job(job_id, ev.JobQueued(job_id=job_id), t)
            return True
        return False

    def _on_dead_node(self, job: JobRecord) -> bool:
        return bool(self.dead) and any(p.node_id in self.dead for p in job.placements)

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
            self._fold_job(job_id, ev.JobPlaced(job_id=job_id, placements=p.tasks, spread=p.spread, policy=p.policy), now)
            job = self.proj.jobs[job_id]
            if job.state != "placed":
                continue  # the fold refused it; recorded in proj.invalid_transitions
            out = self.outcomes[job_id]
            if out.started is None:
                out.started, out.placement = now, signature(p.tasks)
            gen = self.generation[job_id] = self.generation.get(job_id, 0) + 1
            if self._on_dead_node(job):
                continue  # its tasks never start: health finds the node lost and requeues it
            duration = self.jobs[job_id].duration
            if duration is not None:
                duration = max(0.0, duration - out.saved_s)
                self._push(now + duration, END, job_id, gen)
            if self.health is not None:
                for task in job.placements:
                    self._fold_job(job_id, ev.JobTaskStarted(job_id=job_id, task=task.task, node_id=task.node_id), now,
                                   agent_source(task.node_id))
                limit = job.spec.time_limit_s
                if limit and (duration is None or duration > limit):
                    self._push(now + limit + self.tick, LIMIT, job_id, gen)
        for pre in plan.preemptions:
            job = self.proj.jobs.get(pre.job_id)
            if job is None or job.state not in ("placed", "running"):
                continue
            self._fold_job(pre.job_id, ev.JobPreempting(job_id=pre.job_id, reason=pre.reason, grace_s=pre.grace_s), now)
            self.outcomes[pre.job_id].preemptions += 1
            self._push(now + pre.grace_s, REQUEUE, pre.job_id, self.generation.get(pre.job_id, 0))

    # --- health ---------------------------------------------------------------------------

    def _health_event(self, t: float, kind: str, key: str, arg: int) -> bool:
        assert self.health is not None
        if kind == DRAW:
            return self._draw(t, first=not arg)
        if kind == FAULT:
            f = self.faults[arg]
            node = self.proj.nodes.get(f.node)
            if node is None or f.gpu >= len(node.info.gpus):
                self.injected["not present"] += 1
                return False
            return self._fault(t, f.node, node.info.gpus[f.gpu].uuid, f.xid, f.repair_s)
        if kind == SILENT:  # the heartbeat rule, on a node silent since it died
            node, since = self.proj.nodes.get(key), self.dead.get(key)
            if node is None or node.lost or since is None:
                return False
            lost = [decisions.node_lost(self.proj, n, silent, self.health)
                    for n, silent in rules.lost_nodes({key: since}, t, self.health.heartbeat_timeout_s)]
            return self._decide(lost, t) | self._round(t)
        if kind == REPAIR:
            return self._repair(t, key, arg)
        job = self.proj.jobs.get(key)  # LIMIT
        if job is None or job.state != "running" or arg != self.generation.get(key):
            return False
        return self._round(t, limits=(key,))

    def _draw(self, t: float, first: bool) -> bool:
        """A candidate of the fault process at the largest possible rate, kept in proportion to the GPUs present
        (thinning), then the next candidate."""
        assert self.rate is not None
        changed = False
        gmax = self._max_gpus()
        if not first:
            present = [(n, g.uuid) for n, s in self.proj.nodes.items() if not s.lost and n not in self.dead for g in s.info.gpus]
            if present and self.rng.random() * gmax < len(present):
                node_id, uuid = self.rng.choice(present)
                changed = self._fault(t, node_id, uuid, FaultRate.kind(self.rng.random()), self.rate.repair_s)
        if self._more() and gmax:
            nxt = t + self.rng.expovariate(self.rate.per_gpu_second() * gmax)
            if nxt <= self.fault_horizon:
                self._push(nxt, DRAW, "", 1)
        return changed

    def _max_gpus(self) -> int:
        """The most GPUs the cluster can have: the rate of the fault process's candidates."""
        return self.static_gpus

    def _fault(self, t: float, node_id: str, uuid: str, xid: int | None, repair_s: float | None) -> bool:
        assert self.health is not None
        self.injected[f"xid {xid}" if xid is not None else "node lost"] += 1
        if xid is None:
            if node_id in self.dead:
                return False
            self.dead[node_id] = t
            self._nodes_changed()
            self._push(t + self.health.heartbeat_timeout_s + self.tick, SILENT, node_id)
            if repair_s is not None:  # back no sooner than it is found lost: its jobs are requeued first
                self._repair_at(node_id, t, max(repair_s, self.health.heartbeat_timeout_s + 2 * self.tick))
            return False  # nobody knows yet
        if repair_s is not None:
            self._repair_at(node_id, t, repair_s)
        fault = rules.xid_fault(node_id, uuid, xid, t)
        if fault is None:
            return False
        return self._decide(decisions.mark(self.proj, fault, self.health), t) | self._round(t)

    def _repair_at(self, node_id: str, t: float, after_s: float) -> None:
        """A repair answers the node's last fault that asked for one: an earlier repair then does nothing."""
        self.last_fault[node_id] = t
        self._push(t + after_s, REPAIR, node_id, round(t * 1000))

    def _repair(self, t: float, node_id: str, fault_ms: int) -> bool:
        """The node is back (its agent registers again) and an operator resumes it, unless it faulted again since."""
        node = self.proj.nodes.get(node_id)
        if node is None or round(self.last_fault.get(node_id, -1) * 1000) != fault_ms:
            return False
        if self.dead.pop(node_id, None) is not None:
            self._fold(ev.NodeRegistered(node_id=node_id, node=node.info), t)
        if node.cordoned or node.unhealthy:
            self._fold(ev.NodeResumed(node_id=node_id), t)
        self.injected["repaired"] += 1
        self._nodes_changed()
        return True

    def _round(self, t: float, limits: Collection[str] = ()) -> bool:
        assert self.health is not None
        return self._decide(decisions.round_of(self.proj, t, self.health, {}, limits), t)

    def _decide(self, made: Sequence[Decision], t: float) -> bool:
        """Fold health's decisions as the log would take them: one decided on a job that moved since is refused."""
        prev: int | None = None
        changed = False
        for d in made:
            if d.chained and prev is None:
                continue
            job_id: str | None = getattr(d.event, "job_id", None)
            expected = prev if d.chained else d.expected
            if job_id is not None and expected is not None and self.proj.jobs[job_id].seq != expected:
                prev = None
                continue
            prev = self._fold_job(job_id, d.event, t, HEALTH) if job_id is not None else self._fold(d.event, t, HEALTH)
            self.decided[d.event.TYPE] += 1
            changed = True
            if isinstance(d.event, ev.JobPreempting):
                self.outcomes[d.event.job_id].preemptions += 1
                self._push(t + d.event.grace_s, REQUEUE, d.event.job_id, self.generation.get(d.event.job_id, 0))
            elif isinstance(d.event, ev.JobRequeued):
                self.outcomes[d.event.job_id].requeues += 1
        if changed:
            self._nodes_changed()
        return changed

    def _nodes_changed(self) -> None:
        """Recount the GPUs out of service and whether a drain is open (health only: O(nodes))."""
        if self.health is None:
            return
        down, draining = 0, False
        for node_id, n in self.proj.nodes.items():
            gpus = [g for g in n.info.gpus if not g.mig_enabled]
            out = not n.schedulable or node_id in self.dead
            down += MILLI * sum(1 for g in gpus if out or g.uuid in n.unhealthy)
            draining = draining or n.draining
        self.down, self.draining = down, draining

    def health_report(self) -> dict[str, int | float | dict[str, int]] | None:
        if self.health is None:
            return None
        d = self.decided
        return {"faults": dict(sorted(self.injected.items())), "gpus_marked": d["gpu.unhealthy"],
                "nodes_cordoned": d["node.cordoned"], "nodes_drained": d["node.drained"], "nodes_lost": d["node.lost"],
                "jobs_preempted_by_drains": d["job.preempting"], "jobs_requeued": d["job.requeued"],
                "jobs_failed": d["job.failed"], "jobs_timed_out": d["job.timed_out"]}

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
                self.periodic -= kind in PERIODIC
                react |= self._handle(now, kind, job_id, arg)
                done += 1
            if self.draining:  # jobs left the node: the drain may be complete
                react |= self._round(now)
            if react and self.queued:
                order = self._fifo_order() if self.fifo else []
                self._commit(decide(self.proj, self.policy, now, self.half_life_s), now, order)
                cycles += 1
            samples.append(Sample(now, self.allocated, len(self.queued), len(self.holding), self.down))
            if progress is not None:
                total = max(total, done + len(self.heap))
                progress(done, total)
        return SimResult(self.policy.name, self.policy.seed, self.fifo, self.capacity, self.outcomes, samples,
                         events=self.seq, cycles=cycles, seconds=time.perf_counter() - t_wall,
                         invalid=list(self.proj.invalid_transitions), health=self.health_report())


def _held(job: JobRecord | None) -> int:
    """GPU milli a job holds."""
    return sum(g.milli for p in job.placements for g in p.gpus) if job is not None and job.state in ACTIVE else 0


def live_health(settings: Settings | None = None) -> HealthPolicy:
    """The HealthPolicy the health service builds from its settings."""
    return HealthPolicy.of(settings or Settings())


def simulate_jobs(
    nodes: Sequence[NodeInfo], jobs: Sequence[TraceJob], policy: str = "fgd", seed: int = 0, *,
    backfill: bool = True, fifo: bool = False, progress: Callable[[int, int], None] | None = None,
    health: HealthPolicy | None = None, faults: Faults = (), checkpoint_s: float | None = None,
) -> SimResult:
    """Replay ``jobs`` on ``nodes`` under a named policy (FIFO: strict order, no backfill), with the health rules,
    injected faults and checkpoints if given."""
    return Simulation(nodes, jobs, live_policy(policy, seed, backfill and not fifo), fifo=fifo, health=health,
                      faults=faults, checkpoint_s=checkpoint_s).run(progress)
