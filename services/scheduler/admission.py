"""Admission at the API edge: refuse, with a reason, a job that could never run here."""

from __future__ import annotations

from services.scheduler.core import Cycle, Policy
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


def shape_error(proj: ClusterProjection, spec: JobSpec) -> str | None:
    """None if the gang would fit on an empty cluster (cordoned nodes count: they can come back).

    With no node registered yet, every job waits: nodes may still join. Node pools
    count with as many empty nodes of their profile as they may grow to.
    """
    if not proj.nodes and not proj.pool_shapes:
        return None
    idle = [node_snap(NodeState(info=n.info, unhealthy=n.unhealthy)) for n in proj.nodes.values() if not n.lost]
    for pool, (profile, max_nodes) in sorted(proj.pool_shapes.items()):
        if profile in PROFILES:
            idle += [node_snap(NodeState(info=build(profile, f"{pool}-may-{i}"))) for i in range(min(max_nodes, spec.tasks))]
    if not idle:
        return None
    job = PendingJob("admission", spec, 0.0, 0)
    cycle = Cycle(Snapshot(tuple(idle), (job,), (), None, 0.0), Policy(name="bestfit", backfill=False, preempt=False), 0.0)
    if cycle.ever_fits(job):
        return None
    return "no node could ever run this job: " + cycle.reason(job, "now")


def admission_error(proj: ClusterProjection, spec: JobSpec) -> str | None:
    return queue_error(proj, spec.queue) or shape_error(proj, spec)


