"""Victim choice: the cheapest set of whole running gangs whose eviction lets a waiting gang fit."""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.gang import capacity, place_gang
from services.scheduler.snapshot import PendingJob, RunningJob
from services.scheduler.shapes import TaskShape
from services.scheduler.workstate import NOW, WorkState
from shared.model import MILLI

SINGLE_VICTIM_PROBES = 64


def lost_gpu_seconds(job: RunningJob, now: float) -> float:
    start = job.started_at if job.started_at is not None else job.placed_at
    return job.gpu_milli / MILLI * max(0.0, now - start)


class VictimSearch:
    """Answers "what if these gangs left" on the cycle's working state, undoing each probe."""

    def __init__(self, ws: WorkState, now: float) -> None:
        self.ws, self.now = ws, now

    def _fits_without(self, sid: int, tasks: int, topology: str, victims: Sequence[RunningJob]) -> bool:
        undo = [u for v in victims for u in self.ws.give(self.ws.footprint(v))]
        ok = capacity(self.ws, sid).fits(tasks, topology)
        self.ws.undo(undo)
        return ok

    def cheapest(self, job: PendingJob, pool: Sequence[RunningJob]) -> list[RunningJob] | None:
        """Fewest GPU-seconds lost, then fewest jobs; None if even evicting the whole pool would not do.

        1. Cheapest first, take the shortest prefix that frees the shape (binary
           search: evicting more never frees less).
        2. Drop every chosen gang that is not needed, most expensive first.
        3. A single gang cheaper than that set (or as cheap, being one) wins.
        4. Claim: the victims' capacity goes to the job in the working state, so a
           later preemptor cannot count it twice. The job is not placed this cycle.
        """
        spec = job.spec
        sid = self.ws.shape_id(TaskShape.of(spec))
        tasks, topo = spec.tasks, spec.topology
        cost = {v.job_id: lost_gpu_seconds(v, self.now) for v in pool}
        ranked = sorted(pool, key=lambda v: (cost[v.job_id], v.priority_rank, v.job_id))
        if not self._fits_without(sid, tasks, topo, ranked):
            return None
        lo, hi = 1, len(ranked)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._fits_without(sid, tasks, topo, ranked[:mid]):
                hi = mid
            else:
                lo = mid + 1
        chosen = ranked[:lo]
        for v in sorted(chosen, key=lambda v: (-cost[v.job_id], v.job_id)):
            rest = [c for c in chosen if c is not v]
            if rest and self._fits_without(sid, tasks, topo, rest):
                chosen = rest
        total = sum(cost[v.job_id] for v in chosen)
        for v in ranked[:SINGLE_VICTIM_PROBES]:
            if (cost[v.job_id], 1) >= (total, len(chosen)):
                break
            if self._fits_without(sid, tasks, topo, [v]):
                chosen = [v]
                break
        undo = [u for v in chosen for u in self.ws.give(self.ws.footprint(v))]
        if place_gang(self.ws, sid, tasks, topo, NOW) is None:
            self.ws.undo(undo)
            return None
        return sorted(chosen, key=lambda v: v.job_id)
