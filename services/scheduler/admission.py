"""Admission at the API edge: refuse, with a reason, a job that could never run here."""

from __future__ import annotations

from collections.abc import Mapping

from services.scheduler.core import Cycle, Policy
from services.scheduler.reasons import POOL_NOTE, reason_class
from services.scheduler.shapes import TaskShape
from services.scheduler.snapshot import PendingJob, Snapshot, node_snap
from shared.cluster import ClusterProjection, NodeState
from shared.model import JobSpec
from shared.profiles import PROFILES, build


def queue_error(proj: ClusterProjection, queue: str) -> str | None:
    if queue not in proj.queues:
        known = ", ".join(sorted(proj.queues)[:20])
        return f"unknown queue {queue!r}; known queues: {known}"
    children = sorted(q for q in proj.queues if q.startswith(queue + "."))
    if children:
        return f"queue {queue!r} has child queues; submit to a leaf: {', '.join(children[:10])}"
    return None


def _on_empty(proj: ClusterProjection, spec: JobSpec,
              pools: Mapping[str, tuple[str, int]]) -> tuple[Cycle, PendingJob] | None:
    """A cycle over the cluster's nodes as if idle, plus as many empty nodes of each of ``pools`` as the job could
    use (None: no node at all)."""
    idle = [node_snap(NodeState(info=n.info, unhealthy=n.unhealthy)) for n in proj.nodes.values() if not n.lost]
    for pool, (profile, max_nodes) in sorted(pools.items()):
        if profile in PROFILES:
            idle += [node_snap(NodeState(info=build(profile, f"{pool}-may-{i}"))) for i in range(min(max_nodes, spec.tasks))]
    if not idle:
        return None
    job = PendingJob("admission", spec, 0.0, 0)
    cycle = Cycle(Snapshot(tuple(idle), (job,), (), None, 0.0), Policy(name="bestfit", backfill=False, preempt=False), 0.0)
    return cycle, job


def shape_error(proj: ClusterProjection, spec: JobSpec) -> str | None:
    """None if the gang would fit on an empty cluster (cordoned nodes count: they can come back).

    With no node registered yet, every job waits: nodes may still join. Node pools
    count with as many empty nodes of their profile as they may grow to.
    """
    if not proj.nodes and not proj.pool_shapes:
        return None
    made = _on_empty(proj, spec, proj.pool_shapes)
    if made is None or made[0].ever_fits(made[1]):
        return None
    return "no node could ever run this job: " + made[0].reason(made[1], "now")


def pools_for(proj: ClusterProjection, spec: JobSpec) -> list[str]:
    """The node pools that could grow nodes to run a job no node here now could: each that would do alone, else
    all of them if only together they would, else none."""
    alone = [p for p, shape in sorted(proj.pool_shapes.items())
             if (made := _on_empty(proj, spec, {p: shape})) and made[0].ever_fits(made[1])]
    if alone or len(proj.pool_shapes) < 2:
        return alone
    return sorted(proj.pool_shapes) if shape_error(proj, spec) is None else []


def with_pool_notes(proj: ClusterProjection, reasons: dict[str, str], kept: dict[tuple, list[str]]) -> dict[str, str]:
    """The cycle's reasons, where a job that no node here could ever run names the node pools that could grow nodes
    for it: it waits for them (the autoscaler sees it), it is not stuck. ``kept``: the pools per task shape, for the
    caller to empty when the cluster's shape changes."""
    if not proj.pool_shapes:
        return reasons
    out = dict(reasons)
    for job_id, reason in reasons.items():
        if reason_class(reason) != "never fits" or (job := proj.jobs.get(job_id)) is None:
            continue
        spec = job.spec
        key = (TaskShape.of(spec), spec.tasks, spec.topology, spec.tasks_per_node)
        if (pools := kept.get(key)) is None:
            pools = kept[key] = pools_for(proj, spec)
        if pools:
            out[job_id] = f"{reason}; node pool{'s' if len(pools) > 1 else ''} {', '.join(pools)} {POOL_NOTE}"
    return out


def admission_error(proj: ClusterProjection, spec: JobSpec) -> str | None:
    return queue_error(proj, spec.queue) or shape_error(proj, spec)


