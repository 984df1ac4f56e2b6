"""Fair-share scenarios in virtual time, through the same fold and the same scheduling cycle as the live stack.

Every step appends events to a ``SchedulerProjection`` (nothing is mocked: the
fold checks every transition) and asks ``decide`` — entitlements, reclaim and
``run_cycle`` — what to do, exactly as the scheduler service does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import UTC, datetime

from services.scheduler.core import Policy
from services.scheduler.projection import SchedulerProjection
from services.scheduler.decide import decide
from shared import events as ev
from shared.cluster import agent_source
from shared.events import Envelope
from shared.fairshare import jain_index, leaves
from shared.model import GpuAmount, JobSpec, QueueSpec, TaskResources
from shared.profiles import build


@dataclass(frozen=True)
class QueueLoad:
    path: str
    spec: QueueSpec
    backlog: int = 0  # jobs kept waiting at all times (0: the queue submits nothing)
    start_s: float = 0.0  # when it starts submitting


@dataclass(frozen=True)
class Scenario:
    name: str
    nodes: int
    queues: tuple[QueueLoad, ...]
    job_gpus: tuple[int, ...] = (1, 2, 4, 8)
    job_minutes: tuple[int, int] = (20, 120)
    step_s: float = 60.0
    half_life_s: float = 86400.0
    grace_s: int = 300
    reclaim_after_s: float = 600.0  # reclaim for work that waited this long: churn frees most GPUs first


def fairshare_1000() -> Scenario:
    """1,000 GPUs: research 40% (nlp 50, vision 30, speech 20), production 40% (inference 70, training 30),
    exploration 20%; reclaim order production > research > exploration; 5-minute grace."""
    def q(g: float, prio: int = 0, w: float = 1.0) -> QueueSpec:
        return QueueSpec(guaranteed=GpuAmount(gpus=g), weight=w, priority=prio)

    return Scenario("fairshare-1000", nodes=125, queues=(
        QueueLoad("research", q(400, 1, 4)), QueueLoad("research.nlp", q(200, 1, 5), 40),
        QueueLoad("research.vision", q(120, 1, 3), 30), QueueLoad("research.speech", q(80, 1, 2), 20),
        QueueLoad("production", q(400, 2, 4)), QueueLoad("production.inference", q(280, 2, 7), 60, start_s=6 * 3600),
        QueueLoad("production.training", q(120, 2, 3), 30),
        QueueLoad("exploration", q(200, 0, 2), 60),
    ))


def weighted(weights: tuple[float, ...], nodes: int = 64) -> Scenario:
    """Saturating queues with no guarantees, split by weight alone (the 3:2:1 check)."""
    return Scenario(f"weights-{':'.join(f'{w:g}' for w in weights)}", nodes=nodes, queues=tuple(
        QueueLoad(f"q{i}", QueueSpec(weight=w), backlog=40) for i, w in enumerate(weights)))


@dataclass
class _Run:
    proj: SchedulerProjection = field(default_factory=SchedulerProjection)
    seq: int = 0
    t: float = 0.0
    ends: dict[str, float] = field(default_factory=dict)  # job -> when it finishes
    jobs_made: int = 0

    def emit(self, *events: ev.Event) -> None:
        for e in events:
            self.seq += 1
            source = agent_source(e.node_id) if isinstance(e, ev.JobTaskExited) else "/gpuorch"
            self.proj.apply(Envelope(e, id=f"sim-{self.seq}", source=source, time=datetime.fromtimestamp(self.t, UTC),
                                     seq=self.seq))


def run(scenario: Scenario, hours: float, seed: int = 1, policy: Policy | None = None) -> dict:
    """Simulate; return GPU-hours per leaf queue, their shares, Jain's index over weight-normalised shares."""
    rng = random.Random(seed)
    policy = policy or Policy(name="fgd", reclaim_grace_s=scenario.grace_s)
    sim = _Run(t=1_800_000_000.0)  # a fixed epoch: runs are reproducible
    start = sim.t
    for i in range(scenario.nodes):
        info = build("dgx-h100", f"n{i:04d}")
        sim.emit(ev.NodeRegistered(node_id=info.node_id, node=info))
    for ql in scenario.queues:
        sim.emit(ev.QueueDefined(path=ql.path, spec=ql.spec))
    loads = {ql.path: ql for ql in scenario.queues if ql.path in leaves({q.path: q for q in scenario.queues})}
    while sim.t < start + hours * 3600:
        for job_id, end in sorted(sim.ends.items(), key=lambda kv: kv[1]):
            job = sim.proj.jobs.get(job_id)
            if end <= sim.t and job is not None and job.state in ("placed", "running"):
                sim.emit(ev.JobTaskExited(job_id=job_id, task=0, node_id=job.placements[0].node_id, code=0),
                         ev.JobSucceeded(job_id=job_id))
                del sim.ends[job_id]
        for job in list(sim.proj.jobs.values()):
            if job.state == "preempting" and job.preempting_since is not None and sim.t >= job.preempting_since + job.grace_s:
                sim.emit(ev.JobPreempted(job_id=job.job_id), ev.JobQueued(job_id=job.job_id))
                sim.ends.pop(job.job_id, None)
        _, pending = sim.proj.queue_load()
        waiting: dict[str, int] = {}
        for job in sim.proj.jobs.values():
            if job.state == "queued":
                waiting[job.spec.queue] = waiting.get(job.spec.queue, 0) + 1
        for path, ql in loads.items():
            if sim.t - start < ql.start_s:
                continue
            for _ in range(ql.backlog - waiting.get(path, 0)):
                sim.jobs_made += 1
                spec = JobSpec(name=f"{path.replace('.', '-')}-{sim.jobs_made}", queue=path,
                               resources=TaskResources(gpus=rng.choice(scenario.job_gpus)))
                job_id = f"j{sim.jobs_made:07d}"
                sim.emit(ev.JobSubmitted(job_id=job_id, spec=spec), ev.JobQueued(job_id=job_id))
        plan = decide(sim.proj, policy, sim.t, scenario.half_life_s, reclaim_after_s=scenario.reclaim_after_s)
        for job_id, p in plan.placements.items():
            sim.emit(ev.JobPlaced(job_id=job_id, placements=p.tasks, spread=p.spread, policy=p.policy))
            sim.ends[job_id] = sim.t + 60 * rng.randint(*scenario.job_minutes)
        for pre in plan.preemptions:
            sim.emit(ev.JobPreempting(job_id=pre.job_id, reason=pre.reason, grace_s=pre.grace_s))
        sim.t += scenario.step_s
    used = sim.proj.gpu_seconds(start, sim.t)
    hours_by_queue = {q: used.get(q, 0.0) / 3600 for q in loads}
    total = sum(hours_by_queue.values()) or 1.0
    weights = {q: loads[q].spec.weight for q in loads}
    normalised = [hours_by_queue[q] / weights[q] for q in loads]
    return {
        "scenario": scenario.name, "hours": hours, "seed": seed, "gpus": scenario.nodes * 8,
        "gpu_hours": {q: round(v, 1) for q, v in hours_by_queue.items()},
        "share": {q: round(v / total, 4) for q, v in hours_by_queue.items()},
        "jain_index_weighted": round(jain_index(normalised), 4),
        "preemptions": sum(len(j.preemptions) for j in sim.proj.jobs.values()),
        "invalid_transitions": sim.proj.invalid_count,
        "events": sim.seq,
    }
