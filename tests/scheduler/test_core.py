"""The scheduling core, by example: gangs, topology, heterogeneity, backfill, preemption, reasons."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from services.scheduler.core import Cycle, Plan, Policy, ReclaimRequest, reclaim, run_cycle
from services.scheduler.fragmentation import TypicalShape, fgd_score, typical_shapes
from services.scheduler.placement import NodeFree, NodeScorer, PodShape, choose_node, take
from shared.cluster import JobRecord
from shared.fairshare import reclaim_requests
from shared.model import GpuAmount, QueueSpec
from tests.builders import cluster, gpu_uuid, job, node


def gpus_of(plan: Plan, job_id: str) -> list[tuple[str, tuple[str, ...]]]:
    return [(t.node_id, tuple(g.uuid for g in t.gpus)) for t in plan.placements[job_id].tasks]


def nodes_of(plan: Plan, job_id: str) -> set[str]:
    return {t.node_id for t in plan.placements[job_id].tasks}


# --- gangs -------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fgd", "bestfit", "binpack"])
def test_three_gangs_that_fit_only_one_way_are_all_placed_that_way(policy: str) -> None:
    c = cluster(node("big-1").gpus(8), node("big-2").gpus(8), node("small").gpus(2))
    c.pending(job("pair").gpus(1).tasks(2).topology("node").build(), "pair")
    c.pending(job("halves").gpus(4).tasks(2).topology("node").build(), "halves")
    c.pending(job("whole").gpus(8).build(), "whole")

    plan = run_cycle(c.snapshot(), Policy(name=policy))

    assert set(plan.placements) == {"pair", "halves", "whole"}
    assert nodes_of(plan, "pair") == {"small"}
    assert nodes_of(plan, "halves") | nodes_of(plan, "whole") == {"big-1", "big-2"}
    assert nodes_of(plan, "halves") != nodes_of(plan, "whole")


def test_a_gang_waits_rather_than_starting_part_of_its_tasks() -> None:
    c = cluster(node("n1").gpus(8), node("n2").gpus(8), node("n3").gpus(8))
    c.pending(job("train").gpus(8).tasks(4).build(), "train")

    plan = run_cycle(c.snapshot())

    assert plan.placements == {}
    assert plan.unschedulable["train"] == (
        "needs 4 tasks × 8 GPUs; the cluster can never hold it: at most 3 such tasks fit in the whole cluster, even empty"
    )


def test_a_gang_waits_whole_when_one_of_four_nodes_is_busy() -> None:
    c = cluster(*(node(f"n{i}").gpus(8) for i in range(4)))
    c.running(job("other").gpus(1).build(), on=[("n3", [0])])
    c.pending(job("train").gpus(8).tasks(4).build(), "train")

    plan = run_cycle(c.snapshot(), Policy(backfill=False))

    assert plan.placements == {}
    assert plan.unschedulable["train"] == "needs 4 tasks × 8 GPUs; only 3 of 4 tasks fit in the cluster now; at most 1 on one node (n2)"


def test_a_gang_that_fits_is_placed_whole_with_one_task_per_rank() -> None:
    c = cluster(*(node(f"n{i}").gpus(8).rack("r1") for i in range(4)))
    c.pending(job("train").gpus(8).tasks(4).queue("nlp").build(), "train")

    plan = run_cycle(c.snapshot())

    tasks = plan.placements["train"].tasks
    assert [t.task for t in tasks] == [0, 1, 2, 3]
    assert len({t.node_id for t in tasks}) == 4
    assert all(len(t.gpus) == 8 for t in tasks)
    assert plan.placements["train"].spread == "rack"


# --- topology ----------------------------------------------------------------------------


def test_a_four_gpu_task_lands_inside_one_nvlink_domain() -> None:
    c = cluster(node("n1").gpus(8).nvlink_domains(2), node("n2").gpus(8).nvlink_domains(2))
    c.running(job("busy").gpus(1).build(), on=[("n1", [0])])  # n1: 3 + 3 free: 6 GPUs, but no whole domain
    c.running(job("busy").gpus(1).build(), on=[("n1", [5])])
    c.running(job("busy").gpus(2).build(), on=[("n2", [0, 1])])  # n2: 2 + 4 free
    c.pending(job("t").gpus(4).build(), "t")

    plan = run_cycle(c.snapshot())

    assert gpus_of(plan, "t") == [("n2", tuple(gpu_uuid("n2", i) for i in (4, 5, 6, 7)))]
    assert plan.placements["t"].spread == "nvlink"


def test_a_four_gpu_task_prefers_the_domain_it_fills_exactly() -> None:
    c = cluster(node("n1").gpus(8).nvlink_domains(2))
    c.running(job("busy").gpus(4).build(), on=[("n1", [0, 1, 2, 3])])
    c.pending(job("t").gpus(4).build(), "t")

    plan = run_cycle(c.snapshot())

    assert gpus_of(plan, "t") == [("n1", tuple(gpu_uuid("n1", i) for i in (4, 5, 6, 7)))]


def test_a_gang_that_needs_one_rack_lands_in_one_rack() -> None:
    c = cluster(node("a1").gpus(8).rack("r1"), node("b1").gpus(8).rack("r2"), node("b2").gpus(8).rack("r2"))
    c.pending(job("train").gpus(8).tasks(2).topology("rack").build(), "train")

    plan = run_cycle(c.snapshot())

    assert nodes_of(plan, "train") == {"b1", "b2"}
    assert plan.placements["train"].spread == "rack"


def test_a_gang_that_needs_one_rack_waits_when_no_rack_has_room() -> None:
    c = cluster(node("a1").gpus(8).rack("r1"), node("b1").gpus(8).rack("r2"))
    c.pending(job("train").gpus(8).tasks(2).topology("rack").build(), "train")

    plan = run_cycle(c.snapshot())

    assert plan.placements == {}
    assert "within one rack" in plan.unschedulable["train"]


def test_a_gang_prefers_one_node_over_several() -> None:
    c = cluster(node("n1").gpus(8).rack("r1"), node("n2").gpus(8).rack("r1"))
    c.running(job("busy").gpus(2).build(), on=[("n1", [0, 1])])
    c.pending(job("train").gpus(2).tasks(4).build(), "train")

    plan = run_cycle(c.snapshot())

    assert nodes_of(plan, "train") == {"n2"}
    assert plan.placements["train"].spread in ("node", "nvlink")


def test_topology_node_keeps_the_gang_on_one_node_or_waits() -> None:
    c = cluster(node("n1").gpus(4), node("n2").gpus(4))
    c.pending(job("train").gpus(2).tasks(4).topology("node").build(), "train")

    plan = run_cycle(c.snapshot())

    assert plan.placements == {}
    assert plan.unschedulable["train"].startswith("needs 4 tasks × 2 GPUs within one node")


# --- sharing and MIG --------------------------------------------------------------------


def test_fractional_shares_never_add_up_to_more_than_a_gpu() -> None:
    c = cluster(node("n1").gpus(1))
    for name in ("a", "b", "c"):
        c.pending(job(name).gpus(0.4).build(), name)

    plan = run_cycle(c.snapshot())

    assert set(plan.placements) == {"a", "b"}
    shares = [g.milli for p in plan.placements.values() for t in p.tasks for g in t.gpus]
    assert shares == [400, 400] and sum(shares) <= 1000
    assert plan.unschedulable["c"].startswith("needs 0.4 of a GPU; largest free share is 0.2 of a GPU on n1")


WHOLE_AND_HALF = (TypicalShape(0, 1000, 1, (), 0.5), TypicalShape(0, 500, 1, (), 0.5))


@pytest.mark.parametrize("policy", [Policy("bestfit"), Policy("fgd", typical=WHOLE_AND_HALF)], ids=["bestfit", "fgd"])
def test_a_shared_gpu_is_filled_before_a_fresh_one(policy: Policy) -> None:
    c = cluster(node("n1").gpus(2))
    c.running(job("infer").gpus(0.5).build(), on=[("n1", [1])])
    c.pending(job("small").gpus(0.5).build(), "small")

    plan = run_cycle(c.snapshot(), policy)

    assert gpus_of(plan, "small") == [("n1", (gpu_uuid("n1", 1),))]


def test_a_mig_task_takes_one_free_slice_of_its_profile() -> None:
    c = cluster(node("n1").gpus(1, model="A100").mig(0, "1g.10gb", "1g.10gb", "2g.20gb"))
    c.running(job("infer").mig("1g.10gb").build(), on=[("n1", [0])])
    c.pending(job("a").mig("1g.10gb").build(), "a")
    c.pending(job("b").mig("1g.10gb").build(), "b")
    c.pending(job("whole").gpus(1).build(), "whole")

    plan = run_cycle(c.snapshot())

    [share] = plan.placements["a"].tasks[0].gpus
    assert (share.uuid, share.mig_profile) == ("MIG-n1-0-1", "1g.10gb")
    assert plan.unschedulable["b"].startswith("needs a MIG 1g.10gb slice; no 1g.10gb slice is free")
    assert "whole" in plan.unschedulable  # a GPU in MIG mode is never handed out whole


# --- heterogeneity and node state ----------------------------------------------------


CONSTRAINTS = [
    pytest.param(job("m").gpus(1).models("A100"), "a100", id="model"),
    pytest.param(job("m").gpus(1).min_gpu_memory(60000), "h100", id="gpu-memory"),
    pytest.param(job("m").gpus(1).min_cc("9.0"), "h100", id="compute-capability"),
    pytest.param(job("m").gpus(1).selector(pool="serve"), "a100", id="node-selector"),
    pytest.param(job("m").gpus(1).cpu(100_000), "a100", id="cpu"),
    pytest.param(job("m").gpus(1).mem(1_500_000), "h100", id="memory"),
]


@pytest.mark.parametrize("spec, expected", CONSTRAINTS)
def test_a_constraint_sends_the_job_to_the_only_node_that_meets_it(spec, expected: str) -> None:
    c = cluster(
        node("h100").gpus(8, model="H100", memory_mib=81920, cc="9.0").cpu(64_000).mem(2_000_000),
        node("a100").gpus(8, model="A100", memory_mib=40960, cc="8.0").cpu(256_000).mem(1_000_000).labels(pool="serve"),
    )
    c.pending(spec.build(), "m")

    plan = run_cycle(c.snapshot())

    assert nodes_of(plan, "m") == {expected}


def test_a_label_nobody_has_is_named() -> None:
    c = cluster(node("n1").gpus(8).labels(pool="train"))
    c.pending(job("m").gpus(1).selector(pool="serve").build(), "m")

    plan = run_cycle(c.snapshot())

    assert plan.unschedulable["m"] == "needs 1 GPU on nodes labelled pool=serve; no schedulable node is labelled pool=serve"


def test_a_cluster_without_schedulable_nodes_says_so() -> None:
    empty = cluster()
    empty.pending(job("g").gpus(8).tasks(2).build(), "g")
    parked = cluster(node("c").gpus(8), node("d").gpus(8))
    parked.cordon("c").drain("d")
    parked.pending(job("g").gpus(8).tasks(2).build(), "g")

    assert run_cycle(empty.snapshot()).unschedulable["g"] == "needs 2 tasks × 8 GPUs; no schedulable node yet"
    assert run_cycle(parked.snapshot()).unschedulable["g"] == (
        "needs 2 tasks × 8 GPUs; no schedulable node (cordoned, draining or lost: c, d)")


def test_cordoned_draining_and_lost_nodes_and_sick_gpus_are_never_used() -> None:
    c = cluster(node("c").gpus(8), node("d").gpus(8), node("l").gpus(8), node("ok").gpus(2))
    c.cordon("c").drain("d").lose("l").sick_gpu("ok", 0)
    c.pending(job("one").gpus(1).build(), "one")
    c.pending(job("two").gpus(1).build(), "two")

    plan = run_cycle(c.snapshot())

    assert gpus_of(plan, "one") == [("ok", (gpu_uuid("ok", 1),))]
    assert "two" in plan.unschedulable


def test_a_model_nobody_has_is_explained_with_what_there_is() -> None:
    c = cluster(node("n1").gpus(8, model="H100"), node("n2").gpus(8, model="H200"))
    c.cordon("n2")
    c.pending(job("m").gpus(1).models("H200").build(), "m")

    plan = run_cycle(c.snapshot())

    assert plan.unschedulable["m"] == (
        "needs 1 GPU of model H200; no schedulable node offers GPU model H200 "
        "(schedulable GPU models: H100); matching but unavailable: n2"
    )


def test_the_reason_names_the_largest_free_block() -> None:
    c = cluster(node("n-1").gpus(8), node("n-3").gpus(8).nvlink_domains(2))
    c.running(job("busy").gpus(8).time_limit(600).build(), on=[("n-1", list(range(8)))])
    c.running(job("busy").gpus(4).build(), on=[("n-3", [4, 5, 6, 7])])
    c.pending(job("big").gpus(8).models("H100").topology("nvlink").build(), "big")

    plan = run_cycle(c.snapshot(now=100), now=100)

    assert plan.unschedulable["big"] == (
        "needs 8 GPUs of model H100 in one NVLink domain; largest free block is 4 on n-3; "
        "next in line: held to start on n-1 in 500 s"
    )


def test_a_full_cluster_is_named_as_such_and_of_that_kind_only_for_a_job_that_asks_for_a_kind() -> None:
    """'no GPU of that kind is free' was said to a job that asked for no kind of GPU at all."""
    c = cluster(node("n1").gpus(8))
    c.running(job("busy").gpus(8).build(), on=[("n1", list(range(8)))])
    c.pending(job("any").gpus(8).build(), "any")
    c.pending(job("h100").gpus(8).models("H100").build(), "h100")
    c.pending(job("half").gpus(0.5).build(), "half")

    plan = run_cycle(c.snapshot(now=100), now=100)

    assert plan.unschedulable["any"] == ("needs 8 GPUs; no GPU is free; next in line: held to start on n1 when jobs "
                                         "without a time limit end there")
    assert plan.unschedulable["h100"].startswith("needs 8 GPUs of model H100; no GPU of that kind is free")
    assert "no GPU has room" in plan.unschedulable["half"], plan.unschedulable["half"]


def test_cpu_shortage_is_named_when_the_gpus_would_do() -> None:
    c = cluster(node("n1").gpus(8).cpu(8_000), node("n2").gpus(8).cpu(8_000))
    c.running(job("cpu-hog").gpus(0).cpu(6_000).build(), on=[("n1", [])])
    c.running(job("cpu-hog").gpus(0).cpu(6_000).build(), on=[("n2", [])])
    c.pending(job("now").gpus(1).cpu(4_000).build(), "now")
    c.pending(job("never").gpus(1).cpu(10_000).build(), "never")

    plan = run_cycle(c.snapshot(), Policy(backfill=False))

    assert plan.unschedulable["now"] == (
        "needs 1 GPU; largest free block is 8 on n2; n2 has the GPUs but only 2000 mCPU free (needs 4000)"
    )
    assert plan.unschedulable["never"] == (
        "needs 1 GPU; no node has the CPU and memory for a task, even when idle; "
        "n2 has the GPUs but only 8000 mCPU free (needs 10000)"
    )


# --- order ---------------------------------------------------------------------------------


def test_higher_priority_goes_first_within_a_queue() -> None:
    c = cluster(node("n1").gpus(1))
    c.pending(job("old").gpus(1).build(), "old", at=1)
    c.pending(job("urgent").gpus(1).priority("high").build(), "urgent", at=2)

    plan = run_cycle(c.snapshot(), Policy(backfill=False))

    assert set(plan.placements) == {"urgent"}


def test_the_queue_furthest_below_its_entitlement_goes_first() -> None:
    c = cluster(node("n1").gpus(2))
    c.running(job("a").gpus(1).queue("rich").build(), on=[("n1", [0])])
    c.pending(job("r").gpus(1).queue("rich").build(), "r", at=1)
    c.pending(job("p").gpus(1).queue("poor").build(), "p", at=2)

    plan = run_cycle(c.snapshot(entitlements={"rich": 1, "poor": 1}), Policy(backfill=False))

    assert set(plan.placements) == {"p"}


def test_queues_are_ordered_by_dominant_share_so_a_cpu_heavy_queue_counts_its_cpus() -> None:
    # 16 GPUs and 64 CPUs: 4 CPUs per GPU. "cpu" holds 1 GPU and 32 CPUs (half the cluster: 8 GPU-equivalents),
    # "gpu" holds 4 GPUs; by GPUs alone "cpu" would look further below an equal entitlement and go first
    c = cluster(node("n1").gpus(8).cpu(32_000), node("n2").gpus(8).cpu(32_000))
    c.running(job("heavy").gpus(1).cpu(32_000).queue("cpu").build(), on=[("n1", [0])])
    c.running(job("four").gpus(4).queue("gpu").build(), on=[("n2", [0, 1, 2, 3])])
    c.pending(job("c").gpus(1).queue("cpu").build(), "c", at=1)
    c.pending(job("g").gpus(1).queue("gpu").build(), "g", at=2)
    snap = c.snapshot(entitlements={"cpu": 8, "gpu": 8})
    engine = Cycle(snap, Policy(backfill=False), 0.0)

    assert engine.allocated == {"cpu": 8.0, "gpu": 4.0}
    assert [j.job_id for j in engine.order()] == ["g", "c"]


def test_queues_take_turns_by_how_far_below_their_entitlement_they_are_after_each_job_placed() -> None:
    # a holds 0 of 8, b holds 2 of 8, four GPUs free: a takes two (0/8, then 1/8, both below b's 2/8), then the
    # name breaks the tie at 2/8 (a), then b is further below (2/8 < 3/8): a1, a2, a3, b1. All stay within their
    # entitlement, so none borrows.
    c = cluster(node("n1").gpus(4), node("n2").gpus(2))
    c.running(job("held").gpus(2).queue("b").build(), on=[("n2", [0, 1])], job_id="held")
    for i in range(1, 5):
        c.pending(job(f"a{i}").gpus(1).queue("a").build(), f"a{i}", at=i)
        c.pending(job(f"b{i}").gpus(1).queue("b").build(), f"b{i}", at=i)
    plan = run_cycle(c.snapshot(entitlements={"a": 8, "b": 8}), Policy(backfill=False), 0.0)
    assert sorted(plan.placements) == ["a1", "a2", "a3", "b1"]
    # the other way round, two GPUs free: b (0/8) goes first and twice, though a comes first by name
    c = cluster(node("n1").gpus(2), node("n2").gpus(2))
    c.running(job("held").gpus(2).queue("a").build(), on=[("n2", [0, 1])], job_id="held")
    for i in range(1, 3):
        c.pending(job(f"a{i}").gpus(1).queue("a").build(), f"a{i}", at=i)
        c.pending(job(f"b{i}").gpus(1).queue("b").build(), f"b{i}", at=i)
    plan = run_cycle(c.snapshot(entitlements={"a": 8, "b": 8}), Policy(backfill=False), 0.0)
    assert sorted(plan.placements) == ["b1", "b2"]


# --- backfill ------------------------------------------------------------------------------


def backfill_cluster(*extra):
    """n1 frees up at t=1000, n2 at t=5000: "big" (2 x 8 H100) is next in line, reserved from t=5000."""
    c = cluster(node("n1").gpus(8), node("n2").gpus(8), *extra)
    c.running(job("r1").gpus(8).time_limit(1000).build(), on=[("n1", list(range(8)))], job_id="r1")
    c.running(job("r2").gpus(4).time_limit(5000).build(), on=[("n2", [0, 1, 2, 3])], job_id="r2")
    c.pending(job("big").gpus(8).tasks(2).models("H100").build(), "big", at=1)
    return c


def test_backfill_starts_a_job_that_ends_before_the_reservation() -> None:
    c = backfill_cluster()
    c.pending(job("short").gpus(4).time_limit(3000).build(), "short", at=2)

    plan = run_cycle(c.snapshot())

    assert plan.reservation is not None
    assert (plan.reservation.job_id, plan.reservation.start) == ("big", 5000)
    assert nodes_of(plan, "short") == {"n2"}


@pytest.mark.parametrize("limit", [None, 9000], ids=["no-time-limit", "limit-past-the-reservation"])
def test_backfill_holds_back_a_job_that_would_delay_the_reservation(limit: int | None) -> None:
    c = backfill_cluster()
    spec = job("long").gpus(4)
    c.pending((spec.time_limit(limit) if limit else spec).build(), "long", at=2)

    plan = run_cycle(c.snapshot())

    assert "long" not in plan.placements
    assert plan.unschedulable["long"].startswith("the free capacity it fits is held for big on n")


def test_backfill_lets_a_long_job_use_what_the_reservation_does_not_need() -> None:
    c = backfill_cluster(node("n3").gpus(8, model="L4"))
    c.pending(job("long").gpus(4).build(), "long", at=2)

    plan = run_cycle(c.snapshot())

    assert nodes_of(plan, "long") == {"n3"}


def test_without_backfill_any_job_that_fits_starts() -> None:
    c = backfill_cluster()
    c.pending(job("long").gpus(4).build(), "long", at=2)

    plan = run_cycle(c.snapshot(), Policy(backfill=False))

    assert plan.reservation is None
    assert "long" in plan.placements


# --- preemption ---------------------------------------------------------------------------


def preemption_cluster():
    c = cluster(node("n1").gpus(8), node("n2").gpus(8))
    c.running(job("old").gpus(4).priority("low").build(), on=[("n1", [0, 1, 2, 3])], job_id="old", started_at=0)
    c.running(job("mid").gpus(4).priority("low").build(), on=[("n1", [4, 5, 6, 7])], job_id="mid", started_at=90)
    c.running(job("new").gpus(8).priority("low").build(), on=[("n2", list(range(8)))], job_id="new", started_at=99)
    return c


def test_preemption_evicts_the_cheapest_gangs_that_free_the_shape() -> None:
    c = preemption_cluster()
    c.pending(job("urgent").gpus(8).priority("high").build(), "urgent")

    plan = run_cycle(c.snapshot(now=100), now=100)

    # n2 costs 8 GPUs x 1 s; n1 would cost 4 x 100 s + 4 x 10 s
    assert [(p.job_id, p.for_job, p.grace_s) for p in plan.preemptions] == [("new", "urgent", 30)]
    assert "urgent" not in plan.placements
    assert plan.unschedulable["urgent"] == "waiting for preemption of new (grace 30 s)"


def test_preemption_takes_several_small_gangs_when_that_is_cheaper() -> None:
    c = cluster(node("n1").gpus(8), node("n2").gpus(8))
    c.running(job("a").gpus(4).priority("low").build(), on=[("n1", [0, 1, 2, 3])], job_id="a", started_at=99)
    c.running(job("b").gpus(4).priority("low").build(), on=[("n1", [4, 5, 6, 7])], job_id="b", started_at=99)
    c.running(job("long").gpus(8).priority("low").build(), on=[("n2", list(range(8)))], job_id="long", started_at=0)
    c.pending(job("urgent").gpus(8).priority("high").build(), "urgent")

    plan = run_cycle(c.snapshot(now=100), now=100)

    assert sorted(p.job_id for p in plan.preemptions) == ["a", "b"]  # 8 GPU-seconds, not 800


def test_preemption_never_evicts_equal_or_higher_priority() -> None:
    c = cluster(node("n1").gpus(8))
    c.running(job("peer").gpus(4).priority("high").build(), on=[("n1", [0, 1, 2, 3])], job_id="peer")
    c.running(job("boss").gpus(4).priority("critical").build(), on=[("n1", [4, 5, 6, 7])], job_id="boss")
    c.pending(job("urgent").gpus(4).priority("high").build(), "urgent")

    plan = run_cycle(c.snapshot(), Policy(preemptible_below=4))

    assert plan.preemptions == ()
    assert "urgent" in plan.unschedulable


def test_only_preemptible_priorities_are_evicted_by_default() -> None:
    c = cluster(node("n1").gpus(8))
    c.running(job("steady").gpus(8).priority("normal").build(), on=[("n1", list(range(8)))], job_id="steady")
    c.pending(job("urgent").gpus(8).priority("critical").build(), "urgent")

    assert run_cycle(c.snapshot()).preemptions == ()
    assert [p.job_id for p in run_cycle(c.snapshot(), Policy(preemptible_below=3)).preemptions] == ["steady"]


def test_preemption_stays_inside_the_queue_unless_allowed() -> None:
    c = cluster(node("n1").gpus(8))
    c.running(job("other").gpus(8).priority("low").queue("vision").build(), on=[("n1", list(range(8)))], job_id="other")
    c.pending(job("urgent").gpus(8).priority("high").queue("nlp").build(), "urgent")

    assert run_cycle(c.snapshot()).preemptions == ()
    plan = run_cycle(c.snapshot(), Policy(cross_queue_preemption=True))
    assert [p.job_id for p in plan.preemptions] == ["other"]


def test_two_preemptors_do_not_count_the_same_victim_twice() -> None:
    c = cluster(node("n1").gpus(8))
    c.running(job("victim").gpus(8).priority("low").build(), on=[("n1", list(range(8)))], job_id="victim")
    c.pending(job("u1").gpus(8).priority("high").build(), "u1", at=1)
    c.pending(job("u2").gpus(8).priority("high").build(), "u2", at=2)

    plan = run_cycle(c.snapshot())

    assert [(p.job_id, p.for_job) for p in plan.preemptions] == [("victim", "u1")]
    assert plan.unschedulable["u1"].startswith("waiting for preemption of victim")
    assert not plan.unschedulable["u2"].startswith("waiting for preemption")


def test_a_gang_preempts_the_cheapest_whole_nodes_it_needs() -> None:
    c = cluster(node("n1").gpus(8), node("n2").gpus(8), node("n3").gpus(8))
    for n, started in (("n1", 0), ("n2", 90), ("n3", 95)):
        c.running(job(f"on-{n}").gpus(8).priority("low").build(), on=[(n, list(range(8)))], job_id=f"on-{n}",
                  started_at=started)
    c.pending(job("urgent").gpus(8).tasks(2).priority("high").build(), "urgent")

    plan = run_cycle(c.snapshot(now=100), now=100)

    assert sorted(p.job_id for p in plan.preemptions) == ["on-n2", "on-n3"]


# --- reclaim -------------------------------------------------------------------------------


def test_reclaim_evicts_gangs_of_queues_over_their_entitlement() -> None:
    c = cluster(node("n1").gpus(8))
    c.running(job("b1").gpus(4).queue("borrower").build(), on=[("n1", [0, 1, 2, 3])], job_id="b1", started_at=50)
    c.running(job("b2").gpus(2).queue("borrower").build(), on=[("n1", [4, 5])], job_id="b2", started_at=0)
    c.running(job("o1").gpus(2).queue("owner").build(), on=[("n1", [6, 7])], job_id="o1")
    alone = reclaim(c.snapshot(now=100, entitlements={"owner": 6, "borrower": 2}), [("owner", 4)], now=100)
    c.pending(job("o2").gpus(4).queue("owner").build(), "o2")

    plan = run_cycle(
        c.snapshot(now=100, entitlements={"owner": 6, "borrower": 2}), now=100,
        reclaims=[ReclaimRequest("owner", 4)],
    )

    assert [(p.job_id, p.for_queue) for p in plan.preemptions] == [("b1", "owner")]
    assert alone == plan.preemptions, "alone, by amount: the cheapest gangs up to what is owed"


def test_reclaim_never_lifts_the_owed_queue_above_what_it_is_owed_nor_evicts_for_jobs_placed_anyway() -> None:
    c = cluster(node("n1").gpus(8), node("n2").gpus(8))
    for g in range(8):
        c.running(job(f"b{g}").gpus(1).queue("borrower").build(), on=[("n2", [g])], job_id=f"b{g}", started_at=0)
    c.running(job("o").gpus(2).queue("owner").build(), on=[("n1", [0, 1])], job_id="o")
    c.pending(job("big").gpus(8).queue("owner").build(), "big", at=1)
    snap = c.snapshot(now=100, entitlements={"owner": 4, "borrower": 0})  # the borrower may lose all 8
    # owed 2: the 8-GPU job would take the owner to 10 of its 4, and churn back next cycle
    assert run_cycle(snap, Policy(preempt=False), 100, [ReclaimRequest("owner", 2)]).preemptions == ()
    c.pending(job("small").gpus(2).queue("owner").build(), "small", at=2)
    # 6 GPUs are free on n1: the small job is placed this cycle, nothing needs evicting for it
    plan = run_cycle(c.snapshot(now=100, entitlements={"owner": 4, "borrower": 0}), Policy(preempt=False), 100,
                     [ReclaimRequest("owner", 2)])
    assert "small" in plan.placements and plan.preemptions == ()


def test_a_job_that_would_borrow_comes_after_one_within_its_queue_s_floor_so_reclaim_does_not_churn() -> None:
    # as with gpuorch up: research (guarantee 8, entitled 15) and prod (guarantee 16, entitled 9) each held 8; reclaim
    # evicted research's r3 for prod's 1-GPU llm. research, further below its entitlement, came first, and r3 took its
    # 8 GPUs back (16 > 15), leaving llm waiting; reclaim evicted again: six evictions in two seconds
    c = cluster(node("n1").gpus(8), node("n2").gpus(8), node("n3").gpus(8))
    c.running(job("r2").gpus(8).priority("low").queue("research").build(), on=[("n1", list(range(8)))], job_id="r2")
    c.running(job("p1").gpus(8).queue("prod").build(), on=[("n3", list(range(8)))], job_id="p1")
    c.pending(job("r3").gpus(8).priority("low").queue("research").build(), "r3", at=0)
    c.pending(job("small").gpus(2).priority("low").queue("research").build(), "small", at=1)
    c.pending(job("llm").gpus(1).queue("prod").build(), "llm", at=5)
    snap = c.snapshot(now=100, entitlements={"prod": 9, "research": 15}, floors={"prod": 9, "research": 8})

    assert [j.job_id for j in Cycle(snap, Policy(), 100).order()] == ["llm", "r3", "small"], \
        "research is at its floor (guarantee 8): its jobs borrow and come after prod's, which is below its floor"
    plan = run_cycle(snap, Policy(), 100)
    assert sorted(plan.placements) == ["llm"] and plan.preemptions == (), plan.unschedulable
    assert plan.unschedulable["small"].startswith("the free capacity it fits is held for r3 on n2")
    # research below its entitlement (12 of 15) yet above its floor (8) after reclaim took 4 of its 12: its victim
    # would come back first by entitlement (8 / 15 against prod's 8 / 9), and churn again
    c = cluster(node("n1").gpus(8), node("n2").gpus(8), node("n3").gpus(8))
    c.running(job("r2").gpus(8).queue("research").build(), on=[("n1", list(range(8)))], job_id="r2")
    c.running(job("p1").gpus(8).queue("prod").build(), on=[("n3", list(range(8)))], job_id="p1")
    c.running(job("other").gpus(4).queue("default").build(), on=[("n2", [4, 5, 6, 7])], job_id="other")
    c.pending(job("victim").gpus(4).queue("research").build(), "victim", at=0)
    c.pending(job("llm").gpus(1).queue("prod").build(), "llm", at=5)
    snap = c.snapshot(now=100, entitlements={"prod": 9, "research": 15, "default": 0},
                      floors={"prod": 9, "research": 8, "default": 0})
    plan = run_cycle(snap, Policy(), 100)
    assert sorted(plan.placements) == ["llm"], plan.unschedulable
    # research below its floor (4 of 8): its 8-GPU job would take it to 12 and borrows; prod's 1-GPU job goes first
    c = cluster(node("n1").gpus(8), node("n2").gpus(8), node("n3").gpus(8))
    c.running(job("r-half").gpus(4).queue("research").build(), on=[("n1", [0, 1, 2, 3])], job_id="r-half")
    c.running(job("other").gpus(4).queue("default").build(), on=[("n1", [4, 5, 6, 7])], job_id="other")
    c.running(job("p1").gpus(8).queue("prod").build(), on=[("n3", list(range(8)))], job_id="p1")
    c.pending(job("big").gpus(8).queue("research").build(), "big", at=0)
    c.pending(job("llm").gpus(1).queue("prod").build(), "llm", at=5)
    snap = c.snapshot(now=100, entitlements={"prod": 9, "research": 15, "default": 0},
                      floors={"prod": 9, "research": 8, "default": 0})
    assert sorted(run_cycle(snap, Policy(), 100).placements) == ["llm"]
    # with room for all, one that borrows is still placed: the cluster stays work-conserving
    roomy = cluster(node("n1").gpus(8), node("n2").gpus(8), node("n3").gpus(8), node("n4").gpus(8))
    roomy.running(job("r2").gpus(8).queue("research").build(), on=[("n1", list(range(8)))], job_id="r2")
    roomy.pending(job("r3").gpus(8).queue("research").build(), "r3", at=0)
    roomy.pending(job("llm").gpus(1).queue("prod").build(), "llm", at=5)
    plan = run_cycle(roomy.snapshot(now=100, entitlements={"prod": 9, "research": 15}), Policy(), 100)
    assert sorted(plan.placements) == ["llm", "r3"]


def test_a_job_larger_than_what_its_queue_is_owed_is_told_that_reclaim_stops_at_the_guarantee() -> None:
    # as with gpuorch up: prod (guarantee 8) holds 4 and waits with an 8-GPU job; research borrowed 20 of 24.
    # Reclaim lifts prod only to 8 (owed 4), so nothing is evicted; the reason said only "largest free block is 4"
    c = cluster(node("n1").gpus(8), node("n2").gpus(8), node("n3").gpus(8))
    for i, n in enumerate(("n1", "n1", "n2", "n2", "n3")):
        c.running(job(f"r{i}").gpus(4).queue("research").build(), on=[(n, [4 * ((i + 1) % 2) + g for g in range(4)])],
                  job_id=f"r{i}")
    c.running(job("p1").gpus(4).queue("prod").build(), on=[("n3", [0, 1, 2, 3])], job_id="p1")
    c.pending(job("p2").gpus(8).queue("prod").build(), "p2")
    ent, floors = {"prod": 12, "research": 12}, {"prod": 8, "research": 8}
    owed = reclaim_requests({"prod": QueueSpec(guaranteed=GpuAmount(gpus=8)),
                             "research": QueueSpec(guaranteed=GpuAmount(gpus=8))},
                            {"prod": 4, "research": 20}, {"prod": 8}, ent, {"prod": 8})
    assert owed == [], "owed 4, less than the smallest waiting job: no request"

    plan = run_cycle(c.snapshot(now=100, entitlements=ent, floors=floors), Policy(preempt=False), 100, owed)

    assert plan.preemptions == ()
    assert plan.unschedulable["p2"].endswith(
        "; its queue prod holds 4 of the 8 GPUs guaranteed to it, and reclaim takes back at most the 4 that lift it to "
        "that, not this job's 8"), plan.unschedulable["p2"]
    c.pending(job("p3").gpus(4).queue("prod").build(), "p3", at=1)  # one that fits what is owed gets the reclaim
    plan = run_cycle(c.snapshot(now=100, entitlements=ent, floors=floors), Policy(preempt=False), 100, [])
    assert "takes back" not in plan.unschedulable["p3"], "not asked for yet (it has not waited long enough)"
    plan = run_cycle(c.snapshot(now=100, entitlements=ent, floors=floors), Policy(preempt=False), 100,
                     [ReclaimRequest("prod", 4)])
    assert len(plan.preemptions) == 1 and "reclaimed for queue prod" in plan.unschedulable["p3"]
    assert "takes back at most" not in plan.unschedulable["p3"] and "takes back at most" in plan.unschedulable["p2"]
    c.pending(job("huge").gpus(16).queue("prod").build(), "huge", at=2)  # fits no node: reclaim is beside the point
    plan = run_cycle(c.snapshot(now=100, entitlements=ent, floors=floors), Policy(preempt=False), 100, [])
    assert "can never" in plan.unschedulable["huge"] and "takes back" not in plan.unschedulable["huge"]
    at_guarantee = {"prod": 4, "research": 8}  # prod's guarantee 4: it holds it
    plan = run_cycle(c.snapshot(now=100, entitlements=ent, floors=at_guarantee), Policy(preempt=False), 100, [])
    assert "takes back at most" not in plan.unschedulable["p2"], "a queue at its guarantee is owed nothing"


def test_a_job_that_priority_preemption_makes_room_for_gets_no_guarantee_note() -> None:
    # prod (floor 8) holds 4 as one low-priority job and waits with a high-priority 8-GPU job; 4 GPUs are free
    # beside its job: evicting its own job makes the room, so its reason says that, not that reclaim stops at the guarantee
    c = cluster(node("n1").gpus(8), node("n2").gpus(8), node("n3").gpus(8))
    for i, n in enumerate(("n1", "n1", "n2", "n2")):
        c.running(job(f"r{i}").gpus(4).queue("research").build(), on=[(n, [4 * (i % 2) + g for g in range(4)])],
                  job_id=f"r{i}")
    c.running(job("p1").gpus(4).priority("low").queue("prod").build(), on=[("n3", [0, 1, 2, 3])], job_id="p1")
    c.pending(job("p2").gpus(8).priority("high").queue("prod").build(), "p2")

    plan = run_cycle(c.snapshot(now=100, entitlements={"prod": 12, "research": 12},
                                floors={"prod": 8, "research": 8}), Policy(), 100, [])

    assert "preemption of" in plan.unschedulable["p2"], plan.unschedulable["p2"]
    assert "takes back at most" not in plan.unschedulable["p2"], plan.unschedulable["p2"]


def test_a_job_that_got_room_by_priority_preemption_gets_no_reclaim_victims_too() -> None:
    c = cluster(node("n1").gpus(8), node("n2").gpus(8))
    c.running(job("olow").gpus(8).priority("low").queue("owner").build(), on=[("n1", list(range(8)))], job_id="olow")
    c.running(job("b").gpus(8).queue("borrower").build(), on=[("n2", list(range(8)))], job_id="b")
    c.pending(job("hi").gpus(8).priority("high").queue("owner").build(), "hi")

    plan = run_cycle(c.snapshot(now=100, entitlements={"owner": 16, "borrower": 0}), Policy(), 100,
                     [ReclaimRequest("owner", 8)])

    assert [p.job_id for p in plan.preemptions] == ["olow"]
    assert "preemption of olow" in plan.unschedulable["hi"]


def test_reclaim_looks_past_a_victim_set_that_would_overdraw_a_queue() -> None:
    # "b" may lose 4 (holds 12, entitled 8): its young 8-GPU gang is the cheapest room but overdraws it;
    # "c" (entitled 0) and b's older 1-GPU gangs share n2: the owner's 4-GPU job gets room there
    c = cluster(node("n1").gpus(8), node("n2").gpus(8))
    c.running(job("b8").gpus(8).queue("b").build(), on=[("n1", list(range(8)))], job_id="b8", started_at=99)
    for g in range(4):
        c.running(job(f"b1-{g}").gpus(1).queue("b").build(), on=[("n2", [g])], job_id=f"b1-{g}", started_at=0)
        c.running(job(f"c-{g}").gpus(1).queue("c").build(), on=[("n2", [4 + g])], job_id=f"c-{g}", started_at=50)
    c.pending(job("w").gpus(4).queue("owner").build(), "w")

    plan = run_cycle(c.snapshot(now=100, entitlements={"owner": 4, "b": 8, "c": 0}), Policy(preempt=False), 100,
                     [ReclaimRequest("owner", 4)])

    victims = sorted(p.job_id for p in plan.preemptions)
    assert victims and "b8" not in victims and len(victims) == 4, victims


def test_reclaim_frees_room_the_waiting_job_can_use_not_the_cheapest_gpus_scattered() -> None:
    # two full nodes of borrowed 1-GPU jobs, on each 4 young (cheap) and 4 old; the owner waits with an 8-GPU job:
    # the 8 cheapest are spread over both nodes and would let nothing start; a whole node is what it needs
    c = cluster(node("n1").gpus(8), node("n2").gpus(8))
    for n in ("n1", "n2"):
        for g in range(8):
            c.running(job(f"{n}-{g}").gpus(1).queue("borrower").build(), on=[(n, [g])], job_id=f"{n}-{g}",
                      started_at=90 if g < 4 else 0)
    c.pending(job("big").gpus(8).queue("owner").build(), "big")

    plan = run_cycle(c.snapshot(now=100, entitlements={"owner": 8, "borrower": 8}), Policy(preempt=False), now=100,
                     reclaims=[ReclaimRequest("owner", 8)])

    victims = sorted(p.job_id for p in plan.preemptions)
    assert len(victims) == 8 and len({v.split("-")[0] for v in victims}) == 1, f"one whole node, not {victims}"
    assert "reclaimed for queue owner" in plan.unschedulable["big"]


# --- determinism and policies ----------------------------------------------------------


@pytest.mark.parametrize("policy", ["fgd", "bestfit", "binpack", "spread", "random", "dotprod", "gpupacking", "gpuclustering"])
def test_every_policy_places_and_repeats_itself(policy: str) -> None:
    c = cluster(*(node(f"n{i}").gpus(4).rack(f"r{i % 2}") for i in range(6)))
    for i, g in enumerate([0.5, 1, 2, 4, 0.25, 1, 3]):
        c.pending(job(f"j{i}").gpus(g).tasks(1 + i % 2).build(), f"j{i}")

    first = run_cycle(c.snapshot(), Policy(name=policy, seed=3))
    again = run_cycle(c.snapshot(), Policy(name=policy, seed=3))

    assert first == again
    assert len(first.placements) >= 5


def test_an_unknown_policy_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of fgd, bestfit"):
        Policy(name="tetris")


# --- FGD and the single-pod scorers (FGD_METHOD.md) ---------------------------------------


def test_fgd_score_is_truncated_to_an_integer() -> None:
    assert fgd_score(0, 0) == 50
    assert fgd_score(500, 0) == math.floor(100 / (1 + math.exp(-0.5))) == 62
    assert fgd_score(0, 500) == 37
    assert fgd_score(8000, 0) == 99


def test_typical_shapes_keep_the_popular_ninety_five_percent() -> None:
    counts = {(1000, 1000, 1, ()): 60, (2000, 500, 1, ()): 36, (4000, 1000, 8, ()): 4}
    shapes = typical_shapes(counts)
    assert [(t.gpu_milli, t.gpu_count) for t in shapes] == [(1000, 1), (500, 1)]
    assert math.isclose(sum(t.probability for t in shapes), 1.0)


def test_fgd_puts_a_sharing_pod_where_it_strands_least() -> None:
    typical = (TypicalShape(0, 1000, 1, (), 1.0),)
    nodes = [NodeFree("a", 1, "G2", 8000, 8000, [1000, 1000]), NodeFree("b", 0, "G2", 8000, 8000, [1000, 500])]
    scorer = NodeScorer("fgd", typical)
    pod = PodShape(cpu=100, count=1, milli=500)

    assert scorer.score(nodes[1], pod) == 62 and scorer.score(nodes[0], pod) == 37
    assert choose_node(nodes, pod, scorer) == (1, (1,))


def test_score_ties_go_to_the_smallest_node_priority() -> None:
    nodes = [NodeFree(f"n{i}", p, "G2", 8000, 8000, [1000] * 2) for i, p in enumerate([5, 2, 9])]
    pod = PodShape(cpu=100, count=1, milli=1000)
    for policy in ("fgd", "bestfit", "gpupacking", "dotprod"):
        assert choose_node(nodes, pod, NodeScorer(policy, (TypicalShape(0, 1000, 1, (), 1.0),)))[0] == 1


def test_exclusive_pods_take_the_first_free_gpus_and_memory_is_a_hard_limit() -> None:
    nodes = [NodeFree("a", 0, "G2", 8000, 100, [1000] * 4), NodeFree("b", 1, "G2", 8000, 8000, [0, 1000, 1000, 1000])]
    scorer = NodeScorer("bestfit")
    pod = PodShape(cpu=100, mem=200, count=2, milli=1000)

    idx, gpus = choose_node(nodes, pod, scorer)
    assert (idx, gpus) == (1, (1, 2))
    take(nodes[idx], pod, gpus)
    assert nodes[1].free == [0, 0, 0, 1000] and nodes[1].mem == 7800


def test_gpupacking_prefers_shared_gpus_then_used_nodes_then_small_idle_nodes() -> None:
    scorer = NodeScorer("gpupacking")
    pod = PodShape(cpu=1, count=1, milli=500)
    assert scorer.score(NodeFree("idle8", 0, "G2", 1, 1, [1000] * 8), pod) == 25
    assert scorer.score(NodeFree("idle4", 0, "G2", 1, 1, [1000] * 4), pod) == 29
    assert scorer.score(NodeFree("used", 0, "G2", 1, 1, [1000, 0]), pod) == 49
    assert scorer.score(NodeFree("shared", 0, "G2", 1, 1, [700, 0]), pod) == 93


def test_gpuclustering_groups_pods_of_one_shape() -> None:
    scorer = NodeScorer("gpuclustering")
    pod = PodShape(cpu=1, count=1, milli=500)
    same = NodeFree("same", 0, "G2", 1, 1, [500, 1000], {"share": 1})
    mixed = NodeFree("mixed", 1, "G2", 1, 1, [500, 0], {"share": 1, "1-gpu": 1})
    idle = NodeFree("idle", 2, "G2", 1, 1, [1000, 1000])
    assert (scorer.score(same, pod), scorer.score(mixed, pod), scorer.score(idle, pod)) == (75 + 20, 50 + 23, 25 + 18)


# --- the snapshot and the core's purity ----------------------------------------------------


def test_the_snapshot_shows_only_what_can_be_used() -> None:
    c = cluster(node("ok").gpus(2), node("off").gpus(2), node("mig").gpus(1, model="A100").mig(0, "1g.10gb"))
    c.cordon("off").sick_gpu("ok", 1)
    c.running(job("half").gpus(0.5).cpu(1000).build(), on=[("ok", [0])], job_id="half")
    c.pending(job("wait").gpus(1).build(), "wait")
    c.proj.jobs["gone"] = JobRecord("gone", c.proj.jobs["wait"].spec, state="succeeded")

    snap = c.snapshot(now=5)

    nodes = {n.node_id: n for n in snap.nodes}
    assert [g.free_milli for g in nodes["ok"].gpus] == [500, 0]
    assert nodes["ok"].cpu_free == 32_000 - 1000
    assert [g.free_milli for g in nodes["off"].gpus] == [0, 0] and not nodes["off"].schedulable
    assert nodes["mig"].gpus[0].free_milli == 0 and nodes["mig"].gpus[0].mig_slices[0].free
    assert [j.job_id for j in snap.pending] == ["wait"]
    assert [j.job_id for j in snap.running] == ["half"]


def test_the_snapshot_holds_the_same_job_states_as_the_cluster() -> None:
    from services.scheduler.snapshot import HOLDING
    from shared.cluster import ACTIVE

    assert HOLDING == ACTIVE


def test_the_core_imports_no_bus_web_or_database() -> None:
    import subprocess
    import sys

    code = (
        "import sys, services.scheduler.core, services.scheduler.snapshot; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'nats', 'fastapi', 'sqlmodel', 'uvicorn'}))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root).stdout
    assert out.strip() == "[]"
