"""The scheduler's Prometheus series: jobs and fragmentation read from the projection at scrape time, and what
needs event times (waits, preemptions, requeues) observed as live events are folded.

Gauges cost nothing per event: ``SchedulerCollector`` reads the projection when Prometheus scrapes. Counters and
histograms count what this process saw live (a restart starts them again, as Prometheus expects of a counter);
``SchedulerEvents.observe`` runs in the service's reaction, once per stream sequence (a redelivery is not counted
twice).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.scheduler.core import TypicalKey, typical_key
from services.scheduler.fragmentation import FragMemo, typical_shapes
from services.scheduler.shapes import TaskShape
from services.scheduler.snapshot import HOLDING, node_snap
from shared import events as ev
from shared.cluster import PENDING, TERMINAL, ClusterProjection, JobRecord
from shared.events import Envelope
from shared.model import MILLI

JOB_STATES = ("submitted", "queued", "held", "placed", "running", "preempting", "preempted")  # not ended: the live set
PRIORITIES = ("critical", "high", "normal", "low")
BIG_TASK_GPUS = 8
WAIT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)
PLACEMENT_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def preemption_reason(text: str) -> str:
    """A preemption's reason as a bounded label: priority | reclaim | drain | other."""
    if text.startswith("preempted by"):
        return "priority"
    if text.startswith("reclaimed for"):
        return "reclaim"
    if text.startswith("node ") and " draining" in text:
        return "drain"
    return "other"


ShapeCounts = dict[TypicalKey, int]


def shape_key(job: JobRecord) -> TypicalKey | None:
    """``typical_key`` of the job's task shape, kept on the record until its spec changes: a scrape asks it of every
    job held."""
    kept = job.__dict__.get("_shape_key")
    if kept is None or kept[0] is not job.spec:
        kept = job.__dict__["_shape_key"] = (job.spec, typical_key(TaskShape.of(job.spec)))
    return kept[1]


def count_shape(counts: ShapeCounts, job: JobRecord) -> None:
    """Add ``job``'s tasks to ``counts``, as the cycle's target workload counts a queued or holding job."""
    if (key := shape_key(job)) is not None:
        counts[key] = counts.get(key, 0) + job.spec.tasks


def workload_shapes(proj: ClusterProjection) -> ShapeCounts:
    counts: ShapeCounts = {}
    for job in proj.jobs.values():
        if job.state == "queued" or job.state in HOLDING:
            count_shape(counts, job)
    return counts


def cluster_fragmentation(proj: ClusterProjection, counts: ShapeCounts | None = None) -> tuple[float, float, float]:
    """(FGD fragmentation in GPUs, free whole GPUs, free whole GPUs an 8-GPU task could use) on the schedulable nodes.

    FGD's measure (fragmentation.FragMemo, Weng et al.) against the workload now queued and running, the target
    workload a cycle scores placements with (``counts``: its task shapes, counted already by the caller's pass over
    the jobs); an 8-GPU task can use a node's free GPUs in groups of eight. Read from the nodes and that count, not
    from a cycle's snapshot: at 20,000 queued jobs a snapshot cost a scrape 17 ms of its 57, the folds held."""
    memo = FragMemo(typical_shapes(workload_shapes(proj) if counts is None else counts))
    frag = free_whole = usable = 0.0
    for state in proj.nodes.values():
        node = node_snap(state)
        if not node.schedulable:
            continue
        gpus = [g for g in node.gpus if not g.mig_enabled]
        free = [g.free_milli for g in gpus]
        model = next((g.model for g in gpus if g.healthy), gpus[0].model if gpus else "")
        frag += memo.frag(model, node.cpu_free, free)
        whole = sum(1 for f in free if f >= MILLI)
        free_whole += whole
        usable += whole // BIG_TASK_GPUS * BIG_TASK_GPUS
    return frag / MILLI, free_whole, usable


