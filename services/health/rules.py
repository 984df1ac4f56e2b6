"""What health decides, as pure functions: no I/O, no clock (``now`` is passed in).

XID errors
----------
An XID is the driver's report of a GPU error. NVML's GPU recovery action
(``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``, drivers r550 and later), when the agent
could read it, decides: ``NONE`` means the GPU needs nothing and is not marked;
any other action (GPU reset, node reboot, drain peer-to-peer, drain and reset,
bus reset, system reboot, IMEX domain recovery) marks it. Without one, this table
decides (after NVIDIA's XID catalog):

    XID  meaning                                               GPU
    13   graphics engine exception (application)               not marked
    31   GPU memory page fault (application)                   not marked
    43   GPU stopped processing (application)                  not marked
    45   preemptive cleanup after earlier errors (application) not marked
    48   double-bit ECC error                                  unhealthy
    61   internal micro-controller breakpoint/warning          unhealthy
    62   internal micro-controller halt                        unhealthy
    63   ECC page retirement / row remapping event             unhealthy
    64   ECC page retirement / row remapping failure           unhealthy
    74   NVLink error                                          unhealthy
    79   GPU has fallen off the bus                            unhealthy
    94   contained ECC error                                   unhealthy
    95   uncontained ECC error                                 unhealthy
    119  GSP RPC timeout                                       unhealthy
    120  GSP error                                             unhealthy
    140  unrecovered ECC error                                 unhealthy
    154  GPU recovery action changed                           unhealthy

An XID in neither the table nor with a recovery action is logged and does not
mark the GPU: marking drains work, so it takes a known cause.

Telemetry
---------
An uncorrectable ECC count (volatile, since the driver loaded) that is above
zero and above the last count seen marks the GPU once per increase. A
temperature above the slowdown threshold for ``hot_samples`` consecutive samples
marks it once per hot streak.

A marked GPU cordons its node; kinds in ``policy.drain_on`` also drain it
(running jobs get ``job.preempting`` with ``fault_grace_s`` and go back to the
queue). Thermal slowdown is transient, so by default it only cordons.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from shared.settings import Settings

ACTIVE = frozenset({"placed", "running", "preempting"})  # holding resources (as shared.cluster.ACTIVE)
STOPPABLE = frozenset({"placed", "running"})  # not already being stopped

APPLICATION_XIDS: Mapping[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup after earlier errors",
}
FAULT_XIDS: Mapping[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping event",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
    154: "GPU recovery action changed",
}
RECOVERY_NONE = 0
RECOVERY_ACTIONS: Mapping[int, str] = {  # NVML_GPU_RECOVERY_ACTION_*
    0: "none",
    1: "GPU reset",
    2: "node reboot",
    3: "drain peer-to-peer",
    4: "drain and reset",
    5: "recover IMEX domain",
    6: "bus reset",
    7: "system reboot",
}


@dataclass(frozen=True)
class HealthPolicy:
    heartbeat_timeout_s: float = 10.0
    slowdown_c: int = 90  # NVML's per-GPU slowdown threshold is not in the telemetry sample yet
    hot_samples: int = 3
    drain_on: frozenset[str] = frozenset({"xid", "ecc"})
    fault_grace_s: int = 30
    time_limit_grace_s: int = 30
    auto_resume_after_s: float | None = None  # off: a faulted node stays cordoned until an operator resumes it
    free_unstarted_requeues: int = 2  # a job lost before it started goes back this often without spending a retry

    @classmethod
    def of(cls, settings: Settings) -> HealthPolicy:
        """The policy the health service runs from its settings (the rest are the rules' defaults)."""
        return cls(heartbeat_timeout_s=settings.heartbeat_timeout_s,
                   free_unstarted_requeues=settings.free_unstarted_requeues)


# --- GPU faults --------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """A GPU to mark unhealthy. ``key`` identifies the observation, so a repeat decides nothing new."""

    node_id: str
    gpu_uuid: str
    kind: str  # xid | ecc | thermal
    detail: str
    key: str
    xid: int | None = None


def xid_detail(xid: int, recovery_action: int | None = None) -> str | None:
    """Why this XID makes the GPU unhealthy, or None if it does not."""
    meaning = FAULT_XIDS.get(xid) or APPLICATION_XIDS.get(xid) or "unlisted XID"
    action = RECOVERY_ACTIONS.get(recovery_action) if recovery_action is not None else None
    if action is not None:
        return None if recovery_action == RECOVERY_NONE else f"{meaning}; NVML recovery action: {action}"
    return FAULT_XIDS.get(xid)


def xid_fault(node_id: str, gpu_uuid: str, xid: int, t: float, recovery_action: int | None = None) -> Fault | None:
    detail = xid_detail(xid, recovery_action)
    if detail is None:
        return None
    return Fault(node_id, gpu_uuid, "xid", detail, key=f"xid{xid}-{round(t * 1000)}", xid=xid)


@dataclass(frozen=True)
class GpuWatch:
    """What the rules remember about one GPU between samples."""

    hot_streak: int = 0
    ecc_uncorrected: int | None = None


def assess_sample(
    prev: GpuWatch, node_id: str, gpu_uuid: str, t: float, temperature_c: int | None, ecc_uncorrected: int | None,
    policy: HealthPolicy,
) -> tuple[GpuWatch, list[Fault]]:
    """One telemetry sample of one GPU: the new memory, and the faults it shows."""
    faults = []
    if ecc_uncorrected is not None and ecc_uncorrected > 0 and (prev.ecc_uncorrected is None or ecc_uncorrected > prev.ecc_uncorrected):
        faults.append(Fault(node_id, gpu_uuid, "ecc", f"{ecc_uncorrected} uncorrectable ECC errors", key=f"ecc-{ecc_uncorrected}"))
    hot = temperature_c is not None and temperature_c > policy.slowdown_c
    streak = prev.hot_streak + 1 if hot else 0
    if streak == policy.hot_samples:
        detail = f"{temperature_c} °C, above the slowdown threshold {policy.slowdown_c} °C for {streak} samples"
        faults.append(Fault(node_id, gpu_uuid, "thermal", detail, key=f"thermal-{round(t * 1000)}"))
    ecc = ecc_uncorrected if ecc_uncorrected is not None else prev.ecc_uncorrected
    return replace(prev, hot_streak=streak, ecc_uncorrected=ecc), faults


def sample_is_healthy(temperature_c: int | None, policy: HealthPolicy) -> bool:
    return temperature_c is None or temperature_c <= policy.slowdown_c


# --- heartbeats --------------------------------------------------------------------


def lost_nodes(last_beats: Mapping[str, float], now: float, timeout_s: float) -> list[tuple[str, float]]:
    """(node, seconds silent) for every node whose last beat is older than the timeout, by node id."""
    return sorted((n, now - t) for n, t in last_beats.items() if now - t > timeout_s)


# --- jobs --------------------------------------------------------------------------


@dataclass(frozen=True)
class JobView:
    job_id: str
    state: str
    nodes: frozenset[str] = field(default_factory=frozenset)
    started_at: float | None = None
    time_limit_s: int | None = None
    timed_out: bool = False
    retries: int = 0
    max_retries: int = 0
    lost_before_start: int = 0  # times it was requeued before any of its tasks started


@dataclass(frozen=True)
class Overdue:
    job_id: str
    overrun_s: float
    timed_out: bool  # job.timed_out already recorded: only the failure is left


def overdue_jobs(jobs: Iterable[JobView], now: float) -> list[Overdue]:
    """Running jobs past their time limit, counted from their first task's start."""
    return [
        Overdue(j.job_id, now - j.started_at - j.time_limit_s, j.timed_out)
        for j in jobs
        if j.state == "running" and j.time_limit_s and j.started_at is not None and now - j.started_at > j.time_limit_s
    ]


@dataclass(frozen=True)
class LostJob:
    job_id: str
    requeue: bool  # else it fails: no retries left
    reason: str
    interrupted: bool = False  # requeued without a retry counted: it had not started


def plan_lost_node(node_id: str, jobs: Iterable[JobView], free_unstarted: int) -> list[LostJob]:
    """Every job holding resources on a lost node: back to the queue while it has retries left, else failed.

    A job none of whose tasks had started goes back to the queue whatever its retries, and uses none: it never ran
    (as Slurm requeues a job whose launch failed). A node that dies silently looks free until its heartbeats are
    missed, so jobs are placed there in that window, and they would otherwise fail without having run. That holds
    ``free_unstarted`` times per job: a job whose start takes its node down would otherwise go round every node of
    the cluster (Slurm holds a job after MaxBatchRequeue requeues); later losses count as any lost run's."""
    out = []
    for j in jobs:
        if j.state in ACTIVE and node_id in j.nodes:
            unstarted = j.started_at is None
            if unstarted and j.lost_before_start < free_unstarted:
                out.append(LostJob(j.job_id, True, f"node lost before its tasks started: {node_id}", interrupted=True))
                continue
            requeue = j.retries < j.max_retries
            why = f"node lost: {node_id}" if not unstarted else (
                f"node lost before its tasks started: {node_id}, the {ordinal(j.lost_before_start + 1)} time "
                f"({free_unstarted} free requeues used)")
            why += f" (retry {j.retries + 1} of {j.max_retries})" if requeue else ""
            out.append(LostJob(j.job_id, requeue, why))
    return sorted(out, key=lambda x: x.job_id)


def ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


@dataclass(frozen=True)
class DrainPlan:
    preempt: tuple[str, ...]  # jobs to stop with the drain's grace
    waiting: tuple[str, ...]  # jobs already being stopped
    drained: bool  # nothing holds resources on the node any more


def plan_drain(node_id: str, jobs: Iterable[JobView]) -> DrainPlan:
    on_node = sorted((j for j in jobs if j.state in ACTIVE and node_id in j.nodes), key=lambda j: j.job_id)
    return DrainPlan(
        preempt=tuple(j.job_id for j in on_node if j.state in STOPPABLE),
        waiting=tuple(j.job_id for j in on_node if j.state not in STOPPABLE),
        drained=not on_node,
    )


# --- auto-resume -------------------------------------------------------------------


@dataclass(frozen=True)
class NodeView:
    node_id: str
    cordoned: bool
    draining: bool
    lost: bool
    unhealthy: bool  # some GPU marked
    manual_hold: bool  # an operator (or another service) cordoned or drained it
    last_fault_at: float | None  # last fault recorded or observed


def resume_due(node: NodeView, now: float, after_s: float | None) -> bool:
    """A node health cordoned for a fault, drained, and quiet for ``after_s``: resume it (off when None)."""
    if after_s is None or node.lost or node.draining or node.manual_hold:
        return False
    if not (node.cordoned and node.unhealthy) or node.last_fault_at is None:
        return False
    return now - node.last_fault_at >= after_s
