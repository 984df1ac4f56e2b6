"""The FGD paper's node scores, written from /work/shared/FGD_METHOD.md: a test oracle for node choice.

Independent of ``services.scheduler`` (no NodeScorer, no FragMemo): each score is the formula the
method document gives, computed plainly (no memo, no classes), so a test can check that the scheduler
(or the simulator's class placer) picks a node with the best score and the GPUs the policy's GPU
selection takes. Ties are the caller's: ``best`` returns every node reaching the best score.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

WHOLE = 1000
MAX_CPU, MAX_GPU = 128_000, 8_000  # MaxSpecCpu, MaxSpecGpu


@dataclass
class RefNode:
    name: str
    model: str
    cpu: int
    mem: int
    free: list[int]  # milli per GPU, by index
    tags: Counter = field(default_factory=Counter)  # GPU-shape tags of the pods placed here (GpuClustering)


@dataclass(frozen=True)
class RefPod:
    cpu: int
    mem: int
    count: int  # k
    milli: int  # m per GPU (0 for CPU-only)
    models: tuple[str, ...] = ()

    @property
    def sharing(self) -> bool:
        return self.count == 1 and self.milli < WHOLE

    @property
    def tag(self) -> str | None:
        return None if self.count == 0 else "share" if self.sharing else f"{self.count}-gpu"


@dataclass(frozen=True)
class Typical:
    cpu: int
    milli: int
    count: int
    models: tuple[str, ...]
    p: float


def typical_pods(pods: Iterable[tuple[int, int, int, tuple[str, ...]]], threshold: int = 95) -> list[Typical]:
    """§2.1: exact (CPU, m, k, spec) tuples, most popular first (equal counts: larger tuple first), until the
    kept ones cover ``threshold`` % of the pods; probabilities renormalised over the kept ones."""
    counts = Counter(pods)
    total = sum(counts.values())
    ranked = sorted(counts.items(), key=lambda kv: (kv[1], kv[0][:3], "|".join(kv[0][3])), reverse=True)
    kept, covered = [], 0
    for key, n in ranked:
        kept.append((key, n))
        covered += n
        if covered * 100 >= threshold * total:
            break
    return [Typical(c, m, k, models, n / covered) for (c, m, k, models), n in kept]


# --- feasibility and fragmentation -------------------------------------------------------------


def feasible(node: RefNode, pod: RefPod) -> bool:
    """§1: CPU and memory; a GPU pod also needs the model and k GPUs with m milli left each."""
    if node.cpu < pod.cpu or node.mem < pod.mem:
        return False
    if pod.count == 0:
        return True
    if not node.free or (pod.models and node.model not in pod.models):
        return False
    return sum(1 for r in node.free if r >= pod.milli) >= pod.count


def frag(shapes: Sequence[Typical], model: str, cpu: int, free: Sequence[int]) -> float:
    """§2.2-2.3: F = sum over typical shapes of p_t x the idle milli that shape t cannot use here."""
    idle = sum(free)
    total = 0.0
    for t in shapes:
        if t.milli == 0 or (t.models and model not in t.models):
            amount = idle  # CPU-only shapes never use GPUs; a refused model has no access
        elif sum(1 for r in free if r >= t.milli) >= t.count and cpu >= t.cpu:
            amount = sum(r for r in free if r < t.milli)  # Q3: only GPUs too small for t
        else:
            amount = idle  # Q1, Q2, Q4
        total += t.p * amount
    return total


def fill_sample(shapes: Sequence[Typical]) -> list[list[Typical]]:
    """fgd+'s fixed sample of futures: 32 sequences of 64 shapes drawn by probability with random.Random(12345)."""
    rng = random.Random(12345)
    return [rng.choices(list(shapes), [t.p for t in shapes], k=64) for _ in range(32)] if shapes else []


