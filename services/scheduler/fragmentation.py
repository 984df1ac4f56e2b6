"""The FGD fragmentation measure (Weng et al., USENIX ATC '23): idle GPU the expected workload cannot use.

Reproduces the public simulator (see FGD_METHOD.md §2): the target workload is a
distribution of typical task shapes; a node's fragmentation is the expected idle
GPU milli that a task drawn from it could not use; a placement scores
``floor(100 * sigmoid((F_before - F_after) / 1000))``.
"""

from __future__ import annotations

import math
import random
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


FILL_SCENARIOS = 32  # sequences of future tasks each node is filled with
FILL_DRAWS = 64  # tasks per sequence: enough to fill an 8-GPU node with any openb mix, CPU-only tasks included
FILL_SEED = 12345  # a fixed sample: the same scenarios for every node, cycle and run


def fill_left(tasks: Sequence[TypicalShape], model: str, cpu_left: int, desc: Sequence[int]) -> int:
    """Idle GPU milli a node keeps after ``tasks`` arrived at it in turn, each taking what it fits.

    ``desc``: free milli per GPU, largest first. A task that does not fit (CPU, GPU model,
    room) is skipped; a CPU-only task takes CPU; a GPU task takes the tightest GPUs with room.
    """
    free = list(desc)
    idle = sum(free)
    for t in tasks:
        if idle == 0:
            break
        if t.cpu_milli > cpu_left:
            continue
        m = t.gpu_milli
        if m == 0:
            cpu_left -= t.cpu_milli
            continue
        if not t.accepts(model):
            continue
        room = [i for i, r in enumerate(free) if r >= m]
        if len(room) < t.gpu_count:
            continue
        for i in sorted(room, key=free.__getitem__)[: t.gpu_count]:
            free[i] -= m
        idle -= m * t.gpu_count
        cpu_left -= t.cpu_milli
    return idle


class FillFragMemo(FragMemo):
    """fgd+'s measure: half FGD's F, half the idle GPU milli a node keeps once the expected workload has filled it.

    FGD's F asks, shape by shape, whether *one* task of the shape still fits: 190 milli left
    beside a 0.81-GPU task is usable for the few shapes that small, and CPU that one task of a
    shape still has is CPU for all of them. The fill measure plays the target workload forward
    instead: ``FILL_SCENARIOS`` fixed sequences of ``FILL_DRAWS`` tasks drawn from it arrive at
    the node, each taking what it fits, and the mean idle GPU left at the end is the node's
    waste. It sees leftovers no likely task fills, GPUs the CPU left cannot feed, and tasks
    that compete for the same room. It is blind to what the node's idle GPUs are worth
    elsewhere (a whole idle node fills as well as a half-used one), which FGD's half keeps:
    ranked by the fill measure alone, fgd+ opens every 8-GPU node early and drops the big pods
    FGD places (docs/benchmarks/openb.md, issue 15's twenty-third round).
    """

    def __init__(self, shapes: Iterable[TypicalShape], scenarios: int = FILL_SCENARIOS, draws: int = FILL_DRAWS,
                 seed: int = FILL_SEED) -> None:
        super().__init__(shapes)
        rng = random.Random(seed)
        weights = [t.probability for t in self.shapes]
        self.scenarios = tuple(tuple(rng.choices(self.shapes, weights, k=draws)) for _ in range(scenarios)) \
            if sum(weights) > 0 else ()
        self._fill: dict[tuple[str, int, tuple[int, ...]], float] = {}

    def __len__(self) -> int:
        return len(self._fill)

    def frag(self, model: str, cpu_left: int, free: Sequence[int]) -> float:
        desc = tuple(sorted(free, reverse=True))
        key = (model, cpu_left, desc)
        f = self._fill.get(key)
        if f is None:
            left = sum(fill_left(s, model, cpu_left, desc) for s in self.scenarios) / len(self.scenarios) \
                if self.scenarios else 0.0
            f = self._fill[key] = 0.5 * super().frag(model, cpu_left, free) + 0.5 * left
        return f


def fgd_score(f_before: float, f_after: float) -> int:
    """floor(100 * sigmoid(delta / 1000)): integer on purpose, so that ties fall to the node order."""
    x = (f_before - f_after) / MILLI
    if x < -700:
        return 0
    return int((1.0 / (1.0 + math.exp(-x))) * 100)
