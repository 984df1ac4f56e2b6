"""The FGD paper's placement experiment (Weng et al., ATC '23), as its public simulator runs it.

One run: the pods of a trace, shuffled with a seed and resampled up to ``tune`` x
the cluster's GPU capacity, arrive one at a time; each is placed by
``placement.choose_node`` semantics (filter, score, ties to a fixed random node
order, GPU choice) or dropped if nothing fits; nothing ever departs. The curve is
the allocated GPU share against the arrived GPU share, failed pods included.
See /work/shared/FGD_METHOD.md.
"""

from __future__ import annotations

import heapq
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.scheduler.fragmentation import TypicalShape, typical_shapes
from services.scheduler.placement import NodeFree, NodeScorer, PodShape, take
from services.simulation.traces import OpenbNode, OpenbPod
from shared.model import MILLI

_MISS = object()


def target_workload(pods: Sequence[OpenbPod]) -> tuple[TypicalShape, ...]:
    """FGD's typical pods: exact (CPU, m, k, spec) tuples of the original trace, top 95 %, renormalised."""
    counts: dict[tuple[int, int, int, tuple[str, ...]], int] = {}
    for p in pods:
        counts[p.typical_key] = counts.get(p.typical_key, 0) + 1
    return typical_shapes(counts)


@dataclass(frozen=True, slots=True)
class Arrivals:
    """The pods in arrival order and each node's tie-break priority (a random permutation index)."""

    pods: tuple[OpenbPod, ...]
    priority: tuple[int, ...]
    tuned: int  # pods appended by resampling (negative: removed)


def arrivals(nodes: Sequence[OpenbNode], pods: Sequence[OpenbPod], seed: int, tune: float = 1.3) -> Arrivals:
    """The simulator's order of random draws, with Python's generator instead of Go's.

    1. Shuffle the name-sorted pods (after one throw-away draw, as the Go code logs one).
    2. Resample with replacement from the name-sorted list, appending clones after the
       shuffled originals, until the next sample's per-GPU milli m (not k x m) would
       overshoot ``tune`` x capacity; that sample is discarded. Above the target,
       random pods are removed instead.
    3. Draw the node permutation: node i (by name) ties before node j iff perm[i] < perm[j].
    """
    rng = random.Random(seed)
    rng.random()
    order = sorted(pods, key=lambda p: p.name)
    shuffled = list(order)
    rng.shuffle(shuffled)
    target = tune * MILLI * sum(n.gpus for n in nodes)
    total = sum(p.gpu_milli for p in order)
    tuned = 0
    if total < target:
        while True:
            p = order[rng.randrange(len(order))]
            if total + p.milli > target:
                break
            total += p.gpu_milli
            shuffled.append(p)
            tuned += 1
    else:
        while total > target and shuffled:
            p = shuffled.pop(rng.randrange(len(shuffled)))
            total -= p.gpu_milli
            tuned -= 1
    perm = list(range(len(nodes)))
    rng.shuffle(perm)
    return Arrivals(tuple(shuffled), tuple(perm), tuned)


class _Class:
    """Nodes in one identical state: one feasibility verdict, score and GPU pick per pod shape."""

    __slots__ = ("rep", "members", "heap", "prio", "memo", "picks")

    def __init__(self, rep: NodeFree) -> None:
        self.rep = rep
        self.members: dict[int, int] = {}  # node index -> priority, in insertion order
        self.heap: list[tuple[int, int]] = []
        self.prio = 1 << 62
        self.memo: dict[tuple, object] = {}
        self.picks: dict[tuple, tuple[int, ...]] = {}

    def add(self, idx: int, prio: int) -> None:
        self.members[idx] = prio
        heapq.heappush(self.heap, (prio, idx))
        self.prio = min(self.prio, prio)

    def remove(self, idx: int) -> None:
        del self.members[idx]
        heap = self.heap
        while heap and heap[0][1] not in self.members:
            heapq.heappop(heap)
        self.prio = heap[0][0] if heap else 1 << 62