def idle_after(seq: Sequence[Typical], model: str, cpu: int, free: Sequence[int]) -> int:
    """The node's idle milli once each shape of ``seq`` in turn took its CPU and the k GPUs of least room that fit
    it (a refused model, too little CPU or too few GPUs: skipped)."""
    room = sorted(free)
    for t in seq:
        if t.cpu > cpu or (t.milli and t.models and model not in t.models):
            continue
        fits = [j for j, r in enumerate(room) if r >= t.milli]
        if t.milli and len(fits) < t.count:
            continue
        cpu -= t.cpu
        for j in fits[: t.count] if t.milli else ():
            room[j] -= t.milli
        room.sort()
    return sum(room)


def frag_plus(shapes: Sequence[Typical], model: str, cpu: int, free: Sequence[int]) -> float:
    """fgd+: the mean of F and the idle milli left after the fill, averaged over the sample's sequences."""
    sample = fill_sample(shapes)
    left = sum(idle_after(seq, model, cpu, free) for seq in sample) / len(sample) if sample else 0.0
    return (frag(shapes, model, cpu, free) + left) / 2


def sigmoid_score(before: float, after: float) -> int:
    """floor(100 * sigmoid((F_before - F_after) / 1000))."""
    x = (before - after) / WHOLE
    return 0 if x < -700 else math.floor(100 / (1 + math.exp(-x)))


# --- scores and GPU choice -----------------------------------------------------------------------


def first_free(node: RefNode, pod: RefPod) -> tuple[int, ...]:
    """A pod that does not share takes the first k GPUs with room, by index."""
    return tuple([i for i, r in enumerate(node.free) if r >= pod.milli][: pod.count])


def fgd(node: RefNode, pod: RefPod, shapes: Sequence[Typical], measure=frag) -> tuple[int, tuple[int, ...]]:
    """§2.5: a sharing pod tries every GPU with room (the first reaching the best integer score wins); any
    other pod takes its k GPUs in ascending order of room (stable by index). fgd+: the same over its measure."""
    before = measure(shapes, node.model, node.cpu, node.free)

    def scored(cpu: int, free: Sequence[int]) -> int:
        return sigmoid_score(before, measure(shapes, node.model, cpu, free))

    if pod.sharing:
        best, gpu = None, -1
        for i, r in enumerate(node.free):
            if r < pod.milli:
                continue
            after = list(node.free)
            after[i] -= pod.milli
            s = scored(node.cpu - pod.cpu, after)
            if best is None or s > best:
                best, gpu = s, i
        return best, (gpu,)
    after = list(node.free)
    left = pod.count
    for i in sorted(range(len(after)), key=lambda i: node.free[i]):  # ascending room; sorted() is stable
        if left and after[i] >= pod.milli:
            after[i] -= pod.milli
            left -= 1
    return scored(node.cpu - pod.cpu, after), first_free(node, pod)


def best_fit_gpu(node: RefNode, pod: RefPod) -> tuple[int, ...]:
    """"best" GPU selection: a sharing pod takes the GPU with the least room that fits, lowest index on ties."""
    if not pod.sharing:
        return first_free(node, pod)
    return (min((r, i) for i, r in enumerate(node.free) if r >= pod.milli)[1],)


def worst_fit_gpu(node: RefNode, pod: RefPod) -> tuple[int, ...]:
    if not pod.sharing:
        return first_free(node, pod)
    return (min((-r, i) for i, r in enumerate(node.free) if r >= pod.milli)[1],)


