"""What one scheduling cycle sees: free capacity per GPU, topology, pending and running jobs, entitlements."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from shared.events import TaskPlacement
from shared.fairshare import Ratios
from shared.model import MILLI, PRIORITY_RANK, JobSpec

if TYPE_CHECKING:  # shared.cluster pulls in the runtime (NATS, FastAPI); a pure core only reads its shape
    from shared.cluster import ClusterProjection, JobRecord, NodeState

HOLDING = frozenset({"placed", "running", "preempting"})  # = shared.cluster.ACTIVE


@dataclass(frozen=True, slots=True)
class MigSliceSnap:
    uuid: str
    profile: str
    free: bool


@dataclass(frozen=True, slots=True)
class GpuSnap:
    uuid: str
    index: int
    model: str
    memory_mib: int
    compute_capability: str = ""
    nvlink_domain: str | None = None
    healthy: bool = True
    free_milli: int = MILLI  # 0 when unhealthy, on an unschedulable node, or in MIG mode
    mig_enabled: bool = False
    mig_slices: tuple[MigSliceSnap, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeSnap:
    node_id: str
    gpus: tuple[GpuSnap, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    rack: str = ""
    zone: str = ""
    cpu_free: int = 0
    mem_free: int = 0
    cpu_total: int = 0
    mem_total: int = 0
    status: str = "ready"  # ready | cordoned | draining | lost

    @property
    def schedulable(self) -> bool:
        return self.status == "ready"


@dataclass(frozen=True, slots=True)
class PendingJob:
    job_id: str
    spec: JobSpec
    submitted_at: float = 0.0
    preemptions: int = 0
    owner: str = ""

    @property
    def queue(self) -> str:
        return self.spec.queue

    @property
    def priority_rank(self) -> int:
        return PRIORITY_RANK[self.spec.priority]


@dataclass(frozen=True, slots=True)
class RunningJob:
    job_id: str
    spec: JobSpec
    placements: tuple[TaskPlacement, ...]
    placed_at: float = 0.0
    started_at: float | None = None
    preempting: bool = False
    preemptions: tuple[float, ...] = ()  # when it was evicted before
    owner: str = ""

    @property
    def queue(self) -> str:
        return self.spec.queue

    @property
    def priority_rank(self) -> int:
        return PRIORITY_RANK[self.spec.priority]

    @property
    def time_limit_s(self) -> int | None:
        return self.spec.time_limit_s

    @property
    def gpu_milli(self) -> int:
        return sum(share.milli for p in self.placements for share in p.gpus)

    def expected_end(self, now: float) -> float:
        """When its GPUs should be free: start + time limit; never before now; inf without a limit."""
        if self.preempting:
            return now
        if self.spec.time_limit_s is None:
            return math.inf
        start = self.started_at if self.started_at is not None else self.placed_at
        return max(now, start + self.spec.time_limit_s)


@dataclass(frozen=True, slots=True)
class Snapshot:
    nodes: tuple[NodeSnap, ...] = ()
    pending: tuple[PendingJob, ...] = ()
    running: tuple[RunningJob, ...] = ()
    entitlements: Mapping[str, float] | None = None  # GPU-equivalents per queue, from quota; None: order queues by name
    taken_at: float = 0.0
    ratios: Ratios = Ratios()  # CPU and memory per GPU: a job's dominant share in GPU-equivalents (shared.fairshare)
    limits: Mapping[str, float] = field(default_factory=dict)  # queue path (any level) -> limit, in GPU-equivalents
    # what pending jobs depend on: a job id or an array id -> (job id, state) of that job or of the array's elements
    targets: Mapping[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    # queue path (any level) -> what reclaim leaves it at least: its guarantee, capped by its entitlement; None:
    # each leaf's entitlement (a snapshot without queue specs)
    floors: Mapping[str, float] | None = None


def _status(ns: NodeState) -> str:
    if ns.lost:
        return "lost"
    if ns.draining:
        return "draining"
    return "cordoned" if ns.cordoned else "ready"


def node_snap(ns: NodeState) -> NodeSnap:
    """Free capacity of one node: nothing on an unschedulable node or an unhealthy GPU."""
    status = _status(ns)
    up = status == "ready"
    gpus = []
    for g in sorted(ns.info.gpus, key=lambda g: g.index):
        healthy = g.healthy and g.uuid not in ns.unhealthy
        usable = up and healthy
        whole_alloc = ns.gpu_alloc.get(g.uuid, 0)
        slices = tuple(
            MigSliceSnap(s.uuid, s.profile, usable and whole_alloc == 0 and ns.gpu_alloc.get(s.uuid, 0) == 0)
            for s in g.mig_slices
        )
        free = 0 if (not usable or g.mig_enabled) else max(0, MILLI - whole_alloc)
        gpus.append(
            GpuSnap(
                uuid=g.uuid,
                index=g.index,
                model=g.model,
                memory_mib=g.memory_mib,
                compute_capability=g.compute_capability,
                nvlink_domain=g.nvlink_domain,
                healthy=healthy,
                free_milli=free,
                mig_enabled=g.mig_enabled,
                mig_slices=slices,
            )
        )
    info = ns.info
    return NodeSnap(
        node_id=info.node_id,
        gpus=tuple(gpus),
        labels=dict(info.labels),
        rack=info.rack,
        zone=info.zone,
        cpu_free=max(0, info.cpu_milli - ns.cpu_alloc) if up else 0,
        mem_free=max(0, info.memory_mib - ns.mem_alloc) if up else 0,
        cpu_total=info.cpu_milli,
        mem_total=info.memory_mib,
        status=status,
    )


def snapshot_from_cluster(
    proj: ClusterProjection, now: float, entitlements: Mapping[str, float] | None = None,
    floors: Mapping[str, float] | None = None,
) -> Snapshot:
    """Pending = jobs queued; running = jobs holding resources (placed, running, preempting)."""
    nodes = tuple(node_snap(proj.nodes[k]) for k in sorted(proj.nodes))
    pending, running = [], []
    for job in proj.jobs.values():
        if job.state == "queued":
            pending.append(pending_view(job))
        elif job.state in HOLDING:
            running.append(
                RunningJob(
                    job.job_id,
                    job.spec,
                    tuple(job.placements),
                    placed_at=job.placed_at if job.placed_at is not None else now,
                    started_at=job.started_at,
                    preempting=job.state == "preempting",
                    preemptions=tuple(job.preemptions),
                    owner=job.owner,
                )
            )
    pending.sort(key=lambda j: (j.submitted_at, j.job_id))
    running.sort(key=lambda j: j.job_id)
    return Snapshot(nodes, tuple(pending), tuple(running), None if entitlements is None else dict(entitlements), now,
                    proj.share_ratios(), {q: s.limit.gpus for q, s in proj.queues.items() if s.limit is not None},
                    dependency_targets(proj, pending), None if floors is None else dict(floors))


def pending_view(job: JobRecord) -> PendingJob:
    """The job as the core sees it waiting, made again only when one of its fields changed: at 10,000 waiting
    jobs, making them anew took a third of the cycle's read, every fold held."""
    view = job.__dict__.get("_pending")
    if (view is None or view.spec is not job.spec or view.submitted_at != job.submitted_at
            or view.preemptions != len(job.preemptions) or view.owner != job.owner):
        view = job.__dict__["_pending"] = PendingJob(job.job_id, job.spec, job.submitted_at, len(job.preemptions),
                                                     job.owner)
    return view


def dependency_targets(proj: ClusterProjection, pending: list[PendingJob]) -> dict[str, tuple[tuple[str, str], ...]]:
    """The (job id, state) of what pending jobs depend on: the job of that id, else the elements of the array of
    that id (none: not known here), through the projection's array index rather than a walk of every job."""
    out: dict[str, tuple[tuple[str, str], ...]] = {}
    for dep in {d.job for j in pending for d in j.spec.dependencies}:
        if (job := proj.jobs.get(dep)) is not None:
            out[dep] = ((dep, job.state),)
        elif elements := proj.array_elements(dep):
            out[dep] = tuple((e.job_id, e.state) for e in elements)
    return out
