"""One scheduling cycle: snapshot -> ordered actions (allocate, backfill, preempt, reclaim) -> plan.

Pure: no I/O, no clock (``now`` is passed in), deterministic for a given
snapshot and policy seed. Every tentative operation runs on the cycle's working
copy of free capacity and is kept or undone as a unit per gang.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Mapping, Sequence

from services.scheduler.fragmentation import TypicalShape, typical_shapes
from services.scheduler.gates import Gates
from services.scheduler.gang import GangFit, capacity, place_gang
from services.scheduler.placement import NodeScorer
from services.scheduler.plan import Placement, Plan, Policy, Preemption, ReclaimRequest, Reservation
from services.scheduler.preemption import VictimSearch, lost_gpu_seconds
from services.scheduler.reasons import explain, held_back, reason_class
from services.scheduler.shapes import TaskShape
from services.scheduler.snapshot import PendingJob, RunningJob, Snapshot
from services.scheduler.workstate import LONG, NOW, Footprint, WorkState
from shared.events import GpuShare, TaskPlacement
from shared.fairshare import EPS, job_share, parent_of
from shared.model import MILLI, JobSpec

__all__ = [
    "Cycle", "Placement", "Plan", "Policy", "Preemption", "ReclaimRequest", "Reservation", "reclaim", "run_cycle",
]


TypicalKey = tuple[int, int, int, tuple[str, ...]]


def typical_key(s: TaskShape) -> TypicalKey | None:
    """The (CPU, milli, GPUs, models) a task shape counts as in FGD's target workload; None for a MIG slice: slices
    are not whole-GPU capacity, and FGD does not model them."""
    return None if s.mig else (s.cpu, s.milli, s.gpus, s.models if s.gpus else ())


def typical_from_snapshot(
    snapshot: Snapshot, shapes: Mapping[str, TaskShape] | None = None
) -> tuple[TypicalShape, ...]:
    """FGD's target workload from the task shapes now pending and running (each task counts once)."""
    shapes = shapes or {}
    counts: dict[TypicalKey, int] = {}
    for job in (*snapshot.pending, *snapshot.running):
        if (key := typical_key(shapes.get(job.job_id) or TaskShape.of(job.spec))) is not None:
            counts[key] = counts.get(key, 0) + job.spec.tasks
    return typical_shapes(counts)


def job_order(jobs: Sequence[PendingJob]) -> list[PendingJob]:
    return sorted(jobs, key=lambda j: (-j.priority_rank, j.submitted_at, j.job_id))