def score(policy: str, node: RefNode, pod: RefPod, shapes: Sequence[Typical]) -> tuple[object, tuple[int, ...]]:
    """(score, GPUs it takes) of a feasible node; higher scores win."""
    left_gpu = sum(node.free) - pod.count * pod.milli
    if policy == "fgd":
        return fgd(node, pod, shapes)
    if policy == "fgd+":
        return fgd(node, pod, shapes, frag_plus)
    if policy == "bestfit":
        raw = 1 - (0.5 * (node.cpu - pod.cpu) / MAX_CPU + 0.5 * left_gpu / MAX_GPU)
        return math.floor(raw * 100), best_fit_gpu(node, pod)
    if policy == "dotprod":
        if node.cpu < pod.cpu:
            return 0, best_fit_gpu(node, pod)
        dot = (node.cpu / MAX_CPU) * (pod.cpu / MAX_CPU) + (sum(node.free) / MAX_GPU) * (pod.count * pod.milli / MAX_GPU)
        return math.floor(100 * (1 - dot / 2)), best_fit_gpu(node, pod)
    if policy == "gpupacking":
        return gpu_packing(node, pod), best_fit_gpu(node, pod)
    if policy == "gpuclustering":
        return gpu_clustering(node, pod), best_fit_gpu(node, pod)
    if policy == "binpack":  # the fullest node after the pod: least GPU left, then least CPU left
        return (-left_gpu, -(node.cpu - pod.cpu)), best_fit_gpu(node, pod)
    if policy == "spread":  # the emptiest node after the pod
        return (left_gpu, node.cpu - pod.cpu), worst_fit_gpu(node, pod)
    raise ValueError(f"no reference score for {policy!r}")


def gpu_packing(node: RefNode, pod: RefPod) -> int:
    """§3 GpuPacking: shared GPUs first, then free GPUs on a used node, then idle nodes, smallest first."""
    if pod.count == 0:
        return 0
    g = len(node.free)
    if all(r == WHOLE for r in node.free):
        return max(33 - g, g)
    taken = [i for i in sorted(range(g), key=lambda i: node.free[i]) if node.free[i] >= pod.milli][: pod.count]
    whole = sum(1 for i in taken if node.free[i] == WHOLE)
    if whole:
        return max(50 - whole, 33)
    return max(100 - sum(node.free[i] * 100 // WHOLE for i in taken) // 10, 50)


def gpu_clustering(node: RefNode, pod: RefPod) -> int:
    """§3 GpuClustering: pods of one GPU shape together; b = floor(25 (8000 - GPU left) / 8000)."""
    tag = pod.tag
    if tag is None:
        return 0
    b = 25 * (MAX_GPU - sum(node.free)) // MAX_GPU
    present = {t for t, n in node.tags.items() if n > 0}
    if tag in present:
        return (75 if len(present) == 1 else 50) + b
    return (25 if not present else 0) + b


def best(policy: str, nodes: Sequence[RefNode], pod: RefPod, shapes: Sequence[Typical]) -> dict[int, tuple[int, ...]]:
    """Every feasible node with the best score (index -> the GPUs the pod takes there); {} if none is feasible."""
    scored = {i: score(policy, n, pod, shapes) for i, n in enumerate(nodes) if feasible(n, pod)}
    if not scored:
        return {}
    if len(scored) == 1:  # one feasible node is taken without scoring
        return {i: gpus for i, (_, gpus) in scored.items()}
    top = max(s for s, _ in scored.values())
    return {i: gpus for i, (s, gpus) in scored.items() if s == top}


def commit(node: RefNode, pod: RefPod, gpus: Sequence[int]) -> None:
    node.cpu -= pod.cpu
    node.mem -= pod.mem
    for g in gpus:
        node.free[g] -= pod.milli
    if pod.tag is not None:
        node.tags[pod.tag] += 1


class TieOrder:
    """Which node won each tie: the winners must follow one fixed order (no a-over-b and b-over-a, no cycle)."""

    def __init__(self) -> None:
        self.over: dict[str, set[str]] = {}

    def won(self, winner: str, others: Iterable[str]) -> None:
        self.over.setdefault(winner, set()).update(o for o in others if o != winner)

    def cycle(self) -> list[str] | None:
        state: dict[str, int] = {}
        path: list[str] = []

        def visit(n: str) -> list[str] | None:
            state[n] = 1
            path.append(n)
            for m in self.over.get(n, ()):
                if state.get(m) == 1:
                    return path[path.index(m):] + [m]
                if m not in state and (found := visit(m)):
                    return found
            state[n] = 2
            path.pop()
            return None

        for n in list(self.over):
            if n not in state and (found := visit(n)):
                return found
        return None
