"""The placement rules of the design, each stated so that breaking it fails a test: gangs, topology,
constraints, sharing, MIG, backfill, job and queue order.

``python -m bench.mutants`` breaks these rules one at a time in a copy of the code; the mutants each test
kills are named in docs/benchmarks/mutants.md. Expected outcomes are worked out by hand from the scenario
(GPU indices, node names, times), never by asking the code under test.
"""

from __future__ import annotations

import pytest

from services.scheduler.core import Plan, Policy, run_cycle
from tests.builders import cluster, gpu_uuid, job, node

NOW = 1_795_510_800.0  # a real clock reading (2026-11-24T09:00:00Z): times in a cycle are epoch seconds


def placed(plan: Plan, job_id: str) -> list[tuple[str, tuple[str, ...]]]:
    """(node, GPU uuids) per task, in rank order."""
    return [(t.node_id, tuple(g.uuid for g in t.gpus)) for t in plan.placements[job_id].tasks]


def uuids(node_id: str, *indices: int) -> tuple[str, ...]:
    return tuple(gpu_uuid(node_id, i) for i in indices)


# --- gangs: all tasks or none ----------------------------------------------------------------------------------


def test_a_gang_that_fits_on_one_node_gets_all_its_ranks_there() -> None:
    c = cluster(node("n1").gpus(8))
    c.pending(job("train").gpus(2).tasks(4).build(), "train")

    plan = run_cycle(c.snapshot())

    tasks = plan.placements["train"].tasks
    assert [t.task for t in tasks] == [0, 1, 2, 3]
    assert {t.node_id for t in tasks} == {"n1"}
    assert sorted(g.uuid for t in tasks for g in t.gpus) == sorted(uuids("n1", *range(8)))


def test_a_gang_over_two_nodes_places_every_rank_once() -> None:
    c = cluster(node("n1").gpus(8), node("n2").gpus(8))
    c.pending(job("train").gpus(4).tasks(4).build(), "train")

    plan = run_cycle(c.snapshot())

    tasks = plan.placements["train"].tasks
    assert [t.task for t in tasks] == [0, 1, 2, 3]
    assert sorted(t.node_id for t in tasks) == ["n1", "n1", "n2", "n2"]
    assert all(len(t.gpus) == 4 for t in tasks)


# --- topology levels -----------------------------------------------------------------------------------------------


def test_a_gang_that_must_stay_in_one_zone_waits_rather_than_cross_zones() -> None:
    c = cluster(node("a").gpus(8).zone("z1").rack("r1"), node("b").gpus(8).zone("z2").rack("r1"))
    c.pending(job("train").gpus(8).tasks(2).topology("zone").build(), "train")

    plan = run_cycle(c.snapshot())

    assert plan.placements == {}
    assert "within one zone" in plan.unschedulable["train"]


def test_racks_of_the_same_name_in_two_zones_are_two_racks() -> None:
    c = cluster(node("a").gpus(8).zone("z1").rack("r1"), node("b").gpus(8).zone("z2").rack("r1"))
    c.pending(job("train").gpus(8).tasks(2).topology("rack").build(), "train")

    plan = run_cycle(c.snapshot())

    assert plan.placements == {}
    assert "within one rack" in plan.unschedulable["train"]


def test_a_gang_that_must_stay_on_one_node_waits_rather_than_spread() -> None:
    c = cluster(node("n1").gpus(4), node("n2").gpus(4))
    c.pending(job("train").gpus(1).tasks(6).topology("node").build(), "train")

    plan = run_cycle(c.snapshot())

    assert plan.placements == {}
    assert "within one node" in plan.unschedulable["train"]


def test_an_nvlink_task_waits_rather_than_straddle_two_domains() -> None:
    c = cluster(node("n1").gpus(8).nvlink_domains(2))
    c.running(job("busy").gpus(1).build(), on=[("n1", [0])])
    c.running(job("busy").gpus(1).build(), on=[("n1", [4])])  # 3 + 3 free: six GPUs, no domain of four
    c.pending(job("t").gpus(4).topology("nvlink").build(), "t")

    plan = run_cycle(c.snapshot())

    assert plan.placements == {}
    assert "in one NVLink domain" in plan.unschedulable["t"]


