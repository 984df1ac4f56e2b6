"""fgd+'s rule, checked against the independent reference scorer (tests/scheduler/reference_scores.py).

The rule: a node's fgd+ score is FGD's integer score of the move, over the mean of two measures: FGD's F,
and the idle GPU milli the node keeps once a fixed sample of sequences drawn from the target workload has
filled it; ties go to the fixed node order. The simulator's class placer (services/simulation/paper.py)
must pick, pod after pod, a node the reference calls best, with the reference's GPUs, and break the remaining
ties by the node priority. Dropping either half, or filling with the wrong GPUs or without CPU, breaks these
tests.
"""

from __future__ import annotations

import random

import pytest

from bench.openb import compare
from services.scheduler.fragmentation import TypicalShape
from services.scheduler.placement import NodeFree, NodeScorer, PodShape
from services.simulation.paper import Placer
from tests.scheduler.reference_scores import RefNode, RefPod, Typical, best, commit, fgd, frag, frag_plus, idle_after

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


def test_fgdplus_sends_a_cpu_hungry_pod_where_the_cpu_left_still_feeds_the_idle_gpus() -> None:
    shapes = [Typical(12_000, 1000, 1, (), 1.0)]
    g2 = RefNode("g2", "G2", 96_000, 10**6, [1000] * 8)
    g3 = RefNode("g3", "G3", 128_000, 10**6, [1000] * 8)
    hungry = RefPod(30_000, 0, 1, 1000)
    # FGD ties: one more 12-core task fits beside the pod on either node, so it sees no fragmentation.
    assert fgd(g2, hungry, shapes)[0] == fgd(g3, hungry, shapes)[0]
    # Filled with 12-core tasks, g2 feeds 5 of its 7 idle GPUs after the pod; g3 feeds all 7.
    assert idle_after(shapes * 64, "G2", 66_000, [0] + [1000] * 7) == 2000
    assert idle_after(shapes * 64, "G3", 98_000, [0] + [1000] * 7) == 0
    assert set(best("fgd+", [g2, g3], hungry, shapes)) == {1}
    placer = Placer([NodeFree("g2", 0, "G2", 96_000, 10**6, [1000] * 8), NodeFree("g3", 1, "G3", 128_000, 10**6,
                                                                                    [1000] * 8)],
                    NodeScorer("fgd+", [TypicalShape(12_000, 1000, 1, (), 1.0)]))
    assert placer.place(PodShape(30_000, 0, 1, 1000))[0] == 1


def test_fgds_half_keeps_a_whole_node_for_the_pods_that_need_all_its_gpus() -> None:
    # One task in ten takes a whole 8-GPU node. Filled by the sample, an idle node and a half-used one both end
    # full, so the fill measure alone ties them and the node order would open the idle node; FGD's half sees
    # that the idle node can no longer take the 8-GPU task and keeps it whole.
    shapes = [Typical(4_000, 1000, 1, (), 0.9), Typical(32_000, 1000, 8, (), 0.1)]
    idle = RefNode("idle", "G2", 96_000, 10**6, [1000] * 8)
    used = RefNode("used", "G2", 80_000, 10**6, [0] * 4 + [1000] * 4)
    pod = RefPod(4_000, 0, 1, 1000)

    def fill_only(s, model, cpu, free):  # noqa: ANN001, ANN202 - the fill half alone
        return 2 * frag_plus(s, model, cpu, free) - frag(s, model, cpu, free)

    assert fgd(idle, pod, shapes, fill_only)[0] == fgd(used, pod, shapes, fill_only)[0]
    assert set(best("fgd+", [idle, used], pod, shapes)) == {1}
    placer = Placer([NodeFree("idle", 0, "G2", 96_000, 10**6, [1000] * 8),
                     NodeFree("used", 1, "G2", 80_000, 10**6, [0] * 4 + [1000] * 4)],
                    NodeScorer("fgd+", [TypicalShape(4_000, 1000, 1, (), 0.9), TypicalShape(32_000, 1000, 8, (), 0.1)]))
    assert placer.place(PodShape(4_000, 0, 1, 1000))[0] == 1


def test_the_fill_sees_the_leftover_no_likely_task_can_use() -> None:
    # 0.81-GPU tasks are most of the workload; after a 0.5-GPU pod, a GPU with 500 left takes nothing of them.
    shapes = [Typical(3_000, 810, 1, (), 0.8), Typical(2_000, 500, 1, (), 0.2)]
    fresh = RefNode("fresh", "T4", 100_000, 10**6, [1000, 1000])
    half = RefNode("half", "T4", 100_000, 10**6, [500, 1000])
    pod = RefPod(2_000, 0, 1, 500)
    # On "half" the pod completes the GPU that another 0.5 task had started; on "fresh" it strands 500 milli
    # that only the rare 0.5 tasks fill.
    assert set(best("fgd+", [fresh, half], pod, shapes)) == {1}
    assert fgd(half, pod, shapes, frag_plus) == (fgd(half, pod, shapes, frag_plus)[0], (0,))


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


def test_a_target_workload_without_weights_scores_every_move_alike_as_fgd_does() -> None:
    shapes = [TypicalShape(4_000, 1000, 1)]  # no probability: nothing to draw the fill's sample from
    node = NodeFree("n", 0, "G2", 96_000, 10**6, [1000] * 8)
    pod = PodShape(4_000, 0, 1, 1000)
    assert NodeScorer("fgd+", shapes).score(node, pod) == NodeScorer("fgd", shapes).score(node, pod) == 50
