"""The cluster as every service sees it: nodes, GPU allocations, jobs and queues, folded from events.

Each service's projection extends ``ClusterProjection`` with what only it needs.
The fold checks every transition: a placement on a GPU that is already full, or a
job event for a job in the wrong state, is recorded as invalid and changes nothing,
so a replay is deterministic even when two leaders overlapped for a moment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from shared import events as ev
from shared.events import SUBJECT_PREFIX, Envelope, TaskPlacement
from shared.fairshare import Division, Ratios, accrue, divide, job_share
from shared.model import MILLI, JobSpec, NodeInfo, QueueSpec
from shared.projection import Projection

ACTIVE = frozenset({"placed", "running", "preempting"})  # holding resources
TERMINAL = frozenset({"succeeded", "failed", "cancelled", "rejected"})
PENDING = frozenset({"submitted", "queued"})
HOLDABLE = PENDING  # a job that waits can be held; it is then "held" until released (it wants nothing meanwhile)
CANCELLABLE = ACTIVE | PENDING | {"preempted", "held"}  # not ended: a cancellation ends it
REPRIORITISABLE = PENDING | {"held"}  # a job's priority changes while it waits (job.updated)
TIME_LIMITED = REPRIORITISABLE | {"placed", "running"}  # its time limit also while it runs


def agent_source(node_id: str) -> str:
    """The source of a node agent's events: task reports count only from the agent of the task's node."""
    return f"/gpuorch/agent/{node_id}"


def _shallow(obj: Any) -> dict[str, Any]:
    """A dataclass's fields without dataclasses.asdict's deep copy (which copies pydantic models too)."""
    names = _FIELDS.get(type(obj))
    if names is None:
        names = _FIELDS[type(obj)] = tuple(f.name for f in fields(obj))
    return {name: getattr(obj, name) for name in names}


_FIELDS: dict[type, tuple[str, ...]] = {}


@dataclass
class NodeState:
    info: NodeInfo
    cordoned: bool = False
    draining: bool = False
    lost: bool = False
    unhealthy: dict[str, str] = field(default_factory=dict)  # gpu uuid -> why
    gpu_alloc: dict[str, int] = field(default_factory=dict)  # gpu uuid -> milli allocated
    cpu_alloc: int = 0
    mem_alloc: int = 0
    registered_at: float = 0.0

    @property
    def schedulable(self) -> bool:
        return not (self.cordoned or self.draining or self.lost)

    def free_milli(self, uuid: str) -> int:
        return MILLI - self.gpu_alloc.get(uuid, 0)

    def to_json(self) -> dict[str, Any]:
        return {**_shallow(self), "info": self.info.model_dump(mode="json"), "gpu_alloc": dict(self.gpu_alloc),
                "unhealthy": dict(self.unhealthy)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "NodeState":
        return cls(**{**d, "info": NodeInfo.model_validate(d["info"])})


SHARES_KEPT = 4  # ratios a job keeps its share for (JobRecord.share): GPUs alone, the cluster's, and a change or two


class QueueLoad(NamedTuple):
    """Per leaf queue, in GPU-equivalents of the dominant resource: held by its active jobs; wanted by its pending
    ones; by those waiting since a time (see ``ClusterProjection.queue_loads``); its smallest queued job."""

    alloc: dict[str, float]
    pending: dict[str, float]
    waited: dict[str, float]
    smallest: dict[str, float]


KEPT_PER_SPEC = ("_spec_json", "_share", "_pending", "_shape_key")


@dataclass
class JobRecord:
    job_id: str
    spec: JobSpec
    state: str = "submitted"
    submitted_at: float = 0.0
    updated_at: float = 0.0
    placed_at: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    placements: list[TaskPlacement] = field(default_factory=list)
    last_placements: list[TaskPlacement] = field(default_factory=list)  # kept when preempted or requeued: late exits count
    reason: str = ""
    exit_code: int | None = None
    tasks_running: list[int] = field(default_factory=list)
    tasks_exited: dict[int, int | None] = field(default_factory=dict)
    preemptions: list[float] = field(default_factory=list)  # times it was preempted
    retries: int = 0
    lost_before_start: int = 0  # times it went back to the queue before any of its tasks started (no retry spent)
    held_by_admin: bool = False  # held, by an admin: only an admin releases it
    timed_out: bool = False
    seq: int = 0  # stream sequence of the last event on this job: the expected sequence of the next decision
    attempt: int = 0  # stream sequence of the job.placed of its latest placement: agents and decisions name it
    preempting_since: float | None = None
    grace_s: int = 0
    owner: str = ""  # the user who submitted it ("" before users existed)
    submitted_seq: int = 0  # stream sequence of its job.submitted: its place in GET /v1/jobs (newest first)

    def __post_init__(self) -> None:
        # what is kept per spec (below, and the scheduler's views of it), made empty here and in one order: set
        # first where each reader happens to come first, the records' attribute dicts stop sharing one layout and
        # every read slows (a scrape's pass over 20,000 jobs: 28 ms -> 39)
        self.__dict__.update(dict.fromkeys(KEPT_PER_SPEC))

    @property
    def gpu_milli_total(self) -> int:
        return self.spec.gpu_milli * self.spec.tasks

    def spec_json(self) -> dict[str, Any]:
        """The spec's JSON form, dumped once per spec: a JobSpec is frozen (a change makes a new one), and dumping
        every job's spec again was most of a snapshot's time (0.4 s for 20,000 jobs, every fold held)."""
        cached = self.__dict__.get("_spec_json")
        if cached is None or cached[0] is not self.spec:
            cached = self.__dict__["_spec_json"] = (self.spec, self.spec.model_dump(mode="json"))
        return cached[1]

    def share(self, ratios: Ratios) -> float:
        """``job_share(self.spec, ratios)``, kept per ratios until the spec changes (a cycle's read took it for every
        job three times: 45 ms of the 58 the read held the folds for, at 10,000 pending jobs). Kept for more than one
        ratios: GET /v1/queues and a scrape of /metrics ask it in GPUs and in dominant shares, and with one kept
        each asking made it anew for every job (/v1/queues at 20,000 queued jobs: 80 ms, 30 of them a cycle's)."""
        # (spec, the ratios last asked, its share, the share per ratios), replaced whole: threads that read the
        # projection together (a cycle's, a scrape's) may ask at once, and must never pair one's ratios with another's
        cached = self.__dict__.get("_share")
        if cached is not None and cached[0] is self.spec:
            if cached[1] is ratios:  # as last time (a pass over the jobs asks them all alike): no hashing
                return cached[2]
            shares = cached[3]
        else:
            shares = {}
        value = shares.get(ratios)
        if value is None:
            if len(shares) >= SHARES_KEPT:  # the cluster's shape changed many times: start again
                shares.clear()
            value = shares[ratios] = job_share(self.spec, ratios)
        self.__dict__["_share"] = (self.spec, ratios, value, shares)
        return value

    def to_json(self) -> dict[str, Any]:
        return {
            **_shallow(self),
            "spec": self.spec_json(),
            "placements": [p.model_dump(mode="json") for p in self.placements],
            "last_placements": [p.model_dump(mode="json") for p in self.last_placements],
            "tasks_exited": {str(k): v for k, v in self.tasks_exited.items()},
            "tasks_running": list(self.tasks_running),
            "preemptions": list(self.preemptions),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "JobRecord":
        return cls(
            **{
                **d,
                "spec": JobSpec.model_validate(d["spec"], context=ev.STORED),  # as logged, like decode()
                "placements": [TaskPlacement.model_validate(p) for p in d["placements"]],
                "last_placements": [TaskPlacement.model_validate(p) for p in d.get("last_placements", [])],
                "tasks_exited": {int(k): v for k, v in d["tasks_exited"].items()},
            }
        )


DEFAULT_QUEUE = "default"
ACCOUNTING_BUCKET_S = 3600  # GPU-seconds are kept per queue per hour, for all time
EXACT_HORIZON_S = 7 * 86400  # and ended holdings as intervals for this long: a window's edges there are exact
KEEP_FINISHED = 5000  # finished jobs kept in memory; older ones are read back from the log on demand


class ClusterProjection(Projection):
    name = "cluster"
    SNAPSHOT_VERSION = 3  # bump when state() changes shape, or a fold computes something else (2: submitted_seq,
    # 3: a task's exit by a signal kept as minus the signal)

    def __init__(self) -> None:
        super().__init__()
        self.nodes: dict[str, NodeState] = {}
        self.jobs: dict[str, JobRecord] = {}
        # array id -> the ids of its elements held in ``jobs``, in submission order: derived from ``jobs`` (not state)
        self.arrays: dict[str, dict[str, None]] = {}
        self.queues: dict[str, QueueSpec] = {DEFAULT_QUEUE: QueueSpec()}
        self.finished: dict[str, None] = {}  # ended job ids, oldest first (an ordered set)
        self.accounting: dict[str, dict[int, float]] = {}  # queue -> hour -> GPU-seconds of ended holdings
        self.holdings: dict[str, list[tuple[float, float, float]]] = {}  # queue -> ended (start, end, GPUs) ...
        self.exact_since: float | None = None  # ... of all that end after this hour boundary (None: all of them)
        self.pool_shapes: dict[str, tuple[str, int]] = {}  # node pool -> (profile, max nodes): nodes that may come
        self.now = 0.0  # time of the last event folded: the projection's clock

    def apply(self, env: Envelope) -> bool:
        if not isinstance(env.data, ev.LeaderElected):  # no cluster event: a restart's new term keeps the state
            self.now = max(self.now, env.timestamp)
        job = self.jobs.get(env.data.aggregate_id) if env.data.aggregate == "job" else None
        if job is not None and env.seq > self.seq:
            # every event on the job's subject, a rejected one too: a decision appended with an older expected
            # sequence would conflict, again and again
            job.seq = env.seq
        return super().apply(env)

    def skip(self, seq: int, subject: str = "") -> None:
        """An unreadable event on a job's subject moved that subject on too: the job's next decision expects it."""
        prefix = f"{SUBJECT_PREFIX}.job."
        if subject.startswith(prefix) and seq > self.seq:
            job = self.jobs.get(subject[len(prefix):].replace(":", "."))
            if job is not None:
                job.seq = seq
        super().skip(seq, subject)

    # --- nodes -----------------------------------------------------------------------

    def on_node_registered(self, env: Envelope, e: ev.NodeRegistered) -> None:
        old = self.nodes.get(e.node_id)
        if old is None:
            self.nodes[e.node_id] = NodeState(info=e.node, registered_at=env.timestamp)
        else:  # an agent restart re-reports its inventory; cordon and allocations stay
            old.info, old.lost = e.node, False

    def _node(self, env: Envelope, node_id: str) -> NodeState | None:
        node = self.nodes.get(node_id)
        if node is None:
            self.invalid(env, f"unknown node {node_id}")
        return node

    def on_node_cordoned(self, env: Envelope, e: ev.NodeCordoned) -> None:
        if node := self._node(env, e.node_id):
            node.cordoned = True

    def on_node_drain_requested(self, env: Envelope, e: ev.NodeDrainRequested) -> None:
        if node := self._node(env, e.node_id):
            node.cordoned = node.draining = True

    def on_node_drained(self, env: Envelope, e: ev.NodeDrained) -> None:
        if node := self._node(env, e.node_id):
            node.draining = False

    def on_node_resumed(self, env: Envelope, e: ev.NodeResumed) -> None:
        if node := self._node(env, e.node_id):
            node.cordoned = node.draining = False
            node.unhealthy.clear()

    def on_node_lost(self, env: Envelope, e: ev.NodeLost) -> None:
        if node := self._node(env, e.node_id):
            node.lost = True

    def on_gpu_unhealthy(self, env: Envelope, e: ev.GpuUnhealthy) -> None:
        if node := self._node(env, e.node_id):
            what = e.kind if e.xid is None else f"xid {e.xid}"
            node.unhealthy[e.gpu_uuid] = f"{what}: {e.detail}" if e.detail else what

    def on_pool_defined(self, env: Envelope, e: ev.PoolDefined) -> None:
        self.pool_shapes[e.pool] = (e.profile, e.max_nodes)

    def on_pool_deleted(self, env: Envelope, e: ev.PoolDeleted) -> None:
        self.pool_shapes.pop(e.pool, None)

    def on_pool_node_terminated(self, env: Envelope, e: ev.PoolNodeTerminated) -> None:
        node = self.nodes.get(e.node_id)
        if node is not None and (node.gpu_alloc or node.cpu_alloc):
            self.invalid(env, f"node {e.node_id} terminated while holding work")
        self.nodes.pop(e.node_id, None)

    # --- queues ----------------------------------------------------------------------

    def on_queue_defined(self, env: Envelope, e: ev.QueueDefined) -> None:
        self.queues[e.path] = e.spec

    def on_queue_updated(self, env: Envelope, e: ev.QueueUpdated) -> None:
        if e.path not in self.queues:
            self.invalid(env, f"unknown queue {e.path}")
            return
        self.queues[e.path] = e.spec

    def on_queue_deleted(self, env: Envelope, e: ev.QueueDeleted) -> None:
        if self.queues.pop(e.path, None) is None:
            self.invalid(env, f"unknown queue {e.path}")

    # --- jobs ------------------------------------------------------------------------

    def _job(self, env: Envelope, job_id: str, allowed: frozenset[str] | set[str]) -> JobRecord | None:
        job = self.jobs.get(job_id)
        if job is None:
            self.invalid(env, f"unknown job {job_id}")
            return None
        job.seq = env.seq
        if job.state not in allowed:
            self.invalid(env, f"job {job_id} is {job.state}")
            return None
        job.updated_at = env.timestamp
        return job

    def on_job_submitted(self, env: Envelope, e: ev.JobSubmitted) -> None:
        if e.job_id in self.jobs:
            self.invalid(env, f"job {e.job_id} submitted twice")
            return
        t = env.timestamp if e.submitted_at is None else e.submitted_at
        self.add_job(JobRecord(e.job_id, e.spec, submitted_at=t, updated_at=env.timestamp, seq=env.seq,
                               owner=e.owner or "", submitted_seq=env.seq))

    def add_job(self, job: JobRecord) -> None:
        """Hold ``job``, indexed under its array if it is an element of one (``array_elements``)."""
        self.jobs[job.job_id] = job
        if job.spec.array is not None:
            self.arrays.setdefault(job.spec.array.id, {})[job.job_id] = None

    def array_elements(self, array_id: str) -> list[JobRecord]:
        """The elements of array ``array_id`` held here, in submission order, found without walking every job."""
        return [self.jobs[j] for j in self.arrays.get(array_id, ())]

    def on_job_rejected(self, env: Envelope, e: ev.JobRejected) -> None:
        if job := self._job(env, e.job_id, PENDING):
            job.state, job.reason, job.ended_at = "rejected", e.reason, env.timestamp
            self._finish(job)

    def _finish(self, job: JobRecord) -> None:
        """Keep the last KEEP_FINISHED ended jobs: memory and snapshots stay bounded however long the log."""
        self.finished[job.job_id] = None
        while len(self.finished) > KEEP_FINISHED:
            old = next(iter(self.finished))
            del self.finished[old]
            if (gone := self.jobs.pop(old, None)) is not None and (a := gone.spec.array) is not None:
                elements = self.arrays.get(a.id, {})
                elements.pop(old, None)
                if not elements:
                    self.arrays.pop(a.id, None)

    def on_job_queued(self, env: Envelope, e: ev.JobQueued) -> None:
        if job := self._job(env, e.job_id, {"submitted", "preempted"}):
            job.state, job.reason = "queued", ""

    def on_job_held(self, env: Envelope, e: ev.JobHeld) -> None:
        if job := self._job(env, e.job_id, HOLDABLE):
            job.state, job.reason, job.held_by_admin = "held", e.reason, e.admin

    def on_job_released(self, env: Envelope, e: ev.JobReleased) -> None:
        if job := self._job(env, e.job_id, {"held"}):
            job.state, job.reason, job.held_by_admin = "queued", "", False

    def on_job_updated(self, env: Envelope, e: ev.JobUpdated) -> None:
        if job := self._job(env, e.job_id, TIME_LIMITED if e.priority is None else REPRIORITISABLE):
            change = {"priority": e.priority, "time_limit_s": e.time_limit_s}
            job.spec = job.spec.model_copy(update={k: v for k, v in change.items() if v is not None})

    def on_job_unschedulable(self, env: Envelope, e: ev.JobUnschedulable) -> None:
        moved = self.jobs.get(e.job_id)
        if moved is not None and moved.state != "queued":
            # the cycle read it queued, and a placement, a cancellation or an end was folded before its reason:
            # reasons are appended in batches without the job's sequence (no decision rests on them), so a reason
            # can come after the job moved on; nothing in the log conflicts
            self._came_late(env, moved, f"job {e.job_id} is {moved.state}: the reason came after")
            return
        if job := self._job(env, e.job_id, {"queued"}):
            job.reason = e.reason

    def _came_late(self, env: Envelope, job: JobRecord | None, why: str) -> None:
        """An event that lost a race with the job's own progress (kind ``late``: `events verify` expects these)."""
        if job is not None:
            job.seq = env.seq
        self.invalid(env, why, "late")

    def on_job_placed(self, env: Envelope, e: ev.JobPlaced) -> None:
        job = self._job(env, e.job_id, {"queued"})
        if job is None:
            return
        if why := self._cannot_hold(e.placements):
            self.invalid(env, why)
            return
        for p in e.placements:
            self._reserve(p, +1)
        job.state, job.placements, job.reason = "placed", list(e.placements), ""
        job.last_placements, job.attempt = job.placements, env.seq
        job.placed_at, job.tasks_running, job.tasks_exited = env.timestamp, [], {}

    def _cannot_hold(self, placements: tuple[TaskPlacement, ...]) -> str:
        want: dict[tuple[str, str], int] = {}
        for p in placements:
            node = self.nodes.get(p.node_id)
            if node is None:
                return f"placement on unknown node {p.node_id}"
            uuids = {g.uuid for g in node.info.gpus} | {s.uuid for g in node.info.gpus for s in g.mig_slices}
            for share in p.gpus:
                if share.uuid not in uuids:
                    return f"placement on unknown GPU {share.uuid} of node {p.node_id}"
                want[(p.node_id, share.uuid)] = want.get((p.node_id, share.uuid), 0) + share.milli
        for (node_id, uuid), milli in want.items():
            if self.nodes[node_id].gpu_alloc.get(uuid, 0) + milli > MILLI:
                return f"GPU {uuid} on {node_id} would be over-committed"
        return ""

    def _reserve(self, p: TaskPlacement, sign: int) -> None:
        node = self.nodes.get(p.node_id)
        if node is None:
            return
        for share in p.gpus:
            left = node.gpu_alloc.get(share.uuid, 0) + sign * share.milli
            if left:
                node.gpu_alloc[share.uuid] = left
            else:
                node.gpu_alloc.pop(share.uuid, None)
        node.cpu_alloc += sign * p.cpu_milli
        node.mem_alloc += sign * p.memory_mib

    def _release(self, job: JobRecord, at: float) -> None:
        """Free the job's resources; its holding ends at ``at``, the time of the event that ended it."""
        if job.state in ACTIVE:
            for p in job.placements:
                self._reserve(p, -1)
            if job.placed_at is not None:
                self._account(job.spec.queue, job.gpu_milli_total / MILLI, job.placed_at, max(job.placed_at, at))

    def _account(self, queue: str, gpus: float, start: float, end: float) -> None:
        """An ended holding: into its hours' buckets, and while it is recent, as the interval itself."""
        buckets = self.accounting.setdefault(queue, {})
        t = start
        while t < end:
            b = int(t // ACCOUNTING_BUCKET_S)
            upto = min(end, (b + 1) * ACCOUNTING_BUCKET_S)
            buckets[b] = buckets.get(b, 0.0) + gpus * (upto - t)
            t = upto
        self._forget_holdings_before(self.now - EXACT_HORIZON_S)
        if end > start and (self.exact_since is None or end > self.exact_since):
            self.holdings.setdefault(queue, []).append((start, end, gpus))

    def _forget_holdings_before(self, t: float) -> None:
        """Keep intervals for the last EXACT_HORIZON_S of event time only: memory and snapshots stay bounded.
        The cut moves by whole buckets, so that the buckets before it are exact up to it. Intervals are appended
        as their holdings end, in event time: the old ones are at the front. One out of order (a skewed clock) may
        stay a little longer; the query clips intervals at the cut, so it counts nothing twice."""
        cut = math.floor(t / ACCOUNTING_BUCKET_S) * ACCOUNTING_BUCKET_S
        if self.exact_since is not None and cut <= self.exact_since:
            return
        self.exact_since = cut
        for queue in list(self.holdings):
            held = self.holdings[queue]
            old = 0
            while old < len(held) and held[old][1] <= cut:
                old += 1
            if old == len(held):
                del self.holdings[queue]
            elif old:
                del held[:old]

    def gpu_seconds(self, since: float, until: float, now: float | None = None) -> dict[str, float]:
        """GPU-seconds per queue held in [since, until); running jobs count up to ``now`` (default: ``until``).

        Exact from ``exact_since`` on (the last EXACT_HORIZON_S), where ended holdings are kept as intervals;
        before it, from the hourly buckets: whole hours exact, an hour the window cuts in proportion.
        """
        out: dict[str, float] = {}
        cut = -math.inf if self.exact_since is None else self.exact_since
        lo, hi = since, min(until, cut)  # 1. before the cut: the buckets
        if hi > lo:
            for queue, buckets in self.accounting.items():
                for b, v in buckets.items():
                    start = b * ACCOUNTING_BUCKET_S
                    overlap = max(0.0, min(start + ACCOUNTING_BUCKET_S, hi) - max(start, lo))
                    if overlap:
                        out[queue] = out.get(queue, 0.0) + v * overlap / ACCOUNTING_BUCKET_S
        lo, hi = max(since, cut), until  # 2. from the cut on: the intervals themselves
        if hi > lo:
            for queue, held in self.holdings.items():
                secs = sum(gpus * max(0.0, min(end, hi) - max(start, lo)) for start, end, gpus in held)
                if secs:
                    out[queue] = out.get(queue, 0.0) + secs
        upto = until if now is None else min(until, now)  # 3. running jobs, exactly
        for job in self.jobs.values():
            if job.state in ACTIVE and job.placed_at is not None:
                held_s = max(0.0, upto - max(job.placed_at, since))
                if held_s:
                    out[job.spec.queue] = out.get(job.spec.queue, 0.0) + job.gpu_milli_total / MILLI * held_s
        return out

    def decayed_usage(self, now: float, half_life: float) -> dict[str, float]:
        """Time-decayed GPU-seconds per queue (Slurm's PriorityDecayHalfLife), from the accounting buckets: each
        hour's as if held at its middle, or at ``now`` for the hour in progress (usage never grows by decaying)."""
        out: dict[str, float] = {}
        for queue, buckets in self.accounting.items():
            out[queue] = sum(v * 2.0 ** (-max(0.0, now - (b + 0.5) * ACCOUNTING_BUCKET_S) / half_life)
                             for b, v in buckets.items())
        for job in self.jobs.values():
            if job.state in ACTIVE and job.placed_at is not None:
                out[job.spec.queue] = out.get(job.spec.queue, 0.0) + accrue(0.0, job.gpu_milli_total / MILLI,
                                                                            now - job.placed_at, half_life)
        return out

    def _reported_from_its_node(self, env: Envelope, e: ev.JobTaskStarted | ev.JobTaskExited,
                                placements: list[TaskPlacement]) -> bool:
        """A task report counts only from the agent of the node the task was placed on."""
        if env.source != agent_source(e.node_id):
            self.invalid(env, f"task {e.task} on {e.node_id} reported by {env.source}, not by its node's agent", "refused")
        elif not any(p.node_id == e.node_id and p.task == e.task for p in placements):
            self.invalid(env, f"task {e.task} of job {e.job_id} was not placed on {e.node_id}", "refused")
        else:
            return True
        return False

    @staticmethod
    def of_this_attempt(job: JobRecord, e: ev.JobTaskStarted | ev.JobTaskExited) -> bool:
        """A report names the attempt (the job.placed) it ran for: a late one about an earlier attempt changes nothing."""
        return e.attempt is None or not job.attempt or e.attempt == job.attempt

    def on_job_task_started(self, env: Envelope, e: ev.JobTaskStarted) -> None:
        job = self._job(env, e.job_id, {"placed", "running", "preempting"})
        if job is not None and self._reported_from_its_node(env, e, job.placements) and self.of_this_attempt(job, e):
            if job.state == "placed":
                job.state = "running"
            if job.started_at is None:
                job.started_at = env.timestamp
            if e.task not in job.tasks_running:
                job.tasks_running.append(e.task)

    def on_job_task_exited(self, env: Envelope, e: ev.JobTaskExited) -> None:
        job = self._job(env, e.job_id, ACTIVE | TERMINAL | {"preempted", "queued"})
        if job is not None and self._reported_from_its_node(env, e, job.last_placements) and self.of_this_attempt(job, e):
            if e.task in job.tasks_running:
                job.tasks_running.remove(e.task)
            # a task ended by a signal (a gang's peers stopped when one fails, an OOM kill) keeps it, negative, as
            # Python's returncode does: None only where the agent knew neither
            job.tasks_exited[e.task] = e.code if e.code is not None or e.signal is None else -e.signal

    def _end(self, env: Envelope, job_id: str, state: str, allowed: frozenset[str]) -> JobRecord | None:
        job = self._job(env, job_id, allowed)
        if job is not None:
            self._release(job, env.timestamp)
            job.state, job.ended_at = state, env.timestamp
            self._finish(job)
        return job

    def on_job_succeeded(self, env: Envelope, e: ev.JobSucceeded) -> None:
        self._end(env, e.job_id, "succeeded", ACTIVE)

    def on_job_failed(self, env: Envelope, e: ev.JobFailed) -> None:
        if job := self._end(env, e.job_id, "failed", ACTIVE | PENDING):
            job.exit_code, job.reason = e.code, e.reason

    def on_job_cancelled(self, env: Envelope, e: ev.JobCancelled) -> None:
        ended = self.jobs.get(e.job_id)
        if ended is None or ended.state in TERMINAL:
            # it ended between the caller's look and this fold (a task exited, another cancel came first), and may
            # have been dropped from memory since (only the last KEEP_FINISHED ended jobs are held; a bulk cancel's
            # own cancellations drop the oldest): a race every cancel can lose, not a conflict in the log. Only the
            # scheduler appends cancellations, each for a job it held; `events verify` counts these as expected
            why = f"had already {ended.state}" if ended is not None else "is not held (ended and dropped, or unknown)"
            self._came_late(env, ended, f"job {e.job_id} {why}: the cancellation came after")
            return
        if job := self._end(env, e.job_id, "cancelled", CANCELLABLE):
            job.reason = e.reason

    def on_job_preempting(self, env: Envelope, e: ev.JobPreempting) -> None:
        if job := self._job(env, e.job_id, {"placed", "running"}):
            job.state, job.reason = "preempting", e.reason
            job.preempting_since, job.grace_s = env.timestamp, e.grace_s

    def on_job_preempted(self, env: Envelope, e: ev.JobPreempted) -> None:
        job = self._job(env, e.job_id, {"preempting"})
        if job is not None:
            self._release(job, env.timestamp)
            # its tasks' exits were this attempt's: a job that waits again has none (a cancel then read SIGTERM)
            job.state, job.placements, job.tasks_running, job.tasks_exited = "preempted", [], [], {}
            job.preemptions.append(env.timestamp)
            job.started_at = job.placed_at = job.preempting_since = None

    def on_job_timed_out(self, env: Envelope, e: ev.JobTimedOut) -> None:
        if job := self._job(env, e.job_id, ACTIVE):
            job.timed_out = True

    def on_job_requeued(self, env: Envelope, e: ev.JobRequeued) -> None:
        if job := self._job(env, e.job_id, ACTIVE):
            self._release(job, env.timestamp)
            job.state, job.reason, job.retries = "queued", e.reason, job.retries + (0 if e.interrupted else 1)
            if e.interrupted and job.started_at is None:
                job.lost_before_start += 1
            job.placements, job.tasks_running, job.tasks_exited = [], [], {}
            job.started_at = job.placed_at = job.preempting_since = None

    # --- queues as the fair share sees them ---------------------------------------------

    def capacity_gpus(self) -> float:
        """Healthy GPUs on schedulable nodes: what can be divided now."""
        return float(sum(
            1 for n in self.nodes.values() if n.schedulable
            for g in n.info.gpus if g.healthy and g.uuid not in n.unhealthy
        ))

    def share_ratios(self) -> Ratios:
        """CPU and memory per healthy GPU over the schedulable nodes: the exchange rates of dominant share."""
        gpus, cpu, mem = 0, 0, 0
        for n in self.nodes.values():
            if n.schedulable:
                gpus += sum(1 for g in n.info.gpus if g.healthy and g.uuid not in n.unhealthy)
                cpu, mem = cpu + n.info.cpu_milli, mem + n.info.memory_mib
        return Ratios.of(gpus, cpu, mem)

    def queue_load(self, waited_before: float | None = None,
                   ratios: Ratios | None = None) -> tuple[dict[str, float], dict[str, float]]:
        """(allocated, pending) per leaf queue in GPU-equivalents of the dominant resource (see shared.fairshare;
        ``ratios=Ratios()``: in GPUs alone); with ``waited_before``, only jobs waiting since then count as pending."""
        load = self.queue_loads(waited_before, ratios)
        return load.alloc, load.waited  # with no waited_before, every pending job has waited

    def queue_loads(self, waited_before: float | None = None, ratios: Ratios | None = None) -> "QueueLoad":
        """Every leaf queue's load in one pass over the jobs (see ``QueueLoad``; a cycle's read made four)."""
        return self.queue_loads_in(self.share_ratios() if ratios is None else ratios, waited_before=waited_before)[0]

    def queue_loads_in(self, *ratios: Ratios, waited_before: float | None = None) -> "tuple[QueueLoad, ...]":
        """``queue_loads`` in each of ``ratios`` (e.g. in GPUs and in dominant shares), still one pass over the jobs:
        GET /v1/queues and a scrape of /metrics need both, and each pass costs 10-15 ms at 20,000 jobs."""
        outs = tuple(QueueLoad({}, {}, {}, {}) for _ in ratios)
        pairs = tuple(zip(ratios, outs))
        for job in self.jobs.values():
            state = job.state
            if state in ACTIVE:
                q = job.spec.queue
                for r, out in pairs:
                    out.alloc[q] = out.alloc.get(q, 0.0) + job.share(r)
            elif state in PENDING:
                q, waited = job.spec.queue, waited_before is None or job.updated_at <= waited_before
                for r, (_, pending, waits, smallest) in pairs:
                    gpus = job.share(r)
                    pending[q] = pending.get(q, 0.0) + gpus
                    if waited:
                        waits[q] = waits.get(q, 0.0) + gpus
                    if state == "queued" and gpus < smallest.get(q, float("inf")):
                        smallest[q] = gpus
        return outs

    def division(self, now: float, half_life_s: float, load: "QueueLoad | None" = None) -> Division:
        """The fair-share division at ``now`` (``load``: this projection's, read already)."""
        alloc, pending, _, _ = self.queue_loads() if load is None else load
        demand = {q: alloc.get(q, 0.0) + pending.get(q, 0.0) for q in set(alloc) | set(pending)}
        return divide(self.capacity_gpus(), self.queues, demand, self.decayed_usage(now, half_life_s))

    # --- state -----------------------------------------------------------------------

    FRESH_STATE = frozenset({"jobs", "nodes"})  # every record's to_json() is a new dict of new containers

    def state(self) -> dict[str, Any]:
        return {
            "now": self.now,
            "nodes": {k: v.to_json() for k, v in self.nodes.items()},
            "jobs": {k: v.to_json() for k, v in self.jobs.items()},
            "queues": {k: v.model_dump(mode="json") for k, v in self.queues.items()},
            "finished": list(self.finished),
            "pool_shapes": self.pool_shapes,
            "accounting": {q: {str(b): v for b, v in bs.items()} for q, bs in self.accounting.items()},
            "holdings": {q: [list(h) for h in hs] for q, hs in self.holdings.items()},
            "exact_since": self.exact_since,
        }

    def load(self, state: dict[str, Any]) -> None:
        self.now = state["now"]
        self.nodes = {k: NodeState.from_json(v) for k, v in state["nodes"].items()}
        self.jobs, self.arrays = {}, {}
        for v in state["jobs"].values():
            self.add_job(JobRecord.from_json(v))
        self.queues = {k: QueueSpec.model_validate(v) for k, v in state["queues"].items()}
        self.finished = dict.fromkeys(state["finished"])
        self.pool_shapes = {k: tuple(v) for k, v in state["pool_shapes"].items()}
        self.accounting = {q: {int(b): v for b, v in bs.items()} for q, bs in state["accounting"].items()}
        if "holdings" in state:
            self.holdings = {q: [(s, e, g) for s, e, g in hs] for q, hs in state["holdings"].items()}
            self.exact_since = state["exact_since"]
        else:  # a snapshot from before intervals were kept: its holdings are in the buckets alone
            self.holdings = {}
            self.exact_since = math.ceil(self.now / ACCOUNTING_BUCKET_S) * ACCOUNTING_BUCKET_S
