"""Victim choice: the cheapest set of whole running gangs whose eviction lets a waiting gang fit."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.scheduler.gang import capacity, place_gang
from services.scheduler.snapshot import PendingJob, RunningJob
from services.scheduler.shapes import TaskShape
from services.scheduler.workstate import NOW, Footprint, WorkState
from shared.model import MILLI

SINGLE_VICTIM_PROBES = 64


def lost_gpu_seconds(job: RunningJob, now: float) -> float:
    start = job.started_at if job.started_at is not None else job.placed_at
    return job.gpu_milli / MILLI * max(0.0, now - start)


class VictimSearch:
    """Answers "what if these gangs left" on the cycle's working state, undoing each probe."""

    def __init__(self, ws: WorkState, now: float) -> None:
        self.ws, self.now = ws, now
        self._fps: dict[str, Footprint] = {}
        self.mode = NOW

    def footprint(self, job: RunningJob) -> Footprint:
        fp = self._fps.get(job.job_id)
        if fp is None:
            fp = self._fps[job.job_id] = self.ws.footprint(job)
        return fp

    def _fits_without(self, sid: int, tasks: int, topology: str, victims: Sequence[RunningJob]) -> bool:
        undo = [u for v in victims for u in self.ws.give(self.footprint(v))]
        ok = capacity(self.ws, sid, self.mode).fits(tasks, topology)
        self.ws.undo(undo)
        return ok

    def cheapest(self, job: PendingJob, pool: Sequence[RunningJob], mode: str = NOW,
                 accept: Callable[[Sequence[RunningJob]], bool] | None = None) -> list[RunningJob] | None:
        """Fewest GPU-seconds lost, then fewest jobs; None if no eviction in the pool makes room.

        A gang that must (or will) sit on one node is a per-node question, answered
        node by node without touching the working state. Other gangs search the
        whole pool. Then the claim: the victims' capacity goes to the job in the
        working state, so a later preemptor cannot count it twice. The job itself is
        placed in a later cycle, once the victims are gone.

        ``mode`` is what the job may use (LONG: not what a reservation holds); a job
        that fits without evictions is not a preemptor. ``accept``: a last say on the
        chosen set before it is claimed (reclaim's per-queue budgets).
        """
        spec = job.spec
        sid = self.ws.shape_id(TaskShape.of(spec))
        tasks, topo = spec.tasks, spec.topology
        self.mode = mode
        if self._fits_without(sid, tasks, topo, ()):
            return None
        cost = {v.job_id: lost_gpu_seconds(v, self.now) for v in pool}
        ranked = sorted(pool, key=lambda v: (cost[v.job_id], v.priority_rank, v.job_id))
        if tasks == 1 or topo == "node":
            chosen = self._on_one_node(sid, tasks, ranked, cost)
        else:
            chosen = self._anywhere(sid, tasks, topo, ranked, cost)
        if chosen is None or (accept is not None and not accept(chosen)):
            return None
        undo = [u for v in chosen for u in self.ws.give(self.footprint(v))]
        if place_gang(self.ws, sid, tasks, topo, mode) is None:
            self.ws.undo(undo)
            return None
        return sorted(chosen, key=lambda v: v.job_id)

    def _on_one_node(
        self, sid: int, tasks: int, ranked: list[RunningJob], cost: dict[str, float]
    ) -> list[RunningJob] | None:
        """Per node: evict its cheapest gangs until the job fits there, drop the unneeded; keep the cheapest node."""
        ws = self.ws
        on_node: dict[int, list[RunningJob]] = {}
        for v in ranked:
            for idx in dict.fromkeys(part[0] for part in self.footprint(v)):
                on_node.setdefault(idx, []).append(v)
        best: tuple[float, int, int] | None = None
        best_set: list[RunningJob] = []
        for idx, victims in on_node.items():
            chosen: list[RunningJob] = []
            for v in victims:
                chosen.append(v)
                if self._fits_here(idx, sid, tasks, chosen):
                    break
            else:
                continue
            for v in sorted(chosen, key=lambda v: (-cost[v.job_id], v.job_id)):
                rest = [c for c in chosen if c is not v]
                if rest and self._fits_here(idx, sid, tasks, rest):
                    chosen = rest
            key = (sum(cost[v.job_id] for v in chosen), len(chosen), ws.nodes[idx].prio)
            if best is None or key < best:
                best, best_set = key, chosen
        return best_set if best is not None else None

    def _fits_here(self, idx: int, sid: int, tasks: int, victims: Sequence[RunningJob]) -> bool:
        """Would ``tasks`` fit on node ``idx`` once these gangs left? Computed aside, nothing moves."""
        n = self.ws.nodes[idx]
        if n.slack is not None and self.mode != NOW:
            return False  # held for the reservation: evicting here would only feed it
        free, cpu, mem, mig = list(n.free), n.cpu, n.mem, list(n.mig)
        for v in victims:
            for at, gpus, c, m, _ in self.footprint(v):
                if at != idx:
                    continue
                for g, bit, milli in gpus:
                    if not n.type.usable[g]:
                        continue
                    if bit:
                        mig[g] |= bit
                    elif n.type.mig[g] is None:
                        free[g] = min(MILLI, free[g] + milli)
                cpu += c
                mem += m
        return self.ws.cap(self.ws.class_of(n.type, free, cpu, mem, mig, n.tags), sid) >= tasks

    def _anywhere(
        self, sid: int, tasks: int, topo: str, ranked: list[RunningJob], cost: dict[str, float]
    ) -> list[RunningJob] | None:
        """1. Cheapest first, the shortest prefix that frees the shape (binary search:
           evicting more never frees less).
        2. Keep only the gangs on the nodes the job would land on; then drop every
           one that is not needed, most expensive first.
        3. A single gang cheaper than that set (or as cheap, being one) wins.
        """
        if not self._fits_without(sid, tasks, topo, ranked):
            return None
        lo, hi = 1, len(ranked)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._fits_without(sid, tasks, topo, ranked[:mid]):
                hi = mid
            else:
                lo = mid + 1
        chosen = self._touching_landing(sid, tasks, topo, ranked[:lo])
        for v in sorted(chosen, key=lambda v: (-cost[v.job_id], v.job_id)):
            rest = [c for c in chosen if c is not v]
            if rest and self._fits_without(sid, tasks, topo, rest):
                chosen = rest
        total = sum(cost[v.job_id] for v in chosen)
        for v in ranked[:SINGLE_VICTIM_PROBES]:
            if (cost[v.job_id], 1) >= (total, len(chosen)):
                break
            if self._fits_without(sid, tasks, topo, [v]):
                return [v]
        return chosen

    def _touching_landing(self, sid: int, tasks: int, topo: str, victims: list[RunningJob]) -> list[RunningJob]:
        """The victims on the nodes where the job lands once all of them are gone (the others free nothing it uses)."""
        ws = self.ws
        undo = [u for v in victims for u in ws.give(self.footprint(v))]
        fit = place_gang(ws, sid, tasks, topo, self.mode)
        landing = set() if fit is None else {idx for idx, _ in fit.tasks}
        if fit is not None:
            ws.undo(fit.undo)
        ws.undo(undo)
        near = [v for v in victims if any(part[0] in landing for part in self.footprint(v))]
        return near if near and self._fits_without(sid, tasks, topo, near) else victims
