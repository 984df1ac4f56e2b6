"""Fluent builders for the scheduling domain: nodes, jobs, and a cluster to snapshot.

    node("n1").gpus(8, model="H100").nvlink_domains(2).rack("r1").build()   -> NodeInfo
    job("train").gpus(8).tasks(4).queue("nlp").build()                     -> JobSpec
    cluster(nodes...).running(spec, on=[("n1", [0, 1])]).pending(spec).snapshot(now)
    reported(ev.JobTaskExited(job_id="j-1", task=0, node_id="n1", code=0)) -> Envelope from n1's agent
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.scheduler.snapshot import Snapshot, snapshot_from_cluster
from shared import events as ev
from shared.cluster import ClusterProjection, JobRecord, NodeState, agent_source
from shared.events import Envelope, GpuShare, TaskPlacement
from shared.model import (
    MILLI, ArrayElement, Dependency, GpuAmount, GpuConstraints, GpuInfo, JobSpec, MigSlice, NodeInfo, QueueSpec,
    TaskResources,
)


def gpu_uuid(node_id: str, index: int) -> str:
    return f"GPU-{node_id}-{index}"


@dataclass
class NodeBuilder:
    node_id: str
    count: int = 8
    model: str = "H100"
    memory_mib: int = 81920
    cc: str = "9.0"
    domains: int | None = 1  # NVLink domains the GPUs split into evenly; None: PCIe only
    rack_: str = ""
    zone_: str = ""
    labels_: dict[str, str] = field(default_factory=dict)
    cpu_milli: int | None = None
    memory: int | None = None
    mig_: dict[int, tuple[str, ...]] = field(default_factory=dict)
    unhealthy_: set[int] = field(default_factory=set)

    def gpus(self, count: int, model: str | None = None, memory_mib: int | None = None, cc: str | None = None) -> "NodeBuilder":
        self.count = count
        self.model = model or self.model
        self.memory_mib = memory_mib or self.memory_mib
        self.cc = cc or self.cc
        return self

    def nvlink_domains(self, n: int) -> "NodeBuilder":
        self.domains = n
        return self

    def pcie(self) -> "NodeBuilder":
        self.domains = None
        return self

    def rack(self, rack: str) -> "NodeBuilder":
        self.rack_ = rack
        return self

    def zone(self, zone: str) -> "NodeBuilder":
        self.zone_ = zone
        return self

    def labels(self, **labels: str) -> "NodeBuilder":
        self.labels_.update(labels)
        return self

    def cpu(self, milli: int) -> "NodeBuilder":
        self.cpu_milli = milli
        return self

    def mem(self, mib: int) -> "NodeBuilder":
        self.memory = mib
        return self

    def mig(self, gpu: int, *profiles: str) -> "NodeBuilder":
        self.mig_[gpu] = profiles
        return self

    def build(self) -> NodeInfo:
        per = None if self.domains is None else max(1, self.count // self.domains)
        gpus = tuple(
            GpuInfo(
                uuid=gpu_uuid(self.node_id, i),
                index=i,
                model=self.model,
                memory_mib=self.memory_mib,
                compute_capability=self.cc,
                nvlink_domain=None if per is None else f"{self.node_id}:nvl{i // per}",
                mig_enabled=i in self.mig_,
                mig_slices=tuple(
                    MigSlice(uuid=f"MIG-{self.node_id}-{i}-{s}", profile=p) for s, p in enumerate(self.mig_.get(i, ()))
                ),
            )
            for i in range(self.count)
        )
        return NodeInfo(
            node_id=self.node_id,
            hostname=self.node_id,
            labels=dict(self.labels_),
            rack=self.rack_,
            zone=self.zone_,
            cpu_milli=self.cpu_milli if self.cpu_milli is not None else max(self.count, 1) * 16_000,
            memory_mib=self.memory if self.memory is not None else max(self.count, 1) * 131_072,
            gpus=gpus,
        )


def node(node_id: str) -> NodeBuilder:
    return NodeBuilder(node_id)


@dataclass
class JobBuilder:
    name: str
    fields: dict[str, Any] = field(default_factory=dict)
    res: dict[str, Any] = field(default_factory=dict)
    gpu_: dict[str, Any] = field(default_factory=dict)

    def gpus(self, n: float) -> "JobBuilder":
        self.res["gpus"] = n
        return self

    def cpu(self, milli: int) -> "JobBuilder":
        self.res["cpu_milli"] = milli
        return self

    def mem(self, mib: int) -> "JobBuilder":
        self.res["memory_mib"] = mib
        return self

    def tasks(self, n: int) -> "JobBuilder":
        self.fields["tasks"] = n
        return self

    def queue(self, q: str) -> "JobBuilder":
        self.fields["queue"] = q
        return self

    def priority(self, p: str) -> "JobBuilder":
        self.fields["priority"] = p
        return self

    def topology(self, t: str) -> "JobBuilder":
        self.fields["topology"] = t
        return self

    def time_limit(self, s: int) -> "JobBuilder":
        self.fields["time_limit_s"] = s
        return self

    def selector(self, **labels: str) -> "JobBuilder":
        self.fields["node_selector"] = labels
        return self

    def models(self, *models: str) -> "JobBuilder":
        self.gpu_["models"] = models
        return self

    def min_gpu_memory(self, mib: int) -> "JobBuilder":
        self.gpu_["min_memory_mib"] = mib
        return self

    def min_cc(self, cc: str) -> "JobBuilder":
        self.gpu_["min_compute_capability"] = cc
        return self

    def mig(self, profile: str) -> "JobBuilder":
        self.gpu_["mig"] = profile
        return self

    def command(self, *argv: str) -> "JobBuilder":
        self.fields["command"] = argv
        return self

    def after(self, kind: str, job_id: str) -> "JobBuilder":
        """A dependency (Slurm's --dependency=KIND:JOB): on a job, or on every element of an array."""
        self.fields["dependencies"] = (*self.fields.get("dependencies", ()), Dependency(kind=kind, job=job_id))
        return self

    def element(self, array_id: str, index: int, max_running: int | None = None) -> "JobBuilder":
        """An element of a job array, as the API makes it."""
        self.fields["array"] = ArrayElement(id=array_id, index=index, max_running=max_running)
        return self

    def singleton(self) -> "JobBuilder":
        self.fields["singleton"] = True
        return self

    def build(self) -> JobSpec:
        """The spec; it runs `true` unless told otherwise (the API takes no job without a command)."""
        fields = {"command": ("true",), **self.fields}
        return JobSpec(name=self.name, resources=TaskResources(**self.res), gpu=GpuConstraints(**self.gpu_), **fields)


def job(name: str) -> JobBuilder:
    return JobBuilder(name)


Task = tuple[str, list[int]]  # (node id, GPU indices) of one task


class ClusterBuilder:
    """A ClusterProjection filled directly (no events), to snapshot."""

    def __init__(self, *nodes: NodeInfo) -> None:
        self.proj = ClusterProjection()
        self._n = 0
        for n in nodes:
            self.proj.nodes[n.node_id] = NodeState(info=n)

    def _id(self, spec: JobSpec, job_id: str | None) -> str:
        self._n += 1
        return job_id or f"{spec.name}-{self._n}"

    def pending(self, spec: JobSpec, job_id: str | None = None, at: float | None = None,
                owner: str = "") -> "ClusterBuilder":
        jid = self._id(spec, job_id)
        self.proj.add_job(JobRecord(jid, spec, state="queued", submitted_at=self._n if at is None else at,
                                    owner=owner))
        return self

    def ended(self, spec: JobSpec, job_id: str, state: str = "succeeded") -> "ClusterBuilder":
        """A job that ended (succeeded, failed, cancelled, rejected), holding nothing."""
        self.proj.add_job(JobRecord(job_id, spec, state=state))
        return self

    def running(
        self, spec: JobSpec, on: list[Task], job_id: str | None = None, started_at: float = 0.0, state: str = "running",
        owner: str = "",
    ) -> "ClusterBuilder":
        """A job holding the given GPUs (``spec.resources.gpus`` milli on each), one task per entry."""
        jid = self._id(spec, job_id)
        milli = MILLI if spec.gpu.mig else min(MILLI, spec.resources.gpu_milli)
        placements = []
        for t, (node_id, gpus) in enumerate(on):
            ns = self.proj.nodes[node_id]
            shares = []
            for g in gpus:
                info = ns.info.gpus[g]
                if spec.gpu.mig:
                    sl = next(s for s in info.mig_slices if s.profile == spec.gpu.mig and not ns.gpu_alloc.get(s.uuid))
                    uuid = sl.uuid
                else:
                    uuid = info.uuid
                ns.gpu_alloc[uuid] = ns.gpu_alloc.get(uuid, 0) + milli
                shares.append(GpuShare(uuid=uuid, milli=milli, mig_profile=spec.gpu.mig))
            ns.cpu_alloc += spec.resources.cpu_milli
            ns.mem_alloc += spec.resources.memory_mib
            placements.append(
                TaskPlacement(task=t, node_id=node_id, gpus=tuple(shares), cpu_milli=spec.resources.cpu_milli,
                              memory_mib=spec.resources.memory_mib)
            )
        self.proj.add_job(JobRecord(
            jid, spec, state=state, submitted_at=started_at, placed_at=started_at, started_at=started_at,
            placements=placements, owner=owner,
        ))
        return self

    def hold(
        self, spec: JobSpec, placements: tuple[TaskPlacement, ...], job_id: str, started_at: float = 0.0
    ) -> "ClusterBuilder":
        """A job running on exactly these placements (e.g. a plan's), its pending record replaced."""
        for p in placements:
            ns = self.proj.nodes[p.node_id]
            for share in p.gpus:
                ns.gpu_alloc[share.uuid] = ns.gpu_alloc.get(share.uuid, 0) + share.milli
            ns.cpu_alloc += p.cpu_milli
            ns.mem_alloc += p.memory_mib
        self.proj.add_job(JobRecord(
            job_id, spec, state="running", submitted_at=started_at, placed_at=started_at, started_at=started_at,
            placements=list(placements),
        ))
        return self

    def queue(self, path: str, limit: float | None = None, guaranteed: float = 0.0) -> "ClusterBuilder":
        """A queue as queue.defined leaves it (limit and guarantee in GPU-equivalents)."""
        self.proj.queues[path] = QueueSpec(guaranteed=GpuAmount(gpus=guaranteed),
                                           limit=None if limit is None else GpuAmount(gpus=limit))
        return self

    def cordon(self, node_id: str) -> "ClusterBuilder":
        self.proj.nodes[node_id].cordoned = True
        return self

    def drain(self, node_id: str) -> "ClusterBuilder":
        self.proj.nodes[node_id].cordoned = self.proj.nodes[node_id].draining = True
        return self

    def lose(self, node_id: str) -> "ClusterBuilder":
        self.proj.nodes[node_id].lost = True
        return self

    def sick_gpu(self, node_id: str, index: int) -> "ClusterBuilder":
        ns = self.proj.nodes[node_id]
        ns.unhealthy[ns.info.gpus[index].uuid] = "xid 79"
        return self

    def snapshot(self, now: float = 0.0, entitlements: dict[str, float] | None = None,
                 floors: dict[str, float] | None = None) -> Snapshot:
        return snapshot_from_cluster(self.proj, now, entitlements, floors)


def cluster(*nodes: NodeBuilder | NodeInfo) -> ClusterBuilder:
    return ClusterBuilder(*(n.build() if isinstance(n, NodeBuilder) else n for n in nodes))


def reported(event: ev.JobTaskStarted | ev.JobTaskExited) -> Envelope:
    """A task report as its node's agent appends it: projections take task reports from that agent only."""
    return Envelope(event, source=agent_source(event.node_id))
