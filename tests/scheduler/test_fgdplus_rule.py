"""fgd+'s rule, checked against the independent reference scorer (tests/scheduler/reference_scores.py).

The rule: a node's fgd+ score is the pair (FGD's integer score, the same integer score under the CPU-aware
measure), compared in order, ties to the fixed node order. So fgd+ never takes a node FGD scores lower, and the
CPU-aware measure decides only among FGD's ties. The simulator's class placer (services/simulation/paper.py)
must pick, pod after pod, a node the reference calls best, with the reference's GPUs, and break the remaining
ties by the node priority. Swapping the pair, blending it, or dropping either measure breaks these tests.
"""

from __future__ import annotations

import random

import pytest

from bench.openb import compare
from services.scheduler.fragmentation import TypicalShape
from services.scheduler.placement import NodeFree, NodeScorer, PodShape
from services.simulation.paper import Placer
from tests.scheduler.reference_scores import RefNode, RefPod, Typical, best, commit, fgd, frag, frag_cpu_aware

# (model, GPUs, CPU milli): G2-, G3-, T4- and P100-like nodes, so CPU per GPU differs between nodes.
KINDS = (("G2", 8, 96_000), ("G3", 8, 128_000), ("T4", 2, 104_000), ("P100", 2, 16_000), ("V100", 4, 32_000))
SHAPES = (  # (CPU milli, k, m per GPU)
    (12_000, 1, 1000), (30_000, 1, 1000), (4_000, 1, 1000), (3_150, 1, 810), (6_000, 1, 470), (8_000, 1, 320),
    (2_000, 1, 160), (16_000, 0, 0), (40_000, 0, 0), (60_000, 4, 1000), (88_000, 8, 1000), (120_000, 8, 1000),
    (16_000, 2, 1000),
)


def typical(rng: random.Random) -> list[tuple[int, int, int, float]]:
    picked = rng.sample(SHAPES, rng.randint(3, 7))
    weights = [rng.randint(1, 9) for _ in picked]
    return [(c, m, k, w / sum(weights)) for (c, k, m), w in zip(picked, weights)]


def scenario(seed: int) -> tuple[list[NodeFree], list[RefNode], list[PodShape], list[tuple[int, int, int, float]]]:
    rng = random.Random(seed)
    nodes, refs = [], []
    priorities = rng.sample(range(100), 9)
    for i, prio in enumerate(priorities):
        model, g, cpu = rng.choice(KINDS)
        nodes.append(NodeFree(f"n{i}", prio, model, cpu, 10**6, [1000] * g))
        refs.append(RefNode(f"n{i}", model, cpu, 10**6, [1000] * g))
    pods = [PodShape(c, 0, k, m) for c, k, m in (rng.choice(SHAPES) for _ in range(40))]
    return nodes, refs, pods, typical(rng)


@pytest.mark.parametrize("seed", range(40))
def test_fgdplus_places_every_pod_on_a_node_the_reference_rule_calls_best(seed: int) -> None:
    nodes, refs, pods, shapes = scenario(seed)
    placer = Placer(nodes, NodeScorer("fgd+", [TypicalShape(c, m, k, (), p) for c, m, k, p in shapes]))
    ref_shapes = [Typical(c, m, k, (), p) for c, m, k, p in shapes]
    for n, pod in enumerate(pods):
        ref_pod = RefPod(pod.cpu, pod.mem, pod.count, pod.milli)
        top = best("fgd+", refs, ref_pod, ref_shapes)
        got = placer.place(pod)
        if got is None:
            assert not top, f"pod {n}: the reference can place it on {sorted(top)}"
            continue
        idx, gpus = got
        assert idx in top, f"pod {n} {pod}: node {idx}, reference best {sorted(top)}"
        assert tuple(gpus) == top[idx], f"pod {n}: GPUs {gpus}, reference {top[idx]}"
        # The remaining ties go to the smallest node priority.
        assert nodes[idx].priority == min(nodes[i].priority for i in top)
        commit(refs[idx], ref_pod, gpus)


@pytest.mark.parametrize("seed", range(40))
def test_fgdplus_never_takes_a_node_that_fgd_scores_lower(seed: int) -> None:
    nodes, refs, pods, shapes = scenario(seed)
    ref_shapes = [Typical(c, m, k, (), p) for c, m, k, p in shapes]
    for pod in pods:
        ref_pod = RefPod(pod.cpu, pod.mem, pod.count, pod.milli)
        plus = best("fgd+", refs, ref_pod, ref_shapes)
        if not plus:
            continue
        fgd_best = best("fgd", refs, ref_pod, ref_shapes)
        assert set(plus) <= set(fgd_best)  # the CPU-aware measure only picks among FGD's ties
        i = min(plus, key=lambda j: nodes[j].priority)
        commit(refs[i], ref_pod, plus[i])


def test_the_cpu_aware_measure_decides_among_fgds_ties_and_only_there() -> None:
    shapes = [Typical(12_000, 1000, 1, (), 1.0)]
    g2 = RefNode("g2", "G2", 96_000, 10**6, [1000] * 8)
    g3 = RefNode("g3", "G3", 128_000, 10**6, [1000] * 8)
    hungry = RefPod(30_000, 0, 1, 1000)
    # FGD ties (no 12-core task loses its GPU on either node); the CPU-aware measure sees 5 of g2's 7 idle GPUs fed.
    assert fgd(g2, hungry, shapes)[0] == fgd(g3, hungry, shapes)[0]
    assert frag_cpu_aware(shapes, "G2", 66_000, [0] + [1000] * 7) > frag_cpu_aware(shapes, "G3", 98_000, [0] + [1000] * 7)
    assert set(best("fgd+", [g2, g3], hungry, shapes)) == {1}
    # Where FGD does not tie, FGD's score decides even against the CPU-aware measure: g2's last GPU is half
    # used, so FGD prefers completing it; the CPU-aware measure alone would still rank g3 first.
    g2.free[7] = 500
    half = RefPod(30_000, 0, 1, 500)
    assert frag(shapes, "G2", 96_000, g2.free) > frag(shapes, "G3", 128_000, g3.free)
    assert set(best("fgd+", [g2, g3], half, shapes)) == set(best("fgd", [g2, g3], half, shapes)) == {0}
    assert fgd(g3, half, shapes, (frag_cpu_aware,))[0] > fgd(g2, half, shapes, (frag_cpu_aware,))[0]


def test_the_benchmark_compares_fgdplus_with_fgd_per_seed_and_over_workloads() -> None:
    curve = lambda v: {90: v - 1, 95: v - 0.5, 100: v, 130: v}  # noqa: E731
    done = {
        "a": {"fgd": [(curve(95.0), 1.0), (curve(96.0), 1.0)], "fgd+": [(curve(95.5), 1.0), (curve(95.9), 1.0)]},
        "b": {"fgd": [(curve(97.0), 1.0), (curve(97.0), 1.0)], "fgd+": [(curve(97.3), 1.0), (curve(97.3), 1.0)]},
    }
    text = compare(done, "fgd+", "fgd", [42, 43])
    assert "| a | 95.50 | 95.70 |" in text and "+0.20 (worst -0.10)" in text
    assert "| b | 97.00 | 97.30 |" in text and "+0.30 (worst +0.30)" in text
    assert text.rstrip().endswith("| mean of the 2 | | | +0.25 | +0.25 | +0.25 | +0.25 |")
    assert compare({"a": {"fgd": done["a"]["fgd"]}}, "fgd+", "fgd", [42, 43]) is None