class SchedulerCollector(Collector):
    """Jobs by state and queue, pending jobs by queue and priority, and the cluster's fragmentation: one pass over
    the jobs for all three."""

    def __init__(self, projection: Callable[[], ClusterProjection]) -> None:
        self.projection = projection  # read at each scrape: the process may swap in a shared projection

    def collect(self) -> Iterator[GaugeMetricFamily]:
        proj = self.projection()
        queues = set(proj.queues)
        by_state: dict[tuple[str, str], int] = {(s, q): 0 for s in JOB_STATES for q in queues}
        pending: dict[tuple[str, str], int] = {(q, p): 0 for q in queues for p in PRIORITIES}
        shapes: ShapeCounts = {}
        for job in proj.jobs.values():
            state = job.state
            if state in TERMINAL:
                continue
            q = job.spec.queue
            by_state[(state, q)] = by_state.get((state, q), 0) + 1
            if state in PENDING:
                pending[(q, job.spec.priority)] = pending.get((q, job.spec.priority), 0) + 1
            if state == "queued" or state in HOLDING:
                count_shape(shapes, job)
        jobs = GaugeMetricFamily("gpuorch_jobs", "Jobs not ended, by state and queue", labels=["state", "queue"])
        for (state, q), n in sorted(by_state.items()):
            jobs.add_metric([state, q], n)
        yield jobs
        waiting = GaugeMetricFamily("gpuorch_jobs_pending", "Jobs waiting to be placed (submitted or queued), by "
                                    "queue and priority class", labels=["queue", "priority"])
        for (q, prio), n in sorted(pending.items()):
            waiting.add_metric([q, prio], n)
        yield waiting
        frag, free, usable = cluster_fragmentation(proj, shapes)
        yield GaugeMetricFamily("gpuorch_cluster_fragmentation_gpus", "Idle GPUs the expected workload cannot use "
                                "(FGD's measure over the schedulable nodes, against the pending and running task shapes)",
                                value=frag)
        yield GaugeMetricFamily("gpuorch_cluster_free_gpus", "Whole GPUs free on schedulable nodes", value=free)
        yield GaugeMetricFamily("gpuorch_cluster_free_gpus_usable_by_8gpu_task_ratio", "Share of the free whole GPUs "
                                "that tasks of 8 GPUs could use (in groups of 8 on one node); 1 when none is free",
                                value=usable / free if free else 1.0)


class SchedulerEvents:
    """Counters and histograms of what the scheduler saw happen, live."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.submit_to_start = Histogram("gpuorch_job_submit_to_start_seconds", "Time from a job's submission to the "
                                         "start of its first task (each attempt after a preemption or requeue counts "
                                         "from the submission again)", ["queue"], buckets=WAIT_BUCKETS, registry=r)
        self.placements = Histogram("gpuorch_scheduler_cycle_placements", "Jobs placed per scheduling cycle",
                                    buckets=PLACEMENT_BUCKETS, registry=r)
        self.preemptions = Counter("gpuorch_job_preemptions", "Jobs told to stop for another (priority), for their "
                                   "queue's share (reclaim) or for their node (drain)", ["queue", "reason"], registry=r)
        self.requeues = Counter("gpuorch_job_requeues", "Running jobs put back in the queue because their node was "
                                "lost or stopped under them", ["queue", "reason"], registry=r)
        self.finished = Counter("gpuorch_jobs_finished", "Jobs that ended, by final state and queue",
                                ["state", "queue"], registry=r)
        self.seen = 0  # the last stream sequence observed: a redelivered event is not counted twice

    def observe(self, env: Envelope, proj: ClusterProjection) -> None:
        """One live event, after it was folded into ``proj``."""
        if env.seq and env.seq <= self.seen:
            return
        self.seen = max(self.seen, env.seq)
        e = env.data
        job = proj.jobs.get(getattr(e, "job_id", ""))
        if job is None:
            return
        q = job.spec.queue
        if isinstance(e, ev.JobTaskStarted):
            # the attempt's first task: the one whose start set started_at (the projection may already be past this
            # event, folded by another service of the process: a short task may have ended, so not tasks_running)
            if job.started_at == env.timestamp:
                self.submit_to_start.labels(q).observe(max(0.0, env.timestamp - job.submitted_at))
        elif isinstance(e, ev.JobPreempting):
            self.preemptions.labels(q, preemption_reason(e.reason)).inc()
        elif isinstance(e, ev.JobRequeued):
            self.requeues.labels(q, "interrupted" if e.interrupted else "node_lost").inc()
        elif isinstance(e, (ev.JobSucceeded, ev.JobFailed, ev.JobCancelled, ev.JobRejected)):
            self.finished.labels(job.state, q).inc()
