"""Slurm's gates on a pending job, before any capacity is looked at: its dependencies, its array's throttle
(--array=...%N) and singleton.

Pure: a cycle builds ``Gates`` from its snapshot and asks, per job, whether it may be placed now, must wait (with
the reason a person reads), or can never be placed because a dependency can never be met (it is cancelled).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from shared.model import Dependency

if TYPE_CHECKING:
    from services.scheduler.snapshot import PendingJob, Snapshot

OK = frozenset({"succeeded"})
NOT_OK = frozenset({"failed", "cancelled", "rejected"})
ENDED = OK | NOT_OK
MEETS = {"afterok": OK, "afternotok": NOT_OK, "afterany": ENDED}  # the end each kind waits for

Outcomes = tuple[tuple[str, str], ...]  # (job id, state) of what a dependency names: one job, or an array's elements


def dependency_verdict(dep: Dependency, jobs: Outcomes) -> tuple[str, str]:
    """("met", ""), ("wait", why) or ("never", why) for one dependency, given the jobs it names and their states.

    On an array every element must end as the kind asks: one element that ended otherwise makes it never met.
    """
    label = f"{dep.kind}:{dep.job}"
    if not jobs:
        return "wait", (f"waiting for dependency {label} (job {dep.job} is not known here: it may have ended long "
                        "ago; cancel this job and submit it again without the dependency)")
    wanted = MEETS[dep.kind]
    for job_id, state in jobs:
        if state in ENDED and state not in wanted:
            return "never", f"dependency {label} can never be met: {job_id} {state}"
    left = [(j, s) for j, s in jobs if s not in ENDED]
    if not left:
        return "met", ""
    if len(jobs) == 1:
        return "wait", f"waiting for dependency {label} ({left[0][1]})"
    return "wait", f"waiting for dependency {label} ({len(jobs) - len(left)} of {len(jobs)} elements ended)"


class Gates:
    """What keeps pending jobs from being placed this cycle, updated as the cycle places jobs."""

    def __init__(self, snapshot: "Snapshot") -> None:
        self.targets: Mapping[str, Outcomes] = snapshot.targets
        self.array_held: dict[str, int] = {}  # array id -> elements placed, running or preempting
        self.named: dict[tuple[str, str], str] = {}  # (name, owner) -> a job of them holding resources
        for r in snapshot.running:
            self._hold(r.job_id, r.spec.name, r.owner, r.spec.array.id if r.spec.array else None)

    def _hold(self, job_id: str, name: str, owner: str, array: str | None) -> None:
        if array is not None:
            self.array_held[array] = self.array_held.get(array, 0) + 1
        self.named.setdefault((name, owner), job_id)

    def never(self, job: "PendingJob") -> str | None:
        """Why the job can never be placed (a dependency that can no longer be met); None if it still may."""
        for dep in job.spec.dependencies:
            verdict, why = dependency_verdict(dep, self.targets.get(dep.job, ()))
            if verdict == "never":
                return why
        return None

    def blocked(self, job: "PendingJob") -> str | None:
        """Why the job must wait this cycle, whatever the free capacity (None: it may be placed)."""
        spec = job.spec
        for dep in spec.dependencies:
            verdict, why = dependency_verdict(dep, self.targets.get(dep.job, ()))
            if verdict != "met":
                return why
        a = spec.array
        if a is not None and a.max_running is not None and self.array_held.get(a.id, 0) >= a.max_running:
            return f"array {a.id} at its limit of {a.max_running} running"
        if spec.singleton and (other := self.named.get((spec.name, job.owner))) is not None:
            owner = f" and owner {job.owner}" if job.owner else ""
            return f"singleton: waiting for {other} (same name {spec.name}{owner}) to end"
        return None

    def placed(self, job: "PendingJob") -> None:
        """The cycle placed ``job``: it counts against its array's limit and its name's singleton from now on."""
        self._hold(job.job_id, job.spec.name, job.owner, job.spec.array.id if job.spec.array else None)