@pytest.mark.parametrize("policy", ["binpack", "bestfit", "fgd"])
def test_a_four_gpu_task_passes_over_a_tighter_node_to_land_in_one_nvlink_domain(policy: str) -> None:
    # n1 is the tighter fit (4 GPUs left, 2 + 2), but only n2 has a whole domain of 4 free (GPUs 4-7)
    c = cluster(node("n1").gpus(8).nvlink_domains(2), node("n2").gpus(8).nvlink_domains(2))
    c.running(job("busy").gpus(2).build(), on=[("n1", [0, 1])])
    c.running(job("busy").gpus(2).build(), on=[("n1", [4, 5])])
    c.running(job("busy").gpus(1).build(), on=[("n2", [0])])
    c.pending(job("t").gpus(4).build(), "t")

    plan = run_cycle(c.snapshot(), Policy(name=policy))

    assert placed(plan, "t") == [("n2", uuids("n2", 4, 5, 6, 7))]
    assert plan.placements["t"].spread == "nvlink"


# --- constraints -----------------------------------------------------------------------------------------------


UNMET = [  # (the only node, a job it cannot take)
    pytest.param(node("n1").gpus(8, model="H100"), job("j").gpus(1).models("A100"), id="gpu-model"),
    pytest.param(node("n1").gpus(8, model="A100", memory_mib=40960), job("j").gpus(1).min_gpu_memory(60000),
                 id="gpu-memory"),
    pytest.param(node("n1").gpus(8, model="A100", cc="8.0"), job("j").gpus(1).min_cc("9.0"), id="compute-capability"),
    pytest.param(node("n1").gpus(8).labels(pool="train"), job("j").gpus(1).selector(pool="serve"), id="node-label"),
    pytest.param(node("n1").gpus(8).cpu(8_000), job("j").gpus(1).cpu(16_000), id="cpu"),
    pytest.param(node("n1").gpus(8).mem(100_000), job("j").gpus(1).mem(200_000), id="memory"),
]


@pytest.mark.parametrize("only, spec", UNMET)
def test_a_job_waits_rather_than_take_a_node_that_does_not_meet_its_constraint(only, spec) -> None:
    c = cluster(only)
    c.pending(spec.build(), "j")

    plan = run_cycle(c.snapshot())

    assert plan.placements == {}
    assert plan.unschedulable["j"].startswith("needs 1 GPU")


MET = [  # (a tighter node that does not meet the constraint, the roomier one that does, the job)
    pytest.param(node("tight").gpus(8, model="H100"), node("roomy").gpus(8, model="A100"),
                 job("j").gpus(1).models("A100"), id="gpu-model"),
    pytest.param(node("tight").gpus(8, model="A100", memory_mib=40960), node("roomy").gpus(8, memory_mib=81920),
                 job("j").gpus(1).min_gpu_memory(60000), id="gpu-memory"),
    pytest.param(node("tight").gpus(8, model="A100", cc="8.0"), node("roomy").gpus(8, cc="9.0"),
                 job("j").gpus(1).min_cc("9.0"), id="compute-capability"),
    pytest.param(node("tight").gpus(8).labels(pool="train"), node("roomy").gpus(8).labels(pool="serve"),
                 job("j").gpus(1).selector(pool="serve"), id="node-label"),
]


@pytest.mark.parametrize("policy", ["binpack", "bestfit"])
@pytest.mark.parametrize("tight, roomy, spec", MET)
def test_a_job_passes_over_the_tighter_node_that_does_not_meet_its_constraint(tight, roomy, spec, policy: str) -> None:
    c = cluster(tight, roomy)
    c.running(job("busy").gpus(7).build(), on=[("tight", list(range(7)))])  # one GPU left: the bin-packer's pick
    c.pending(spec.build(), "j")

    plan = run_cycle(c.snapshot(), Policy(name=policy))

    assert [n for n, _ in placed(plan, "j")] == ["roomy"]


# --- fractional GPUs and MIG ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["bestfit", "binpack", "fgd", "gpupacking"])
def test_a_share_never_lands_on_a_gpu_without_room_for_it(policy: str) -> None:
    c = cluster(node("n1").gpus(2))
    c.running(job("infer").gpus(0.8).build(), on=[("n1", [0])])  # GPU 0: 0.2 left
    c.pending(job("small").gpus(0.4).build(), "small")

    plan = run_cycle(c.snapshot(), Policy(name=policy))

    assert placed(plan, "small") == [("n1", uuids("n1", 1))]