class Cycle:
    """The state of one ``run_cycle`` call; nothing outlives it."""

    def __init__(self, snapshot: Snapshot, policy: Policy, now: float) -> None:
        self.snap, self.policy, self.now = snapshot, policy, now
        shapes = {j.job_id: TaskShape.of(j.spec) for j in snapshot.pending}
        typical = policy.typical if policy.typical is not None else typical_from_snapshot(snapshot, shapes)
        self.scorer = NodeScorer(policy.name, typical, policy.seed)
        self.ws = WorkState(snapshot.nodes, self.scorer, policy.seed)
        self._sids = {job_id: self.ws.shape_id(s) for job_id, s in shapes.items()}
        self.ws.note_running(snapshot.running)
        self.gates = Gates(snapshot)
        self.cancellations = {j.job_id: why for j in snapshot.pending if (why := self.gates.never(j)) is not None}
        self._empty: WorkState | None = None
        self.placements: dict[str, Placement] = {}
        self.preemptions: list[Preemption] = []
        self.unschedulable: dict[str, str] = {}
        self.reservation: Reservation | None = None
        self.evicted: set[str] = set()
        self.preemptors: set[str] = set()  # waiting jobs that got victims from priority preemption this cycle
        self.planned = False  # allocate ran: self.waiting holds every job left waiting
        self.waiting: list[tuple[PendingJob, str]] = []  # not placed, in the order tried, with what they may use
        self.ends: list[tuple[float, str, Footprint]] = []  # jobs placed this cycle: when they free up
        self._shares: dict[int, float] = {}  # id(spec) -> share, for specs the snapshot holds
        self.allocated: dict[str, float] = {}  # per queue, in GPU-equivalents of the dominant resource
        self.held: dict[str, float] = {}  # per queue and ancestor, against limits: running, placed, promised
        for r in snapshot.running:
            self.allocated[r.queue] = self.allocated.get(r.queue, 0.0) + self.share(r.spec)
            self.hold(r.queue, self.share(r.spec))
        self._failed: dict[tuple[int, str, str], int] = {}  # (shape, topology, mode) -> fewest tasks that failed
        self._ever: dict[tuple[int, str, int], bool] = {}
        self._reasons: dict[tuple[int, str, int, str], str] = {}

    @property
    def empty(self) -> WorkState:
        """The cluster as if nothing ran: to tell "never" from "not now"."""
        if self._empty is None:
            self._empty = WorkState(self.snap.nodes, self.scorer, self.policy.seed, empty=True, book=self.ws.book)
        return self._empty

    # --- order --------------------------------------------------------------------------

    def order(self) -> Iterator[PendingJob]:
        """Queues furthest below their entitlement first (by name without entitlements); then priority, then age.
        A job that would take its queue above its floor (what reclaim lifts a queue to: its guarantee capped by its
        entitlement) borrows, and comes after every job that would not, as Kueue admits workloads within their
        nominal quota before those that borrow: placed first, it took the GPUs a queue below its guarantee waited
        for, reclaim evicted it for them, and it came back first again (six evictions in two seconds, until the
        thrashing guard stopped reclaim)."""
        by_queue: dict[str, list[PendingJob]] = {}
        for j in job_order(self.snap.pending):
            if j.job_id in self.cancellations:
                continue
            by_queue.setdefault(j.queue, []).append(j)
        ent = self.snap.entitlements
        if ent is None:
            for q in sorted(by_queue):
                yield from by_queue[q]
            return

        def share(q: str) -> float:
            e = ent.get(q, 0.0)
            return self.allocated.get(q, 0.0) / e if e > 0 else math.inf

        def by_share(groups: dict[str, list[PendingJob]], lending: bool = False) -> Iterator[PendingJob]:
            """Each queue's jobs in turn, the queue furthest below its entitlement next (as jobs are placed);
            ``lending``: a job that would borrow goes to ``borrowing`` instead, and so does all a queue has left
            once it is at its floor (what a cycle places only adds: no share is computed for those)."""
            heads = {q: 0 for q in groups}
            heap = [(share(q), q) for q in groups]
            heapq.heapify(heap)
            while heap:
                _, q = heapq.heappop(heap)
                jobs, i = groups[q], heads[q]
                heads[q] = i + 1
                if lending:
                    have, floor = self.allocated.get(q, 0.0), floors[q]
                    if have >= floor - EPS:
                        borrowing.setdefault(q, []).extend(jobs[i:])
                        continue
                    if have + self.share(jobs[i].spec) > floor + EPS:
                        borrowing.setdefault(q, []).append(jobs[i])
                    else:
                        yield jobs[i]
                else:
                    yield jobs[i]
                if i + 1 < len(jobs):
                    heapq.heappush(heap, (share(q), q))

        floors = {q: self._floor(q) or 0.0 for q in by_queue}
        borrowing: dict[str, list[PendingJob]] = {}
        yield from by_share(by_queue, lending=True)
        yield from by_share(borrowing)

    # --- placing ------------------------------------------------------------------------

    def sid(self, job: PendingJob) -> int:
        return self._sids[job.job_id]

    # --- limits ---------------------------------------------------------------------------

    def hold(self, queue: str, amount: float) -> None:
        while queue:
            self.held[queue] = self.held.get(queue, 0.0) + amount
            queue = parent_of(queue)

    def gated(self, job: PendingJob) -> str | None:
        """Why the job waits whatever the free capacity: a gate (dependency, array throttle, singleton), then its
        queue's limit. Such a job takes no reservation and gets no evictions made for it."""
        return self.gates.blocked(job) or self.over_limit(job)

    def over_limit(self, job: PendingJob) -> str | None:
        """Why the job would take its queue or an ancestor above its limit (None: it would not).

        Limits count GPU-equivalents, as fair share does (``job_share``): a job's GPUs, or more where it asks
        for a larger share of the cluster's CPU or memory. A preempting job still holds its share: it has not left.
        """
        limits = self.snap.limits
        if not limits:
            return None
        need, q = self.share(job.spec), job.queue
        while q:
            limit, held = limits.get(q), self.held.get(q, 0.0)
            if limit is not None and held + need > limit + EPS:
                unit = f"GPU{'' if limit == 1 else 's'}"
                if need > limit + EPS:
                    return f"needs {need:g} GPUs, above the limit of queue {q} ({limit:g} {unit}): it can never start"
                return f"queue {q} at its limit of {limit:g} {unit} (it holds {held:g}; this job needs {need:g})"
            q = parent_of(q)
        return None

    def ever_fits(self, job: PendingJob) -> bool:
        """Would the gang fit if nothing else ran? If not, no reservation or eviction can help it."""
        key = (self.sid(job), job.spec.topology, job.spec.tasks)
        ok = self._ever.get(key)
        if ok is None:
            ok = self._ever[key] = capacity(self.empty, key[0]).fits(job.spec.tasks, job.spec.topology)
        return ok

    def try_place(self, job: PendingJob, mode: str) -> GangFit | None:
        spec = job.spec
        sid = self.sid(job)
        # Capacity only shrinks while placing, so a shape that failed with n tasks fails with n or more.
        if self._failed.get((sid, spec.topology, NOW), 1 << 30) <= spec.tasks:
            return None
        if mode == LONG and self._failed.get((sid, spec.topology, LONG), 1 << 30) <= spec.tasks:
            return None
        fit = place_gang(self.ws, sid, spec.tasks, spec.topology, mode)
        if fit is None:
            key = (sid, spec.topology, mode)
            self._failed[key] = min(self._failed.get(key, 1 << 30), spec.tasks)
        return fit

    def commit(self, job: PendingJob, fit: GangFit) -> None:
        shape = self.ws.shapes[self.sid(job)]
        tasks, fp = [], []
        for t, (idx, pick) in enumerate(fit.tasks):
            node = self.ws.nodes[idx]
            shares = []
            for g, bit in pick:
                if bit:
                    uuid = node.slice_uuids[g][bit.bit_length() - 1]
                    shares.append(GpuShare.model_construct(uuid=uuid, milli=MILLI, mig_profile=shape.mig))
                else:
                    uuid = node.gpu_uuids[g]
                    shares.append(GpuShare.model_construct(uuid=uuid, milli=shape.milli, mig_profile=None))
            tasks.append(
                TaskPlacement.model_construct(
                    task=t, node_id=node.node_id, gpus=tuple(shares), cpu_milli=shape.cpu, memory_mib=shape.mem
                )
            )
            held = tuple((g, bit, MILLI if bit else shape.milli) for g, bit in pick)
            fp.append((idx, held, shape.cpu, shape.mem, None))
        self.placements[job.job_id] = Placement(job.job_id, tuple(tasks), fit.spread, self.policy.name)
        self.gates.placed(job)
        self.allocated[job.queue] = self.allocated.get(job.queue, 0.0) + self.share(job.spec)
        self.hold(job.queue, self.share(job.spec))
        limit = job.spec.time_limit_s
        self.ends.append((math.inf if limit is None else self.now + limit, job.job_id, tuple(fp)))

    def reason(self, job: PendingJob, mode: str) -> str:
        spec = job.spec
        sid = self.sid(job)
        key = (sid, spec.topology, spec.tasks, mode)
        if key not in self._reasons:
            self._reasons[key] = explain(self.ws, self.empty, sid, spec.tasks, spec.topology, self.snap.nodes, mode)
        return self._reasons[key]

    # --- actions ------------------------------------------------------------------------

    def allocate(self, jobs: Iterator[PendingJob]) -> None:
        """Place jobs in order until one is blocked that can ever fit: it takes a reservation, and backfill goes on."""
        self.planned = True
        for job in jobs:
            if (why := self.gated(job)) is not None:  # it waits for a gate or its queue: no reservation
                self.unschedulable[job.job_id] = why
                continue
            fit = self.try_place(job, NOW)
            if fit is not None:
                self.commit(job, fit)
                continue
            self.waiting.append((job, NOW))
            reason = self.reason(job, NOW)
            res = self.reserve(job) if self.policy.backfill else None
            if res is not None:
                self.reservation = res
                reason += f"; next in line: held to start on {', '.join(res.nodes)} {_when(res.start, self.now)}"
            self.unschedulable[job.job_id] = reason
            if res is not None:
                return

    def backfill(self, jobs: Iterator[PendingJob]) -> None:
        """Later jobs start only if they cannot delay the reservation.

        A job whose time limit ends before the reservation starts may use any free
        capacity (NOW); any other job sees only what the reservation leaves (LONG).
        """
        res = self.reservation
        if res is None:
            return
        for job in jobs:
            if (why := self.gated(job)) is not None:
                self.unschedulable[job.job_id] = why
                continue
            limit = job.spec.time_limit_s
            mode = NOW if limit is not None and self.now + limit <= res.start else LONG
            fit = self.try_place(job, mode)
            if fit is not None:
                self.commit(job, fit)
                continue
            self.waiting.append((job, mode))
            if mode == LONG and self._fits_now(job):
                self.unschedulable[job.job_id] = held_back(res.job_id, res.start, self.now, res.nodes, limit)
            else:
                self.unschedulable[job.job_id] = self.reason(job, mode)

    def _fits_now(self, job: PendingJob) -> bool:
        spec = job.spec
        sid = self.sid(job)
        if self._failed.get((sid, spec.topology, NOW), 1 << 30) <= spec.tasks:
            return False
        return capacity(self.ws, sid, NOW).fits(spec.tasks, spec.topology)

    def _releases(self) -> list[tuple[float, str, Footprint]]:
        out = list(self.ends)
        for r in self.snap.running:
            out.append((r.expected_end(self.now), r.job_id, self.ws.footprint(r)))
        out.sort(key=lambda e: (e[0], e[1]))
        return out

    def reserve(self, job: PendingJob) -> Reservation | None:
        """Where and when the blocked job will fit if running jobs end on their time limits.

        1. Skip it if it can never fit (it would hold capacity for nothing).
        2. Find the fewest earliest-ending jobs whose end lets it fit (binary search:
           capacity grows with every release).
        3. Place it there in simulation; what is left on its nodes is the slack
           that jobs outlasting the reservation may still use. Undo everything.
        """
        spec = job.spec
        ws = self.ws
        sid = self.sid(job)
        if not self.ever_fits(job):
            return None
        releases = self._releases()

        def fits_after(k: int) -> bool:
            undo = [u for _, _, fp in releases[:k] for u in ws.give(fp)]
            ok = capacity(ws, sid).fits(spec.tasks, spec.topology)
            ws.undo(undo)
            return ok

        lo, hi = 1, len(releases)
        if hi == 0 or not fits_after(hi):
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if fits_after(mid):
                hi = mid
            else:
                lo = mid + 1
        undo = [u for _, _, fp in releases[:lo] for u in ws.give(fp)]
        fit = place_gang(ws, sid, spec.tasks, spec.topology, NOW)
        slack = {}
        if fit is not None:
            for idx, _ in fit.tasks:
                n = ws.nodes[idx]
                slack[idx] = (list(n.free), n.cpu, n.mem, list(n.mig))
            ws.undo(fit.undo)
        ws.undo(undo)
        if fit is None:
            return None
        ws.hold(slack)
        names = tuple(sorted({ws.nodes[i].node_id for i in slack}, key=lambda n: ws.nodes[ws.index_of[n]].prio))
        return Reservation(job.job_id, releases[lo - 1][0], names)

    def preempt(self) -> None:
        """Waiting jobs, in order, may evict strictly lower-priority running gangs (preemptible ones only).

        Victims are grouped by (queue, rank) once, so finding a job's candidates
        costs a few lookups; a shape whose search failed is not searched again
        (evictions only ever shrink the pool).
        """
        if not self.policy.preempt:
            return
        groups: dict[tuple[str, int], list[RunningJob]] = {}
        for r in self.snap.running:
            if not r.preempting:
                groups.setdefault((r.queue, r.priority_rank), []).append(r)
        queues = sorted({q for q, _ in groups})
        search = VictimSearch(self.ws, self.now)
        failed: set[tuple] = set()
        tries = 0
        for job, mode in self.waiting:
            below = min(job.priority_rank, self.policy.preemptible_below)
            scope = queues if self.policy.cross_queue_preemption else [job.queue]
            keys = [(q, rank) for q in scope for rank in range(below) if (q, rank) in groups]
            scope_key = "*" if self.policy.cross_queue_preemption else job.queue
            memo = (self.sid(job), job.spec.topology, job.spec.tasks, below, scope_key)
            if not keys or memo in failed or not self.ever_fits(job) or self.gated(job) is not None:
                continue  # (placements since it was tried may have filled its queue to the limit)
            if tries >= self.policy.max_preemptors:
                break
            tries += 1
            pool = [r for k in keys for r in groups[k]
                    if r.job_id not in self.evicted and not self.policy.protected(r, self.now)]
            victims = search.cheapest(job, pool, mode) if pool else None
            if victims is None:
                failed.add(memo)
                continue
            self.preemptors.add(job.job_id)
            self.hold(job.queue, self.share(job.spec))  # room is made for it: its queue's limit counts it
            for v in victims:
                self.evicted.add(v.job_id)
                self.preemptions.append(
                    Preemption(v.job_id, f"preempted by {job.job_id} ({job.spec.priority} over {v.spec.priority})",
                               self.policy.grace_s, for_job=job.job_id)
                )
            names = ", ".join(v.job_id for v in victims)
            self.unschedulable[job.job_id] = f"waiting for preemption of {names} (grace {self.policy.grace_s} s)"

    def share(self, spec: JobSpec) -> float:
        """A job's size for fair share: GPU-equivalents of its dominant resource (once per spec and cycle: the
        snapshot holds every spec while the cycle runs, so its id names it)."""
        found = self._shares.get(id(spec))
        if found is None:
            found = self._shares[id(spec)] = job_share(spec, self.snap.ratios)
        return found

    def reclaim(self, requests: Sequence[ReclaimRequest | tuple[str, float]]) -> None:
        """Free GPU-equivalents for queues below their entitlement by evicting other queues' gangs.

        Victims come from queues above their floor (``_floor``: the guarantee, capped by
        the entitlement; any other queue without entitlements), lowest queue priority
        first, never pushing a queue, nor a parent of it that the owed queue is not under,
        below its floor: borrowed GPUs come back whole gangs at a time, even where a gang
        takes its queue below its fair share. For a queue with jobs waiting in this
        cycle, reclaim is for those jobs: per job, in order, the cheapest gangs whose
        eviction lets it fit (as priority preemption), widening from the lowest-priority
        queues; evictions that would not let any of its jobs fit are not made (they
        would only churn).
        Without waiting jobs in view (``reclaim()`` alone), the cheapest gangs up to
        the amount owed.
        """
        # jobs already preempting are on their way out for whoever waits: their share counts as freed,
        # and their queues no longer hold it (or each cycle would evict again until grace ends)
        leaving = sum(self.share(r.spec) for r in self.snap.running if r.preempting)
        staying = dict(self.allocated)
        for r in self.snap.running:
            if r.preempting or r.job_id in self.evicted:  # evicted by priority preemption this cycle: leaving too
                staying[r.queue] = staying.get(r.queue, 0.0) - self.share(r.spec)
        search: VictimSearch | None = None
        for req in (r if isinstance(r, ReclaimRequest) else ReclaimRequest(*r) for r in requests):
            need = req.gpus
            credit = min(leaving, need)
            leaving, need = leaving - credit, need - credit
            if need <= 0:
                continue
            pool = [
                r for r in self.snap.running
                if not r.preempting and r.job_id not in self.evicted and r.queue != req.queue
                and ((floor := self._floor(r.queue)) is None or staying.get(r.queue, 0.0) > floor + EPS)
                and not self.policy.protected(r, self.now)
            ]
            qprio = self.policy.queue_priority
            pool.sort(key=lambda r: (qprio.get(r.queue, 0), r.priority_rank, lost_gpu_seconds(r, self.now), r.job_id))
            if not self.planned:  # reclaim() alone: no waiting jobs in view, the cheapest gangs up to the amount
                for v in pool:
                    if need <= 0:
                        break
                    if self._within_budget([v], staying, req.queue):
                        need -= self._evict_for(req.queue, [v], staying)
                continue
            search = search or VictimSearch(self.ws, self.now)
            failed: set[tuple] = set()
            tries = 0
            for job, mode in [(j, m) for j, m in self.waiting if j.queue == req.queue]:
                size = self.share(job.spec)
                if job.job_id in self.preemptors:  # room is already being made for it
                    need -= size
                    continue
                memo = (self.sid(job), job.spec.topology, job.spec.tasks, mode)
                if need <= 1e-9 or tries >= self.policy.max_preemptors:
                    break
                if size > need + 1e-9 or not self.ever_fits(job) or self.gated(job) is not None:
                    continue  # more than the queue is owed would lift it above its share: churn back
                if memo in failed:
                    self._unreclaimable(job, req)
                    continue
                tries += 1
                victims = self._reclaim_victims(job, mode, pool, staying, search)
                if victims is None:
                    failed.add(memo)
                    self._unreclaimable(job, req)
                    continue
                self._evict_for(req.queue, victims, staying)
                self.hold(job.queue, size)
                need -= size
                names = ", ".join(v.job_id for v in victims)
                self.unschedulable[job.job_id] = (f"waiting for {names} to leave: reclaimed for queue {req.queue} "
                                                  f"(grace {self.policy.reclaim_grace_s} s)")

    def explain_guarantees(self) -> None:
        """A waiting job of a queue under its guarantee that is larger than the GPUs still owed to that queue gets
        no evictions (reclaim lifts a queue to its guarantee, never above it, as Kueue's reclaimWithinCohort):
        say so, or its reason reads as if the guarantee were ignored."""
        floors = self.snap.floors
        if floors is None:
            return
        for job, _ in self.waiting:
            floor, have = floors.get(job.queue, 0.0), self.allocated.get(job.queue, 0.0)
            if have >= floor - EPS or (size := self.share(job.spec)) <= floor - have + EPS:
                continue  # the queue is owed nothing, or this job fits what it is owed
            why = self.unschedulable.get(job.job_id)
            if why is None or "; its queue " in why or reason_class(why) in ("evictions", "never fits"):
                continue  # told why reclaim found no victims, room made by preemption or reclaim, or it fits nowhere
            self.unschedulable[job.job_id] = (
                f"{why}; its queue {job.queue} holds {have:g} of the {floor:g} GPUs guaranteed to it, and reclaim "
                f"takes back at most the {floor - have:g} that lift it to that, not this job's {size:g}")

    def _unreclaimable(self, job: PendingJob, req: ReclaimRequest) -> None:
        """Say why a job of a queue owed GPUs still waits: else its reason reads as if no guarantee were owed."""
        why = self.unschedulable.get(job.job_id)
        if why is not None:
            self.unschedulable[job.job_id] = (
                f"{why}; its queue {req.queue} is owed {req.gpus:g} GPUs, but no running job may be evicted for it "
                f"(each would take its own queue{self._floor_said}, or is protected)")

    def _reclaim_victims(self, job: PendingJob, mode: str, pool: Sequence[RunningJob], staying: dict[str, float],
                         search: VictimSearch) -> list[RunningJob] | None:
        """The cheapest gangs whose eviction lets ``job`` fit, from the lowest-priority queues first, within
        every victim queue's budget above its floor (a set over budget is searched again without the
        gangs of the queues it would overdraw)."""
        qprio = self.policy.queue_priority
        for tier in sorted({qprio.get(v.queue, 0) for v in pool}):
            left = [v for v in pool if v.job_id not in self.evicted and qprio.get(v.queue, 0) <= tier
                    and self._within_budget([v], staying, job.queue)]
            for _ in range(4):
                refused: list[RunningJob] = []

                def accept(vs: Sequence[RunningJob]) -> bool:
                    ok = self._within_budget(vs, staying, job.queue)
                    if not ok:
                        refused.extend(vs)
                    return ok

                victims = search.cheapest(job, left, mode, accept=accept)
                if victims:
                    return victims
                if not refused:
                    break
                over = {q for q in {v.queue for v in refused} if not self._within_budget(
                    [v for v in refused if v.queue == q], staying, job.queue)}
                drop = {v.job_id for v in refused if v.queue in over}
                left = [v for v in left if v.job_id not in drop]
        return None

    def _floor(self, queue: str) -> float | None:
        """What reclaim leaves a queue (any level) at least: the snapshot's floor (its guarantee, capped by its
        entitlement), else a leaf's entitlement; None: nothing (no entitlements)."""
        if self.snap.floors is not None:
            return self.snap.floors.get(queue, 0.0)
        ent = self.snap.entitlements
        return None if ent is None else ent.get(queue, 0.0)

    @property
    def _floor_said(self) -> str:
        return (" or a parent queue below its guarantee" if self.snap.floors is not None
                else " below its entitlement")

    def _within_budget(self, victims: Sequence[RunningJob], staying: dict[str, float], for_queue: str) -> bool:
        """Evicting these for ``for_queue`` leaves every victim's queue, and every parent of it that ``for_queue``
        is not under (a move between siblings leaves their parent as it was), at or above its floor."""
        taken: dict[str, float] = {}
        for v in victims:
            gpus = self.share(v.spec)
            q = v.queue
            while q and not (for_queue == q or for_queue.startswith(q + ".")):
                taken[q] = taken.get(q, 0.0) + gpus
                q = parent_of(q)
        for q, t in taken.items():
            floor = self._floor(q)
            if floor is not None:
                held = sum(g for held_by, g in staying.items() if held_by == q or held_by.startswith(q + "."))
                if held - t < floor - 1e-9:
                    return False
        return True

    def _evict_for(self, queue: str, victims: Sequence[RunningJob], staying: dict[str, float]) -> float:
        """Record the reclaim of these gangs for ``queue``; the GPU-equivalents freed."""
        freed = 0.0
        for v in victims:
            gpus = self.share(v.spec)
            self.evicted.add(v.job_id)
            staying[v.queue] = staying.get(v.queue, 0.0) - gpus
            self.allocated[v.queue] = self.allocated.get(v.queue, 0.0) - gpus
            freed += gpus
            self.preemptions.append(
                Preemption(v.job_id, f"reclaimed for queue {queue} (queue {v.queue} is over its share)",
                           self.policy.reclaim_grace_s, for_queue=queue)
            )
        return freed

    def plan(self) -> Plan:
        return Plan(self.policy.name, self.placements, tuple(self.preemptions), self.unschedulable, self.reservation,
                    self.cancellations)


