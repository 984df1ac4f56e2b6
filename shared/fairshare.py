"""Fair share: divide GPUs down a tree of queues. Pure: no I/O, no clock.

``divide`` is the one place that says how many GPUs each queue is entitled to now.
The quota service shows it, the scheduler orders queues and asks for reclaim with
it; both call the same function on the same folded log, so they agree.

At every level of the tree the parent's amount is split among its children:

1. each child first gets its guarantee, capped by its demand (if the guarantees
   do not fit, they shrink in proportion);
2. the rest is water-filled by weight among children that still want more
   (max-min fair: a child never gets more than it wants, and what it leaves is
   shared again), each capped by its limit;
3. the weight used in step 2 is lowered for a child with a high time-decayed
   usage relative to its share (Slurm's fair-share factor 2^(-usage/share)), so
   with equal weights the queue that used more gets less of what is over quota.

Multi-resource: demand and allocation are counted by dominant share (DRF,
Ghodsi et al. 2011), in GPU-equivalents: a job's largest share of the cluster's
GPUs, CPU or memory, times the cluster's GPUs (``dominant_gpus``). A job asking
for GPUs and no more than their share of CPU and memory counts its GPUs; one
asking 1 GPU and half the cluster's CPU counts half the GPUs. Guarantees, limits
and entitlements are in the same unit. Usage (the decay of step 3) stays in
GPU-seconds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from shared.model import MILLI, JobSpec, QueueSpec

EPS = 1e-9
ROOT = ""


def parent_of(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ROOT


def children(paths: list[str] | set[str] | Mapping[str, object]) -> dict[str, list[str]]:
    """Parent path -> sorted child paths; the root is ''. Missing intermediate queues are implied."""
    all_paths = set(paths)
    for p in list(all_paths):
        while "." in p:
            p = parent_of(p)
            all_paths.add(p)
    out: dict[str, list[str]] = {}
    for p in sorted(all_paths):
        out.setdefault(parent_of(p), []).append(p)
    return out


def leaves(queues: Mapping[str, object]) -> list[str]:
    tree = children(queues)
    return sorted(p for p in queues if p not in tree)


@dataclass(frozen=True)
class Ratios:
    """The cluster's CPU and memory per GPU: how dominant shares convert to GPU-equivalents (0: not counted)."""

    cpu_milli: float = 0.0
    memory_mib: float = 0.0

    @staticmethod
    @functools.lru_cache(maxsize=64)  # one object per cluster shape: a job's cached share then checks identity
    def of(gpus: float, cpu_milli: float, memory_mib: float) -> "Ratios":
        return Ratios(cpu_milli / gpus, memory_mib / gpus) if gpus > 0 else Ratios()


GPUS_ONLY = Ratios.of(0, 0, 0)  # a share in GPUs alone (CPU and memory not counted), one object: see Ratios.of


def dominant_gpus(gpus: float, cpu_milli: float, memory_mib: float, r: Ratios) -> float:
    """A demand in GPU-equivalents: its largest share of any resource, times the cluster's GPUs."""
    return max(gpus, cpu_milli / r.cpu_milli if r.cpu_milli > 0 else 0.0,
               memory_mib / r.memory_mib if r.memory_mib > 0 else 0.0)


def job_share(spec: JobSpec, r: Ratios) -> float:
    """A job's demand, all its tasks, in GPU-equivalents; a MIG slice counts its compute sevenths (3g.40gb: 3/7)."""
    res, n = spec.resources, spec.tasks
    gpus = spec.gpu_milli / MILLI if not spec.gpu.mig else (res.gpus or 1) * int(spec.gpu.mig.split("g.")[0]) / 7
    return dominant_gpus(gpus * n, res.cpu_milli * n, res.memory_mib * n, r)


@dataclass(frozen=True)
class Division:
    entitlement: dict[str, float]  # every queue, parents included
    demand: dict[str, float]  # capped by limits, summed up the tree


def usage_factor(usage: float, total_usage: float, weight: float, total_weight: float) -> float:
    """Slurm's fair-share factor 2^(-U/S): 1 for no usage, 0.5 when usage equals the share."""
    if total_usage <= EPS or total_weight <= EPS:
        return 1.0
    return 2.0 ** (-(usage / total_usage) / (weight / total_weight))