@pytest.mark.parametrize("policy", ["bestfit", "fgd"])
def test_shares_fill_gpus_only_up_to_a_whole_one(policy: str) -> None:
    c = cluster(node("n1").gpus(2))
    c.running(job("infer").gpus(0.7).build(), on=[("n1", [0])])
    c.running(job("infer").gpus(0.5).build(), on=[("n1", [1])])
    for name in ("a", "b", "c"):
        c.pending(job(name).gpus(0.3).build(), name)

    plan = run_cycle(c.snapshot(), Policy(name=policy))

    # 0.3 left on GPU 0 and 0.5 on GPU 1: room for two shares of 0.3, one on each
    assert sorted(uuid for j in plan.placements for _, us in placed(plan, j) for uuid in us) == list(uuids("n1", 0, 1))
    assert len(plan.placements) == 2


def test_a_mig_task_takes_a_slice_of_its_own_profile_not_the_first_free_one() -> None:
    c = cluster(node("n1").gpus(1, model="A100").mig(0, "2g.20gb", "1g.10gb"))
    c.pending(job("infer").mig("1g.10gb").build(), "infer")

    plan = run_cycle(c.snapshot())

    [share] = plan.placements["infer"].tasks[0].gpus
    assert (share.uuid, share.mig_profile) == ("MIG-n1-0-1", "1g.10gb")


def test_mig_tasks_take_only_slices_of_their_profile_and_the_rest_wait() -> None:
    c = cluster(node("n1").gpus(1, model="A100").mig(0, "3g.40gb", "1g.10gb", "2g.20gb", "1g.10gb"))
    for name in ("a", "b", "c"):
        c.pending(job(name).mig("1g.10gb").build(), name)

    plan = run_cycle(c.snapshot())

    taken = sorted(t.gpus[0].uuid for p in plan.placements.values() for t in p.tasks)
    assert taken == ["MIG-n1-0-1", "MIG-n1-0-3"]
    assert list(plan.unschedulable) == ["c"] and "no 1g.10gb slice is free" in plan.unschedulable["c"]


# --- backfill ------------------------------------------------------------------------------------------------------


def reserved_cluster(now: float):
    """n1 frees up 1000 s from now, n2 4000 s from now: "big" (2 x 8 GPUs) is reserved from now + 4000 on both."""
    c = cluster(node("n1").gpus(8), node("n2").gpus(8))
    c.running(job("r1").gpus(8).time_limit(1100).build(), on=[("n1", list(range(8)))], job_id="r1",
              started_at=now - 100)
    c.running(job("r2").gpus(4).time_limit(4100).build(), on=[("n2", [0, 1, 2, 3])], job_id="r2",
              started_at=now - 100)
    c.pending(job("big").gpus(8).tasks(2).build(), "big", at=now - 50)
    return c


@pytest.mark.parametrize("now", [2000.0, NOW], ids=["small-clock", "epoch-clock"])
def test_a_job_that_would_outlast_the_reservations_start_counted_from_now_is_held_back(now: float) -> None:
    c = reserved_cluster(now)
    c.pending(job("late").gpus(4).time_limit(5000).build(), "late", at=now - 10)  # ends at now + 5000

    plan = run_cycle(c.snapshot(now), now=now)

    assert plan.reservation is not None and (plan.reservation.job_id, plan.reservation.start) == ("big", now + 4000)
    assert "late" not in plan.placements
    assert plan.unschedulable["late"].startswith("the free capacity it fits is held for big")


@pytest.mark.parametrize("now", [2000.0, NOW], ids=["small-clock", "epoch-clock"])
def test_a_job_that_ends_before_the_reservation_starts_backfills(now: float) -> None:
    c = reserved_cluster(now)
    c.pending(job("short").gpus(4).time_limit(3000).build(), "short", at=now - 10)  # ends at now + 3000

    plan = run_cycle(c.snapshot(now), now=now)

    assert placed(plan, "short") == [("n2", uuids("n2", 4, 5, 6, 7))]


def test_the_reservation_starts_when_enough_has_ended_not_when_everything_has() -> None:
    c = cluster(node("n1").gpus(8), node("n2").gpus(8), node("n3").gpus(8))
    for n, limit in (("n1", 1000), ("n2", 5000), ("n3", 9000)):
        c.running(job(f"on-{n}").gpus(8).time_limit(limit).build(), on=[(n, list(range(8)))], job_id=f"on-{n}")
    c.pending(job("big").gpus(8).build(), "big")

    plan = run_cycle(c.snapshot(0.0))

    assert plan.reservation is not None
    assert (plan.reservation.job_id, plan.reservation.start, plan.reservation.nodes) == ("big", 1000, ("n1",))