def _when(start: float, now: float) -> str:
    return "when jobs without a time limit end there" if math.isinf(start) else f"in {max(0, int(start - now))} s"


def run_cycle(
    snapshot: Snapshot,
    policy: Policy | None = None,
    now: float = 0.0,
    reclaims: Sequence[ReclaimRequest | tuple[str, float]] = (),
) -> Plan:
    """Decide one cycle. Actions, in order:

    1. allocate: jobs in queue/priority/age order; gangs all or nothing.
    2. backfill: after the first blocked job takes a reservation, later jobs start
       only if they cannot delay it.
    3. preempt: waiting jobs evict cheaper, strictly lower-priority gangs; they are
       placed in a later cycle, once the victims are gone.
    4. reclaim: evict other queues' gangs for queues owed GPUs (fed by quota); a job too large for what its
       queue is owed is told so.

    No action takes a queue, or any of its ancestors, above its limit: a job that would
    waits with that reason, holds no reservation, and gets no evictions made for it. So does a job
    held by a gate (gates.py): a dependency not met yet, its array at its limit, singleton; a job
    whose dependency can never be met is in the plan's cancellations instead.
    """
    cycle = Cycle(snapshot, policy or Policy(), now)
    jobs = cycle.order()
    cycle.allocate(jobs)
    cycle.backfill(jobs)
    cycle.preempt()
    cycle.reclaim(reclaims)
    cycle.explain_guarantees()
    return cycle.plan()


def reclaim(
    snapshot: Snapshot,
    requests: Sequence[ReclaimRequest | tuple[str, float]],
    policy: Policy | None = None,
    now: float = 0.0,
) -> tuple[Preemption, ...]:
    """Only the reclaim action: which gangs of other queues to evict so these queues get their GPUs."""
    cycle = Cycle(snapshot, policy or Policy(), now)
    cycle.reclaim(requests)
    return tuple(cycle.preemptions)
