"""Node scoring over a light node state: FGD, BestFit, bin-packing, spreading, random, and FGD's baselines.

``choose_node`` places one pod the way the FGD simulator does (FGD_METHOD.md §1, §3, §6):
filter feasible nodes, score each, take the highest score, break ties by the
fixed node priority (smallest first), then pick GPUs with the policy's GPU
selection. The scheduling cycle (``core``) scores equivalence classes of nodes
with the very same ``NodeScorer``, so the openb benchmark and the scheduler
share one implementation.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.scheduler.fragmentation import FillFragMemo, FragMemo, TypicalShape, fgd_score
from shared.model import MILLI

POLICIES = ("fgd", "bestfit", "binpack", "spread", "random", "dotprod", "gpupacking", "gpuclustering", "fgd+")
MAX_SPEC_CPU = 128_000  # the simulator's normalisers (MaxSpecCpu, MaxSpecGpu)
MAX_SPEC_GPU = 8_000

Mask = Sequence[bool] | None  # GPUs a pod may use; None: all


@dataclass(slots=True)
class NodeFree:
    """What is left on one node: the light, mutable state the scorers read."""

    name: str
    priority: int  # fixed tie-break order: smaller wins
    model: str
    cpu: int
    mem: int
    free: list[int]  # milli-GPU left per device index
    tags: dict[str, int] = field(default_factory=dict)  # GPU-shape tags of pods here (GpuClustering)

    @property
    def gpu_count(self) -> int:
        return len(self.free)


@dataclass(frozen=True, slots=True)
class PodShape:
    """One pod (or one gang task): CPU milli, memory MiB, k GPUs of m milli each, accepted models."""

    cpu: int = 0
    mem: int = 0
    count: int = 0
    milli: int = 0
    models: tuple[str, ...] = ()

    @property
    def sharing(self) -> bool:
        return self.count == 1 and 0 < self.milli < MILLI

    @property
    def tag(self) -> str | None:
        if self.count == 0:
            return None
        return "share" if self.sharing else f"{self.count}-gpu"


def fits_gpus(free: Sequence[int], count: int, milli: int, ok: Mask = None) -> bool:
    if count == 0:
        return True
    n = 0
    for i, r in enumerate(free):
        if r >= milli and (ok is None or ok[i]):
            n += 1
            if n >= count:
                return True
    return False


def pick_whole(
    free: Sequence[int],
    count: int,
    milli: int,
    ok: Mask = None,
    domains: Sequence[int] | None = None,
    one_domain: bool = False,
) -> tuple[int, ...] | None:
    """GPUs for a task of ``count`` x ``milli``, preferring one NVLink domain.

    1. Without domain information: the first ``count`` GPUs with room, by index
       (the simulator's AllocateExclusiveGpuId).
    2. If a domain can hold the task: the domain with the fewest GPUs with room
       that is still big enough, so that bigger domains stay whole for bigger tasks.
    3. Otherwise (unless one domain is required): the fewest domains, biggest first.
    """
    room = [i for i, r in enumerate(free) if r >= milli and (ok is None or ok[i])]
    if len(room) < count:
        return None
    if domains is None:
        return tuple(room[:count])
    by_domain: dict[int, list[int]] = {}
    for i in room:
        by_domain.setdefault(domains[i], []).append(i)
    groups = sorted(by_domain.values(), key=lambda g: (len(g), g[0]))
    for g in groups:
        if len(g) >= count:
            return tuple(g[:count])
    if one_domain:
        return None
    chosen: list[int] = []
    for g in sorted(groups, key=lambda g: (-len(g), g[0])):
        chosen.extend(g[: count - len(chosen)])
        if len(chosen) == count:
            break
    return tuple(sorted(chosen))


class NodeScorer:
    """One scoring policy with its state: FGD's memo of F, Random's generator.

    ``score`` is "higher is better"; ties are the caller's to break by node priority.
    """

    def __init__(
        self,
        policy: str = "fgd",
        typical: Sequence[TypicalShape] = (),
        seed: int = 0,
        max_cpu: int = MAX_SPEC_CPU,
        max_gpu: int = MAX_SPEC_GPU,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self.fgd = policy in ("fgd", "fgd+")
        # fgd+ is FGD's integer score over the fill measure (half FGD's F, half the idle GPU left once the
        # target workload has filled the node), ties to the node order as FGD's.
        self.frag = FillFragMemo(typical) if policy == "fgd+" else FragMemo(typical)
        self.rng = random.Random(seed)
        self.max_cpu, self.max_gpu = max_cpu, max_gpu
        self.deterministic = policy != "random"
        self.needs_tags = policy == "gpuclustering"

    # --- feasibility and GPU choice -------------------------------------------------

    def feasible(self, node: NodeFree, pod: PodShape, ok: Mask = None) -> bool:
        if node.cpu < pod.cpu or node.mem < pod.mem:
            return False
        if pod.count == 0:
            return True
        if pod.models and node.model not in pod.models:
            return False
        return fits_gpus(node.free, pod.count, pod.milli, ok)

    def shared_gpu(self, node: NodeFree, pod: PodShape, ok: Mask = None) -> int | None:
        """The GPU a sharing pod takes: FGD's first best-scoring GPU, best fit, worst fit (spread) or random."""
        room = [i for i, r in enumerate(node.free) if r >= pod.milli and (ok is None or ok[i])]
        if not room:
            return None
        if self.fgd:
            return self._fgd_shared(node, pod, ok)[1]
        if self.policy == "random":
            return room[self.rng.randrange(len(room))]
        if self.policy == "spread":
            return min(room, key=lambda i: (-node.free[i], i))
        return min(room, key=lambda i: (node.free[i], i))

    def select_gpus(
        self,
        node: NodeFree,
        pod: PodShape,
        ok: Mask = None,
        domains: Sequence[int] | None = None,
        one_domain: bool = False,
    ) -> tuple[int, ...] | None:
        if pod.count == 0:
            return ()
        if pod.sharing:
            g = self.shared_gpu(node, pod, ok)
            return None if g is None else (g,)
        return pick_whole(node.free, pod.count, pod.milli, ok, domains, one_domain)

    # --- scores ---------------------------------------------------------------------

    def score(self, node: NodeFree, pod: PodShape, ok: Mask = None) -> int | tuple[int, ...]:
        p = self.policy
        if self.fgd:
            return self._fgd_shared(node, pod, ok)[0] if pod.sharing else self._fgd_whole(node, pod, ok)
        if p == "bestfit":
            return self._bestfit(node, pod)
        if p == "binpack":
            return (-(sum(node.free) - pod.count * pod.milli), -(node.cpu - pod.cpu))
        if p == "spread":
            return (sum(node.free) - pod.count * pod.milli, node.cpu - pod.cpu)
        if p == "dotprod":
            return self._dotprod(node, pod)
        if p == "gpupacking":
            return self._gpupacking(node, pod, ok)
        if p == "gpuclustering":
            return self._gpuclustering(node, pod)
        return 0  # random draws among feasible nodes instead of scoring

    def _fgd_shared(self, node: NodeFree, pod: PodShape, ok: Mask) -> tuple[int, int | None]:
        # Every GPU with room is tried; the first index reaching the best score wins.
        before = self.frag.frag(node.model, node.cpu, node.free)
        cpu_after = node.cpu - pod.cpu
        free = list(node.free)
        best = -1
        gpu = None
        for i, r in enumerate(free):
            if r < pod.milli or (ok is not None and not ok[i]):
                continue
            free[i] = r - pod.milli
            s = fgd_score(before, self.frag.frag(node.model, cpu_after, free))
            free[i] = r
            if s > best:
                best, gpu = s, i
        return best, gpu

    def _fgd_whole(self, node: NodeFree, pod: PodShape, ok: Mask) -> int:
        before = self.frag.frag(node.model, node.cpu, node.free)
        after = list(node.free)
        left = pod.count
        if left:
            for i in sorted(range(len(after)), key=after.__getitem__):  # ascending room, stable by index
                if after[i] >= pod.milli and (ok is None or ok[i]):
                    after[i] -= pod.milli
                    left -= 1
                    if left == 0:
                        break
        return fgd_score(before, self.frag.frag(node.model, node.cpu - pod.cpu, after))

    def _bestfit(self, node: NodeFree, pod: PodShape) -> int:
        cpu_term = 0.5 * (node.cpu - pod.cpu) / self.max_cpu
        gpu_term = 0.5 * (sum(node.free) - pod.count * pod.milli) / self.max_gpu
        return int((1 - (cpu_term + gpu_term)) * 100)

    def _dotprod(self, node: NodeFree, pod: PodShape) -> int:
        if node.cpu < pod.cpu:
            return 0
        dot = (node.cpu / self.max_cpu) * (pod.cpu / self.max_cpu) + (sum(node.free) / self.max_gpu) * (
            pod.count * pod.milli / self.max_gpu
        )
        return int(100 * (1 - dot / 2))

    def _gpupacking(self, node: NodeFree, pod: PodShape, ok: Mask) -> int:
        if pod.count == 0:
            return 0
        if all(r == MILLI for r in node.free):
            return max(33 - node.gpu_count, node.gpu_count)
        taken = [
            i for i in sorted(range(node.gpu_count), key=node.free.__getitem__)
            if node.free[i] >= pod.milli and (ok is None or ok[i])
        ][: pod.count]
        whole = sum(1 for i in taken if node.free[i] == MILLI)
        if whole:
            return max(50 - whole, 33)
        return max(100 - sum(node.free[i] * 100 // MILLI for i in taken) // 10, 50)

    def _gpuclustering(self, node: NodeFree, pod: PodShape) -> int:
        tag = pod.tag
        if tag is None:
            return 0
        b = 25 * (MAX_SPEC_GPU - sum(node.free)) // MAX_SPEC_GPU
        present = [t for t, n in node.tags.items() if n > 0]
        if tag in present:
            return (75 if len(present) == 1 else 50) + b
        return (25 if not present else 0) + b


def choose_node(nodes: Sequence[NodeFree], pod: PodShape, scorer: NodeScorer) -> tuple[int, tuple[int, ...]] | None:
    """Place one pod: (index into ``nodes``, GPU indices), or None if no node is feasible.

    1. Feasible set (CPU, memory, model, GPU room).
    2. One feasible node is taken without scoring (as kube-scheduler does).
    3. Random draws uniformly; every other policy takes the highest score, ties to
       the smallest node priority.
    4. GPUs by the policy's GPU selection; whole GPUs: the first free by index.
    """
    # Nodes in the same state get the same verdict and score: compute each once per call.
    verdicts: dict[tuple, bool] = {}
    scores: dict[tuple, object] = {}
    keys = []
    feasible = []
    for i, n in enumerate(nodes):
        key = (n.model, n.cpu, n.mem, tuple(n.free), tuple(sorted(n.tags.items())) if scorer.needs_tags else ())
        ok = verdicts.get(key)
        if ok is None:
            ok = verdicts[key] = scorer.feasible(n, pod)
        if ok:
            feasible.append(i)
            keys.append(key)
    if not feasible:
        return None
    if len(feasible) == 1:
        best = feasible[0]
    elif scorer.policy == "random":
        best = feasible[scorer.rng.randrange(len(feasible))]
    else:
        best, best_key = -1, None
        for i, key in zip(feasible, keys):
            sc = scores.get(key)
            if sc is None:
                sc = scores[key] = scorer.score(nodes[i], pod)
            rank = (sc, -nodes[i].priority)
            if best_key is None or rank > best_key:
                best, best_key = i, rank
    gpus = scorer.select_gpus(nodes[best], pod)
    assert gpus is not None  # feasibility guarantees room
    return best, gpus


def take(node: NodeFree, pod: PodShape, gpus: Sequence[int]) -> None:
    """Commit a pod to a node: CPU, memory and each chosen GPU's milli go down."""
    node.cpu -= pod.cpu
    node.mem -= pod.mem
    for g in gpus:
        node.free[g] -= pod.milli
    if (tag := pod.tag) is not None:
        node.tags[tag] = node.tags.get(tag, 0) + 1