def test_jobs_behind_the_reserved_one_never_take_what_it_is_promised() -> None:
    c = cluster(node("n1").gpus(8))
    c.running(job("r").gpus(4).time_limit(1000).build(), on=[("n1", [0, 1, 2, 3])], job_id="r")
    c.pending(job("big").gpus(8).build(), "big", at=1)
    for i in range(4):  # no time limit: each would hold a GPU past t=1000, when big is to start
        c.pending(job(f"s{i}").gpus(1).build(), f"s{i}", at=2 + i)

    plan = run_cycle(c.snapshot(0.0))

    assert plan.placements == {}
    assert plan.reservation is not None and (plan.reservation.job_id, plan.reservation.start) == ("big", 1000)


# --- order: priority, then age; queues by fair share ---------------------------------------------------------------


def test_among_equal_priorities_the_older_job_goes_first_whatever_its_name() -> None:
    c = cluster(node("n1").gpus(1))
    c.pending(job("zeta").gpus(1).build(), "zeta", at=1)
    c.pending(job("alpha").gpus(1).build(), "alpha", at=2)

    plan = run_cycle(c.snapshot(), Policy(backfill=False))

    assert list(plan.placements) == ["zeta"]


def test_the_highest_priority_goes_first_however_young() -> None:
    c = cluster(node("n1").gpus(1))
    c.pending(job("old").gpus(1).priority("low").build(), "old", at=1)
    c.pending(job("mid").gpus(1).build(), "mid", at=2)
    c.pending(job("new").gpus(1).priority("critical").build(), "new", at=3)

    plan = run_cycle(c.snapshot(), Policy(backfill=False))

    assert list(plan.placements) == ["new"]


def test_the_queue_furthest_below_its_entitlement_goes_first_whatever_its_name() -> None:
    c = cluster(node("n1").gpus(2))
    c.running(job("held").gpus(1).queue("alpha").build(), on=[("n1", [0])])  # alpha: 1 of 1, zulu: 0 of 1
    c.pending(job("a").gpus(1).queue("alpha").build(), "a", at=1)
    c.pending(job("z").gpus(1).queue("zulu").build(), "z", at=2)

    plan = run_cycle(c.snapshot(entitlements={"alpha": 1, "zulu": 1}), Policy(backfill=False))

    assert list(plan.placements) == ["z"]


def test_queues_take_turns_as_their_shares_grow() -> None:
    c = cluster(node("n1").gpus(4))
    for i in range(4):  # every job of "a" is older than every job of "b"
        c.pending(job(f"a{i}").gpus(1).queue("a").build(), f"a{i}", at=i)
        c.pending(job(f"b{i}").gpus(1).queue("b").build(), f"b{i}", at=10 + i)

    plan = run_cycle(c.snapshot(entitlements={"a": 2, "b": 2}), Policy(backfill=False))

    assert sorted(plan.placements) == ["a0", "a1", "b0", "b1"]


def test_a_queue_holding_a_memory_heavy_job_counts_its_memory_in_the_order() -> None:
    # 16 GPUs and 2 TiB: 128 GiB per GPU. "mem" holds 1 GPU and 1 TiB (8 GPU-equivalents), "gpu" holds 4 GPUs:
    # by GPUs alone "mem" would look further below an equal entitlement and go first. Four GPUs are free.
    c = cluster(node("n1").gpus(8).mem(1_048_576), node("n2").gpus(8).mem(1_048_576))
    c.running(job("heavy").gpus(1).mem(1_048_576).queue("mem").build(), on=[("n1", [0])])
    c.running(job("rest").gpus(7).queue("other").build(), on=[("n1", [1, 2, 3, 4, 5, 6, 7])])
    c.running(job("four").gpus(4).queue("gpu").build(), on=[("n2", [0, 1, 2, 3])])
    c.pending(job("m").gpus(4).queue("mem").build(), "m", at=1)
    c.pending(job("g").gpus(4).queue("gpu").build(), "g", at=2)

    plan = run_cycle(c.snapshot(entitlements={"mem": 8, "gpu": 8, "other": 7}), Policy(backfill=False))

    assert list(plan.placements) == ["g"]
