"""The FGD fragmentation measure (Weng et al., USENIX ATC '23): idle GPU the expected workload cannot use.

Reproduces the public simulator (see FGD_METHOD.md §2): the target workload is a
distribution of typical task shapes; a node's fragmentation is the expected idle
GPU milli that a task drawn from it could not use; a placement scores
``floor(100 * sigmoid((F_before - F_after) / 1000))``.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from shared.model import MILLI

POPULARITY_THRESHOLD = 95  # percent of tasks the kept shapes must cover


@dataclass(frozen=True, slots=True)
class TypicalShape:
    """One task shape of the expected workload: CPU, GPU milli per GPU (m), GPU count (k), accepted models."""

    cpu_milli: int
    gpu_milli: int
    gpu_count: int
    models: tuple[str, ...] = ()
    probability: float = 0.0

    def accepts(self, model: str) -> bool:
        return not self.models or model in self.models


ShapeKey = tuple[int, int, int, tuple[str, ...]]


def typical_shapes(counts: Mapping[ShapeKey, int], threshold: int = POPULARITY_THRESHOLD) -> tuple[TypicalShape, ...]:
    """The most popular shapes covering ``threshold`` % of the tasks, renormalised (GetTypicalPods).

    Order: count descending; equal counts by (cpu, m, k, spec) descending, as the
    simulator sorts them. Probabilities are computed the way it does, as
    (count / total) / (kept / total), so floats match to the last bit.
    """
    total = sum(counts.values())
    if total <= 0:
        return ()
    ranked = sorted(counts.items(), key=lambda kv: (kv[1], (kv[0][0], kv[0][1], kv[0][2], "|".join(kv[0][3]))), reverse=True)
    kept: list[tuple[ShapeKey, int]] = []
    covered = 0
    for key, n in ranked:
        kept.append((key, n))
        covered += n
        if covered * 100 >= threshold * total:
            break
    share = covered / total
    return tuple(TypicalShape(c, m, k, models, (n / total) / share) for (c, m, k, models), n in kept)


def shape_frag(t: TypicalShape, model: str, cpu_left: int, free: Sequence[int], idle: int) -> int:
    """Idle GPU milli on one node that shape ``t`` cannot use (NodeGpuShareFragAmount)."""
    m = t.gpu_milli
    if m == 0 or not t.accepts(model):
        return idle  # CPU-only shapes never use idle GPUs; a model it refuses is no access
    usable = 0
    stranded = 0
    for r in free:
        if r >= m:
            usable += 1
        else:
            stranded += r
    if usable >= t.gpu_count and cpu_left >= t.cpu_milli:
        return stranded  # Q3: only the GPUs too small for t are fragment
    return idle  # Q1/Q2/Q4: t cannot land here at all


class FragMemo:
    """F(node state) = sum_t p_t * frag(t), memoised per (model, CPU band, multiset of free milli).

    CPU only matters through which shape CPU requests it satisfies, so CPU values
    between two consecutive shape requests share one memo entry.
    """

    def __init__(self, shapes: Iterable[TypicalShape]) -> None:
        self.shapes = tuple(shapes)
        self._cpu_cuts = sorted({t.cpu_milli for t in self.shapes})
        self._memo: dict[tuple[str, int, tuple[int, ...]], float] = {}

    def __len__(self) -> int:
        return len(self._memo)

    def frag(self, model: str, cpu_left: int, free: Sequence[int]) -> float:
        key = (model, bisect_right(self._cpu_cuts, cpu_left), tuple(sorted(free)))
        f = self._memo.get(key)
        if f is None:
            idle = sum(free)
            f = 0.0
            for t in self.shapes:
                f += t.probability * shape_frag(t, model, cpu_left, free, idle)
            self._memo[key] = f
        return f


def cpu_bound_frag(t: TypicalShape, model: str, cpu_left: int, desc: Sequence[int], idle: int) -> int:
    """Idle GPU milli on one node that tasks of shape ``t`` cannot use, counting how many of them its CPU feeds.

    ``desc``: free milli per GPU, largest first. Tasks take the roomiest GPUs; the
    GPUs beyond what the CPU left (or beyond whole groups of k) are fragment.
    """
    m = t.gpu_milli
    if m == 0 or not t.accepts(model):
        return idle
    room = [r for r in desc if r >= m]
    tasks = len(room) // t.gpu_count
    if t.cpu_milli:
        tasks = min(tasks, cpu_left // t.cpu_milli)
    return idle - sum(room[: tasks * t.gpu_count])


class CpuAwareFragMemo(FragMemo):
    """F for fgd+'s tie-break: FGD's measure, except that a shape fits a node only as often as its CPU allows.

    FGD asks whether one task of each shape still fits: a node with eight idle GPUs
    and CPU left for two tasks looks unfragmented until its CPU is gone, and by then
    six GPUs are stranded. Here those six count as fragment from the start, so a
    placement that eats CPU a node's idle GPUs need scores as the fragmentation it is.
    With CPU to spare it equals FGD's measure (for one-GPU shapes exactly).

    fgd+ ranks nodes by FGD's score first and by this one only among FGD's ties: as
    the primary score it sends CPU-hungry pods to the CPU-rich nodes that the largest
    multi-GPU pods need, and loses to FGD on multi-GPU-heavy workloads.
    """

    def frag(self, model: str, cpu_left: int, free: Sequence[int]) -> float:
        desc = tuple(sorted(free, reverse=True))
        key = (model, cpu_left, desc)
        f = self._memo.get(key)
        if f is None:
            idle = sum(desc)
            f = 0.0
            for t in self.shapes:
                f += t.probability * cpu_bound_frag(t, model, cpu_left, desc, idle)
            self._memo[key] = f
        return f


def fgd_score(f_before: float, f_after: float) -> int:
    """floor(100 * sigmoid(delta / 1000)): integer on purpose, so that ties fall to the node order."""
    x = (f_before - f_after) / MILLI
    if x < -700:
        return 0
    return int((1.0 / (1.0 + math.exp(-x))) * 100)