class Placer:
    """``choose_node`` and ``take`` over a whole cluster, pod after pod, at a fraction of the cost.

    Nodes in identical states (model, CPU, memory, per-GPU free milli, shape tags)
    get identical verdicts, scores and GPU picks, so those are computed once per
    state and remembered until the state's last node leaves it. The choice is the
    one ``choose_node`` makes: best score, ties to the smallest priority; Random
    draws uniformly among feasible nodes.
    """

    def __init__(self, nodes: Sequence[NodeFree], scorer: NodeScorer) -> None:
        self.nodes = list(nodes)
        self.scorer = scorer
        self.classes: dict[tuple, _Class] = {}
        self._key: list[tuple] = []
        for i, n in enumerate(self.nodes):
            key = self._state(n)
            self._key.append(key)
            self._class(key, n).add(i, n.priority)

    def _state(self, n: NodeFree) -> tuple:
        tags = tuple(sorted((k, v) for k, v in n.tags.items() if v)) if self.scorer.needs_tags else ()
        return (n.model, n.cpu, n.mem, tuple(n.free), tags)

    def _class(self, key: tuple, n: NodeFree) -> _Class:
        cls = self.classes.get(key)
        if cls is None:
            cls = self.classes[key] = _Class(NodeFree("", 0, n.model, n.cpu, n.mem, list(n.free), dict(n.tags)))
        return cls

    def choose(self, pod: PodShape) -> tuple[int, tuple[int, ...]] | None:
        scorer = self.scorer
        mem = pod.mem
        if getattr(scorer, "scores_memory", False):
            shape, key = pod, (pod.cpu, pod.count, pod.milli, pod.models, mem)
        else:  # memory is a filter only: one verdict and score serve every memory request
            shape, key = PodShape(pod.cpu, 0, pod.count, pod.milli, pod.models), (pod.cpu, pod.count, pod.milli, pod.models)
        if not scorer.deterministic:
            return self._draw(shape, key, mem)
        best: _Class | None = None
        best_s: object = None
        best_p = 0
        for cls in self.classes.values():
            if cls.rep.mem < mem:
                continue
            s = cls.memo.get(key, _MISS)
            if s is _MISS:
                s = cls.memo[key] = scorer.score(cls.rep, shape) if scorer.feasible(cls.rep, shape) else None
            if s is None:
                continue
            if best is None or s > best_s or (s == best_s and cls.prio < best_p):  # type: ignore[operator]
                best, best_s, best_p = cls, s, cls.prio
        if best is None:
            return None
        gpus = best.picks.get(key)
        if gpus is None:
            gpus = best.picks[key] = scorer.select_gpus(best.rep, shape) or ()
        return best.heap[0][1], gpus

    def _draw(self, shape: PodShape, key: tuple, mem: int) -> tuple[int, tuple[int, ...]] | None:
        feasible = []
        total = 0
        for cls in self.classes.values():
            if cls.rep.mem < mem:
                continue
            ok = cls.memo.get(key, _MISS)
            if ok is _MISS:
                ok = cls.memo[key] = True if self.scorer.feasible(cls.rep, shape) else None
            if ok:
                feasible.append(cls)
                total += len(cls.members)
        if not feasible:
            return None
        r = self.scorer.rng.randrange(total)
        for cls in feasible:
            if r < len(cls.members):
                idx = list(cls.members)[r]
                gpus = self.scorer.select_gpus(cls.rep, shape)
                return idx, gpus or ()
            r -= len(cls.members)
        raise AssertionError("unreachable")

    def commit(self, idx: int, pod: PodShape, gpus: Sequence[int]) -> None:
        node = self.nodes[idx]
        old = self._key[idx]
        cls = self.classes[old]
        cls.remove(idx)
        if not cls.members:
            del self.classes[old]
        take(node, pod, gpus)
        key = self._key[idx] = self._state(node)
        self._class(key, node).add(idx, node.priority)

    def place(self, pod: PodShape) -> tuple[int, tuple[int, ...]] | None:
        got = self.choose(pod)
        if got is not None:
            self.commit(got[0], pod, got[1])
        return got


@dataclass
class PaperRun:
    """One policy x seed: per-pod (arrived, allocated) milli, and the discretised curve."""

    policy: str
    seed: int
    capacity: int  # GPU milli of the cluster
    arrived: list[int] = field(default_factory=list)
    allocated: list[int] = field(default_factory=list)
    failed: int = 0
    tuned: int = 0
    seconds: float = 0.0

    def curve(self, top: int = 130) -> dict[int, float]:
        return discretise(self.arrived, self.allocated, self.capacity, top)


def discretise(arrived: Sequence[int], allocated: Sequence[int], capacity: int, top: int = 130) -> dict[int, float]:
    """merge_alloc_discrete.py: bin each pod's row by arrived % rounded half-to-even; mean of the
    allocation % (each rounded to 2 decimals) per bin; an empty bin takes the rows of bins X-1..X+1."""
    unit = capacity / 100
    bins: dict[int, list[float]] = {}
    for a, u in zip(arrived, allocated):
        bins.setdefault(round(a / unit), []).append(round(u / unit, 2))
    out = {}
    for x in range(top + 1):
        rows = bins.get(x) or [v for b in (x - 1, x, x + 1) for v in bins.get(b, ())]
        if rows:
            out[x] = round(statistics.fmean(rows), 2)
    return out


def free_nodes(nodes: Sequence[OpenbNode], priority: Sequence[int]) -> list[NodeFree]:
    return [NodeFree(n.name, p, n.model, n.cpu, n.mem, [MILLI] * n.gpus) for n, p in zip(nodes, priority)]


def run_paper(
    nodes: Sequence[OpenbNode],
    pods: Sequence[OpenbPod],
    policy: str,
    seed: int,
    tune: float = 1.3,
    typical: Sequence[TypicalShape] | None = None,
    on_pod: Callable[[int, int], None] | None = None,
) -> PaperRun:
    """One run of the method; ``typical`` defaults to the target workload of ``pods`` (the untuned trace)."""
    t0 = time.perf_counter()
    typical = target_workload(pods) if typical is None else tuple(typical)
    arr = arrivals(nodes, pods, seed, tune)
    placer = Placer(free_nodes(nodes, arr.priority), NodeScorer(policy, typical, seed))
    run = PaperRun(policy, seed, MILLI * sum(n.gpus for n in nodes), tuned=arr.tuned)
    arrived = used = 0
    total = len(arr.pods)
    for i, p in enumerate(arr.pods):
        arrived += p.gpu_milli
        if placer.place(p.shape) is None:
            run.failed += 1
        else:
            used += p.gpu_milli
        run.arrived.append(arrived)
        run.allocated.append(used)
        if on_pod is not None:
            on_pod(i + 1, total)
    run.seconds = time.perf_counter() - t0
    return run