def water_fill(amount: float, wants: Mapping[str, float], weights: Mapping[str, float]) -> dict[str, float]:
    """Split ``amount`` by weight, never giving anyone more than it wants; leftovers are shared again."""
    got = {k: 0.0 for k in wants}
    active = {k for k, w in wants.items() if w > EPS}
    left = amount
    while left > EPS and active:
        total_w = sum(weights[k] for k in active)
        # the child that saturates first at this rate bounds the round
        rate = min(left / total_w, min((wants[k] - got[k]) / weights[k] for k in active))
        for k in sorted(active):
            give = rate * weights[k]
            got[k] += give
            left -= give
        active = {k for k in active if wants[k] - got[k] > EPS}
    return got


def divide(
    capacity: float,
    queues: Mapping[str, QueueSpec],
    demand: Mapping[str, float],
    usage: Mapping[str, float] | None = None,
) -> Division:
    """Entitlement of every queue for ``capacity`` GPUs; ``demand`` and ``usage`` are per leaf."""
    usage = usage or {}
    tree = children(queues)
    spec = {p: queues.get(p, QueueSpec()) for ps in tree.values() for p in ps}

    def limit(p: str) -> float:
        lim = spec[p].limit
        return math.inf if lim is None else lim.gpus

    want: dict[str, float] = {}
    used: dict[str, float] = {}

    def fold_up(p: str) -> None:
        kids = tree.get(p, [])
        for k in kids:
            fold_up(k)
        raw = sum(want[k] for k in kids) if kids else demand.get(p, 0.0)
        want[p] = min(raw, limit(p)) if p != ROOT else raw
        used[p] = sum(used[k] for k in kids) if kids else usage.get(p, 0.0)

    fold_up(ROOT)
    ent: dict[str, float] = {ROOT: min(capacity, want[ROOT])}  # idle capacity is lent, not entitled

    def split(p: str) -> None:
        kids = tree.get(p, [])
        if not kids:
            return
        amount = ent[p]
        base = {k: min(spec[k].guaranteed.gpus, want[k]) for k in kids}
        total_base = sum(base.values())
        if total_base > amount + EPS:  # guarantees oversubscribed for this capacity: shrink in proportion
            base = {k: amount * b / total_base for k, b in base.items()}
        rest = max(0.0, amount - sum(base.values()))
        total_used = sum(used[k] for k in kids)
        total_w = sum(spec[k].weight for k in kids)
        weights = {k: spec[k].weight * usage_factor(used[k], total_used, spec[k].weight, total_w) for k in kids}
        extra = water_fill(rest, {k: want[k] - base[k] for k in kids}, {k: max(w, EPS) for k, w in weights.items()})
        for k in kids:
            ent[k] = base[k] + extra[k]
            split(k)

    split(ROOT)
    ent.pop(ROOT, None)
    return Division(entitlement=ent, demand={k: v for k, v in want.items() if k != ROOT})


def decay(value: float, dt: float, half_life: float) -> float:
    return value * 2.0 ** (-dt / half_life) if half_life > 0 else value


def accrue(value: float, gpus: float, dt: float, half_life: float) -> float:
    """Decayed GPU-seconds after ``dt`` seconds of holding ``gpus``: old usage fades, new usage adds."""
    if dt <= 0:
        return value
    if half_life <= 0:
        return value + gpus * dt
    k = math.log(2) / half_life
    return decay(value, dt, half_life) - gpus * math.expm1(-k * dt) / k


def jain_index(values: list[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one takes all."""
    if not values or sum(values) == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def reclaim_requests(
    queues: Mapping[str, QueueSpec], allocated: Mapping[str, float], pending: Mapping[str, float],
    entitlement: Mapping[str, float], smallest_waiting: Mapping[str, float] | None = None,
    tolerance: float = 0.05,
) -> list[tuple[str, float]]:
    """Queues below their guarantee with work waiting, and how many GPUs they are owed back.

    A queue never asks for more than brings it to min(guarantee, entitlement): a
    reclaimer is never lifted above what its siblings are held to. Nor does it ask
    for less than its smallest waiting job needs: evicting for a deficit no job of
    its can use would only churn, and a deficit within ``tolerance`` of the guarantee
    is left to ordinary churn (jobs ending) to close.
    """
    smallest_waiting = smallest_waiting or {}
    out = []
    for q in leaves(queues):
        have, waiting = allocated.get(q, 0.0), pending.get(q, 0.0)
        target = min(queues[q].guaranteed.gpus, entitlement.get(q, 0.0), have + waiting)
        owed = target - have
        floor = max(smallest_waiting.get(q, 0.0), tolerance * queues[q].guaranteed.gpus)
        if waiting > EPS and owed > EPS and owed >= floor - EPS:
            out.append((q, owed))
    return out
