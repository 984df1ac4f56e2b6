"""What the health leader appends, decided from its projection: pure, shared by the service and the simulator.

Each decision names the event, an id derived from what triggered it (so a retried
or re-made decision is deduplicated by the log), and, for a job, the job's last
subject sequence it was decided on (so one that raced another writer is refused
and decided again). ``chained``: it must follow the decision before it, and its
expected sequence is that one's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.health import rules
from services.health.projection import HealthProjection
from services.health.rules import Fault, HealthPolicy
from shared import events as ev

TIME_LIMIT_REASON = "time limit exceeded"


@dataclass(frozen=True)
class Decision:
    event: ev.Event
    event_id: str
    expected: int | None = None
    chained: bool = False


def mark(proj: HealthProjection, fault: Fault, policy: HealthPolicy) -> list[Decision]:
    """A faulty GPU: gpu.unhealthy, its node cordoned and, for the kinds the policy drains on, drained."""
    node = proj.nodes.get(fault.node_id)
    if node is None or fault.gpu_uuid in node.unhealthy:
        return []
    base = f"{fault.node_id}-{fault.gpu_uuid}-{fault.key}"
    why = f"gpu {fault.gpu_uuid}: {fault.kind}{'' if fault.xid is None else f' {fault.xid}'} ({fault.detail})"
    out = [Decision(ev.GpuUnhealthy(node_id=fault.node_id, gpu_uuid=fault.gpu_uuid, kind=fault.kind, xid=fault.xid,
                                    detail=fault.detail), f"{base}-unhealthy")]
    if not node.cordoned:
        out.append(Decision(ev.NodeCordoned(node_id=fault.node_id, reason=why), f"{base}-cordon"))
    if fault.kind in policy.drain_on and not node.draining:
        out.append(Decision(ev.NodeDrainRequested(node_id=fault.node_id, grace_s=policy.fault_grace_s, reason=why),
                            f"{base}-drain"))
    return out


def node_lost(proj: HealthProjection, node_id: str, silent_s: float, policy: HealthPolicy) -> Decision:
    reason = f"no heartbeat for {silent_s:.1f}s (timeout {policy.heartbeat_timeout_s:g}s)"
    return Decision(ev.NodeLost(node_id=node_id, reason=reason), f"{node_id}-lost-{proj.registrations.get(node_id, 0)}")


def requeue_lost_jobs(proj: HealthProjection, policy: HealthPolicy) -> list[Decision]:
    """Jobs holding resources on a lost node: requeued while retries last (or free, before they started), else
    failed."""
    lost_nodes = [n for n, node in proj.nodes.items() if node.lost]
    out, jobs = [], proj.job_views() if lost_nodes else []
    for node_id in lost_nodes:
        for lost in rules.plan_lost_node(node_id, jobs, policy.free_unstarted_requeues):
            event: ev.Event = ev.JobRequeued(job_id=lost.job_id, reason=lost.reason, interrupted=lost.interrupted) \
                if lost.requeue else ev.JobFailed(job_id=lost.job_id, reason=lost.reason)
            out.append(Decision(event, f"{lost.job_id}-lost-{node_id}-{proj.registrations.get(node_id, 0)}",
                                proj.jobs[lost.job_id].seq))
    return out


def enforce_time_limits(proj: HealthProjection, now: float, policy: HealthPolicy,
                        only: Iterable[str] | None = None) -> list[Decision]:
    """A job past its limit (of all running jobs, or ``only`` these) is stopped with grace and ends failed, never requeued.

    job.timed_out tells its agents to stop it; job.failed follows at once, so the
    scheduler, reacting to the task's exit, finds it already ended and cannot
    requeue it or call it a success. Its GPUs are freed at the failure, as for a
    cancel, while the agents enforce the grace.
    """
    out = []
    for over in rules.overdue_jobs(proj.job_views(frozenset({"running"}), only), now):
        job = proj.jobs[over.job_id]
        attempt = round((job.started_at or 0) * 1000)
        failed = ev.JobFailed(job_id=job.job_id, reason=TIME_LIMIT_REASON)
        if over.timed_out:
            out.append(Decision(failed, f"{job.job_id}-time-limit-{attempt}", job.seq))
        else:
            out.append(Decision(ev.JobTimedOut(job_id=job.job_id, grace_s=policy.time_limit_grace_s),
                                f"{job.job_id}-timed-out-{attempt}", job.seq))
            out.append(Decision(failed, f"{job.job_id}-time-limit-{attempt}", chained=True))
    return out


def drain_nodes(proj: HealthProjection, policy: HealthPolicy) -> list[Decision]:
    """Draining nodes: node.drained once nothing holds resources there, else their jobs preempted with the drain's grace."""
    draining = [(n, node) for n, node in proj.nodes.items() if node.draining]
    out, jobs = [], proj.job_views() if draining else []
    for node_id, node in draining:
        drain = proj.drains.get(node_id, {"grace_s": policy.fault_grace_s, "reason": "", "seq": 0})
        plan = rules.plan_drain(node_id, jobs)
        if plan.drained:
            out.append(Decision(ev.NodeDrained(node_id=node_id), f"{node_id}-drained-{drain['seq']}"))
            continue
        if node.lost:
            continue  # its jobs are requeued as lost, without a grace nobody could honour
        reason = f"node {node_id} draining" + (f": {drain['reason']}" if drain["reason"] else "")
        for job_id in plan.preempt:
            event = ev.JobPreempting(job_id=job_id, reason=reason, grace_s=drain["grace_s"])
            out.append(Decision(event, f"{job_id}-drain-{node_id}-{drain['seq']}", proj.jobs[job_id].seq))
    return out


def auto_resume(proj: HealthProjection, now: float, policy: HealthPolicy, bad_seen: dict[str, float]) -> list[Decision]:
    after = policy.auto_resume_after_s
    if after is None:
        return []
    out = []
    for node_id in proj.nodes:
        view = proj.node_view(node_id, bad_seen.get(node_id))
        if rules.resume_due(view, now, after):
            out.append(Decision(ev.NodeResumed(node_id=node_id),
                                f"{node_id}-auto-resume-{round((view.last_fault_at or 0) * 1000)}"))
    return out


def round_of(proj: HealthProjection, now: float, policy: HealthPolicy, bad_seen: dict[str, float],
             limits: Iterable[str] | None = None) -> list[Decision]:
    """One round after the lost nodes are found: their jobs, time limits (all running jobs, or ``limits``), drains,
    auto-resume."""
    return [
        *requeue_lost_jobs(proj, policy),
        *enforce_time_limits(proj, now, policy, limits),
        *drain_nodes(proj, policy),
        *auto_resume(proj, now, policy, bad_seen),
    ]


def describe(d: Decision) -> str:
    """A log line's fields for one decision: event=job_preempting job='j-1' grace_s=30 reason='...'."""
    e = d.event
    fields = {"job": getattr(e, "job_id", None), "node": getattr(e, "node_id", None), "gpu": getattr(e, "gpu_uuid", None),
              "xid": getattr(e, "xid", None), "grace_s": getattr(e, "grace_s", None), "reason": getattr(e, "reason", None),
              "detail": getattr(e, "detail", None)}
    return " ".join([f"event={e.TYPE.replace('.', '_')}", *(f"{k}={v!r}" for k, v in fields.items() if v is not None)])
