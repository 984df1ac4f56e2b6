"""Where a job would be placed now, without submitting it: the scheduler's snapshot and a one-job cycle."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from services.scheduler.core import Cycle, Policy
from services.scheduler.snapshot import PendingJob, dependency_targets, snapshot_from_cluster
from shared.cluster import ClusterProjection
from shared.model import PRIORITY_RANK, JobSpec

PROBE = "dry-run"


def place_now(proj: ClusterProjection, spec: JobSpec, policy: Policy, now: float) -> dict[str, Any]:
    """``placement`` per task if the job would start now on what is free (queue limits counted), else the
    ``reason`` the scheduler would give. Jobs already waiting are left out of the cycle: ``ahead`` counts those
    of its queue that would go first."""
    snap = snapshot_from_cluster(proj, now)
    rank = PRIORITY_RANK[spec.priority]
    ahead = sum(1 for j in snap.pending if j.queue == spec.queue and j.priority_rank >= rank)
    job = PendingJob(PROBE, spec, now, 0)
    snap = replace(snap, pending=(job,), targets=dependency_targets(proj, [job]))  # its dependencies, as they are now
    cycle = Cycle(snap, replace(policy, backfill=False, preempt=False), now)
    cycle.allocate(iter([job]))
    placed = cycle.placements.get(PROBE)
    out: dict[str, Any] = {
        "placed_now": placed is not None,
        "placement": [] if placed is None else [
            {"task": t.task, "node": t.node_id, "gpus": [g.uuid for g in t.gpus], "shares": [g.milli for g in t.gpus]}
            for t in placed.tasks],
        "spread": None if placed is None else placed.spread,
        "reason": cycle.unschedulable.get(PROBE),
        "ahead": ahead,
    }
    return out
