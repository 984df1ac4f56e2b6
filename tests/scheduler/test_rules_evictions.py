"""The eviction rules of the design, each stated so that breaking it fails a test: priority preemption, quota
reclaim, the victims they choose, the guards that protect a victim, and the grace it gets.

``python -m bench.mutants`` breaks these rules one at a time in a copy of the code; the mutants each test
kills are named in docs/benchmarks/mutants.md. Victims are worked out by hand from the scenario: a job's
cost is its GPUs times the seconds it has run (``now`` - ``started_at``).
"""

from __future__ import annotations

from services.scheduler.core import Plan, Policy, ReclaimRequest, reclaim, run_cycle
from tests.builders import ClusterBuilder, cluster, job, node

NOW = 100.0


def evicted(plan: Plan) -> list[str]:
    return sorted(p.job_id for p in plan.preemptions)


def young_and_old(queue: str = "default", priority: str = "low") -> ClusterBuilder:
    """One full node: "young" (4 GPUs, 10 s old: costs 40) and "old" (4 GPUs, 100 s old: costs 400)."""
    c = cluster(node("n1").gpus(8))
    c.running(job("young").gpus(4).priority(priority).queue(queue).build(), on=[("n1", [0, 1, 2, 3])],
              job_id="young", started_at=90)
    c.running(job("old").gpus(4).priority(priority).queue(queue).build(), on=[("n1", [4, 5, 6, 7])],
              job_id="old", started_at=0)
    return c


# --- priority preemption respects the minimum runtime and the thrashing guard -----------------------------------


def test_priority_preemption_passes_over_a_job_younger_than_its_queues_min_runtime() -> None:
    c = young_and_old()
    c.pending(job("urgent").gpus(4).priority("high").build(), "urgent")

    plan = run_cycle(c.snapshot(NOW), Policy(min_runtime_s={"default": 60}), NOW)

    assert evicted(plan) == ["old"], "young has run 10 s of its 60: the dearer old job goes instead"
    assert evicted(run_cycle(c.snapshot(NOW), Policy(), NOW)) == ["young"], "without the guard: the cheapest"


def test_priority_preemption_passes_over_a_job_evicted_too_often_this_hour() -> None:
    c = young_and_old()
    c.proj.jobs["young"].preemptions = [10.0, 40.0, 70.0]
    c.pending(job("urgent").gpus(4).priority("high").build(), "urgent")

    assert evicted(run_cycle(c.snapshot(NOW), Policy(max_preemptions_per_hour=3), NOW)) == ["old"]
    assert evicted(run_cycle(c.snapshot(NOW), Policy(max_preemptions_per_hour=4), NOW)) == ["young"]


def test_a_job_evicted_three_times_more_than_an_hour_ago_may_be_evicted_again() -> None:
    c = young_and_old()
    c.proj.jobs["young"].preemptions = [-3700.0, -3650.0, -3600.0]  # 3600 s or more before now
    c.pending(job("urgent").gpus(4).priority("high").build(), "urgent")

    assert evicted(run_cycle(c.snapshot(NOW), Policy(max_preemptions_per_hour=3), NOW)) == ["young"]


def test_priority_preemption_waits_when_every_victim_is_protected() -> None:
    c = young_and_old()
    c.proj.jobs["old"].preemptions = [10.0, 20.0, 30.0]
    c.pending(job("urgent").gpus(4).priority("high").build(), "urgent")

    plan = run_cycle(c.snapshot(NOW), Policy(min_runtime_s={"default": 60}), NOW)

    assert plan.preemptions == ()
    assert "urgent" in plan.unschedulable


def test_the_min_runtime_counts_from_when_the_job_started_not_when_it_was_placed() -> None:
    c = young_and_old()
    c.proj.jobs["young"].placed_at = -500.0  # placed long ago, started 10 s ago (a slow image pull)
    c.pending(job("urgent").gpus(4).priority("high").build(), "urgent")

    plan = run_cycle(c.snapshot(NOW), Policy(min_runtime_s={"default": 60}), NOW)

    assert evicted(plan) == ["old"]


def test_reclaim_passes_over_a_job_younger_than_its_queues_min_runtime() -> None:
    c = young_and_old(queue="borrower", priority="normal")
    c.pending(job("w").gpus(4).queue("owner").build(), "w")

    plan = run_cycle(c.snapshot(NOW, {"owner": 4, "borrower": 0}), Policy(min_runtime_s={"borrower": 60}), NOW,
                     [ReclaimRequest("owner", 4)])

    assert evicted(plan) == ["old"]


# --- priority preemption: whom it may evict ------------------------------------------------------------------------


def test_a_job_already_leaving_is_not_preempted_again() -> None:
    c = cluster(node("n1").gpus(8))
    c.running(job("going").gpus(8).priority("low").build(), on=[("n1", list(range(8)))], job_id="going",
              state="preempting")
    c.pending(job("urgent").gpus(8).priority("high").build(), "urgent")

    plan = run_cycle(c.snapshot(NOW), Policy(), NOW)

    assert plan.preemptions == ()


# --- the victims: whole gangs, at least cost -----------------------------------------------------------------------


def test_a_gang_over_two_nodes_is_evicted_whole_and_frees_both() -> None:
    c = cluster(node("n1").gpus(8), node("n2").gpus(8))
    c.running(job("pair").gpus(8).tasks(2).priority("low").build(), on=[("n1", list(range(8))), ("n2", list(range(8)))],
              job_id="pair", started_at=99)
    c.pending(job("urgent").gpus(8).tasks(2).priority("high").build(), "urgent")

    plan = run_cycle(c.snapshot(NOW), Policy(), NOW)

    assert evicted(plan) == ["pair"]


def test_a_gang_of_two_tasks_on_one_node_frees_all_its_gpus() -> None:
    c = cluster(node("n1").gpus(8), node("n2").gpus(8))
    c.running(job("pair").gpus(4).tasks(2).priority("low").build(), on=[("n1", [0, 1, 2, 3]), ("n1", [4, 5, 6, 7])],
              job_id="pair", started_at=90)  # costs 8 x 10 = 80
    c.running(job("big").gpus(8).priority("low").build(), on=[("n2", list(range(8)))], job_id="big",
              started_at=0)  # costs 800
    c.pending(job("urgent").gpus(8).priority("high").build(), "urgent")

    plan = run_cycle(c.snapshot(NOW), Policy(), NOW)

    assert evicted(plan) == ["pair"]


def test_the_cost_of_a_victim_is_its_gpus_times_the_time_it_ran() -> None:
    c = cluster(node("n1").gpus(8))
    c.running(job("wide").gpus(6).priority("low").build(), on=[("n1", list(range(6)))], job_id="wide",
              started_at=80)  # 6 x 20 = 120
    c.running(job("narrow").gpus(2).priority("low").build(), on=[("n1", [6, 7])], job_id="narrow",
              started_at=50)  # 2 x 50 = 100
    c.pending(job("urgent").gpus(2).priority("high").build(), "urgent")

    assert evicted(run_cycle(c.snapshot(NOW), Policy(), NOW)) == ["narrow"]


def test_an_eight_gpu_job_that_ran_briefly_can_cost_more_than_a_one_gpu_job_that_ran_long() -> None:
    c = cluster(node("n1").gpus(8), node("n2").gpus(8))
    c.running(job("wide").gpus(8).priority("low").build(), on=[("n1", list(range(8)))], job_id="wide",
              started_at=70)  # 8 x 30 = 240
    for g in range(8):
        c.running(job(f"one-{g}").gpus(1).priority("low").build(), on=[("n2", [g])], job_id=f"one-{g}",
                  started_at=0 if g else 90)  # one-0: 1 x 10; the others 1 x 100
    c.pending(job("urgent").gpus(1).priority("high").build(), "urgent")

    assert evicted(run_cycle(c.snapshot(NOW), Policy(), NOW)) == ["one-0"]


def test_preemption_evicts_no_gang_it_does_not_need() -> None:
    c = cluster(node("n1").gpus(8))
    c.running(job("tiny").gpus(1).priority("low").build(), on=[("n1", [0])], job_id="tiny", started_at=99)  # 1
    c.running(job("half").gpus(4).priority("low").build(), on=[("n1", [1, 2, 3, 4])], job_id="half",
              started_at=90)  # 40
    c.running(job("rest").gpus(3).priority("low").build(), on=[("n1", [5, 6, 7])], job_id="rest", started_at=0)
    c.pending(job("urgent").gpus(4).priority("high").build(), "urgent")

    # cheapest first, "tiny" then "half" make room; "half" alone does too, so "tiny" stays
    assert evicted(run_cycle(c.snapshot(NOW), Policy(), NOW)) == ["half"]


def test_room_one_eviction_leaves_over_goes_to_the_next_preemptor_instead_of_another_eviction() -> None:
    c = cluster(node("n1").gpus(8), node("n2").gpus(8))
    c.running(job("cheap").gpus(8).priority("low").build(), on=[("n1", list(range(8)))], job_id="cheap",
              started_at=99)  # 8
    c.running(job("dear").gpus(8).priority("low").build(), on=[("n2", list(range(8)))], job_id="dear",
              started_at=0)  # 800
    c.pending(job("u1").gpus(4).priority("high").build(), "u1", at=1)
    c.pending(job("u2").gpus(4).priority("high").build(), "u2", at=2)

    plan = run_cycle(c.snapshot(NOW), Policy(backfill=False), NOW)

    assert evicted(plan) == ["cheap"], "the 8 GPUs of cheap hold both 4-GPU jobs"


# --- grace ---------------------------------------------------------------------------------------------------------


def test_a_priority_eviction_carries_the_priority_grace_and_a_reclaim_the_reclaim_grace() -> None:
    policy = Policy(grace_s=7, reclaim_grace_s=120)
    c = young_and_old()
    c.pending(job("urgent").gpus(4).priority("high").build(), "urgent")
    plan = run_cycle(c.snapshot(NOW), policy, NOW)
    assert [(p.job_id, p.grace_s) for p in plan.preemptions] == [("young", 7)]
    assert plan.unschedulable["urgent"] == "waiting for preemption of young (grace 7 s)"

    c = young_and_old(queue="borrower")
    c.pending(job("w").gpus(4).queue("owner").build(), "w")
    plan = run_cycle(c.snapshot(NOW, {"owner": 4, "borrower": 0}), policy, NOW, [ReclaimRequest("owner", 4)])
    assert [(p.job_id, p.grace_s) for p in plan.preemptions] == [("young", 120)]
    assert plan.unschedulable["w"].endswith("(grace 120 s)")


def test_reclaim_alone_carries_the_reclaim_grace() -> None:
    c = young_and_old(queue="borrower")
    snap = c.snapshot(NOW, {"owner": 4, "borrower": 0})

    assert [(p.job_id, p.grace_s) for p in reclaim(snap, [("owner", 4)], Policy(grace_s=7), NOW)] == [("young", 300)]


# --- reclaim never lifts the owed queue above what it is owed ------------------------------------------------------


def borrowed_cluster() -> ClusterBuilder:
    """Two full nodes of the borrower's 1-GPU jobs; the borrower is entitled to nothing."""
    c = cluster(node("n1").gpus(8), node("n2").gpus(8))
    for n in ("n1", "n2"):
        for g in range(8):
            c.running(job(f"{n}-{g}").gpus(1).queue("borrower").build(), on=[(n, [g])], job_id=f"{n}-{g}",
                      started_at=0)
    return c


def test_reclaim_gives_no_room_to_a_job_larger_than_what_its_queue_is_owed() -> None:
    c = borrowed_cluster()
    c.pending(job("big").gpus(8).queue("owner").build(), "big")

    plan = run_cycle(c.snapshot(NOW, {"owner": 2, "borrower": 0}), Policy(preempt=False), NOW,
                     [ReclaimRequest("owner", 2)])

    assert plan.preemptions == (), "8 GPUs for a queue owed 2 would lift it 6 above its share: churn back"


def test_reclaim_makes_room_for_the_job_that_fits_what_is_owed_and_no_more() -> None:
    c = borrowed_cluster()
    c.pending(job("big").gpus(8).queue("owner").build(), "big", at=1)
    c.pending(job("small").gpus(2).queue("owner").build(), "small", at=2)

    plan = run_cycle(c.snapshot(NOW, {"owner": 2, "borrower": 0}), Policy(preempt=False), NOW,
                     [ReclaimRequest("owner", 2)])

    assert len(plan.preemptions) == 2 and all(p.for_queue == "owner" for p in plan.preemptions)
    assert "reclaimed for queue owner" in plan.unschedulable["small"]
    assert "reclaimed" not in plan.unschedulable["big"]


def test_a_job_reclaim_cannot_make_room_for_says_its_queue_is_owed_and_why_it_still_waits() -> None:
    """One 8-GPU job of a queue entitled to 4 holds the node: evicting it would take that queue to 0, below its
    entitlement, so the owed queue's job waits, and its reason says so rather than reading as if nothing were owed."""
    c = cluster(node("n1").gpus(8))
    c.running(job("hog").gpus(8).queue("a").build(), on=[("n1", list(range(8)))], job_id="hog", started_at=0)
    c.pending(job("owed").gpus(4).queue("b").build(), "owed", at=1)
    c.pending(job("owed-too").gpus(4).queue("b").build(), "owed-too", at=2)
    c.pending(job("owed-three").gpus(4).queue("b").build(), "owed-three", at=3)

    plan = run_cycle(c.snapshot(NOW, {"a": 4, "b": 4}), Policy(preempt=False), NOW, [ReclaimRequest("b", 4)])

    assert plan.preemptions == ()
    for j in ("owed", "owed-too", "owed-three"):  # the third is the second's shape and mode: not searched again
        assert "its queue b is owed 4 GPUs, but no running job may be evicted for it" in plan.unschedulable[j], j
        assert plan.unschedulable[j].startswith("needs 4 GPUs"), "the room it lacks still comes first"
    # where reclaim does find victims, the job waits for them instead
    c2 = borrowed_cluster()
    c2.pending(job("small").gpus(2).queue("owner").build(), "small")
    plan = run_cycle(c2.snapshot(NOW, {"owner": 2, "borrower": 0}), Policy(preempt=False), NOW,
                     [ReclaimRequest("owner", 2)])
    assert "is owed" not in plan.unschedulable["small"] and "reclaimed for queue owner" in plan.unschedulable["small"]


# --- reclaim takes from the lowest-priority queues first -----------------------------------------------------------


def test_reclaim_for_a_waiting_job_takes_from_the_lowest_priority_queue_even_when_dearer() -> None:
    c = cluster(node("n1").gpus(8))
    c.running(job("r").gpus(4).queue("research").build(), on=[("n1", [0, 1, 2, 3])], job_id="r",
              started_at=90)  # 40
    c.running(job("e").gpus(4).queue("exploration").build(), on=[("n1", [4, 5, 6, 7])], job_id="e",
              started_at=0)  # 400
    c.pending(job("p").gpus(4).queue("production").build(), "p")
    policy = Policy(preempt=False, queue_priority={"production": 2, "research": 1, "exploration": 0})

    plan = run_cycle(c.snapshot(NOW, {"production": 4, "research": 0, "exploration": 0}), policy, NOW,
                     [ReclaimRequest("production", 4)])

    assert evicted(plan) == ["e"]


def test_reclaim_for_a_whole_node_takes_the_lowest_priority_queues_node() -> None:
    c = cluster(node("n1").gpus(8), node("n2").gpus(8))
    for g in range(8):
        c.running(job(f"e{g}").gpus(1).queue("exploration").build(), on=[("n1", [g])], job_id=f"e{g}", started_at=0)
        c.running(job(f"r{g}").gpus(1).queue("research").build(), on=[("n2", [g])], job_id=f"r{g}", started_at=95)
    c.pending(job("p").gpus(8).queue("production").build(), "p")
    policy = Policy(preempt=False, queue_priority={"production": 2, "research": 1, "exploration": 0})

    plan = run_cycle(c.snapshot(NOW, {"production": 8, "research": 0, "exploration": 0}), policy, NOW,
                     [ReclaimRequest("production", 8)])

    assert evicted(plan) == [f"e{g}" for g in range(8)]


# --- jobs already leaving count as freed ---------------------------------------------------------------------------


def two_borrowed_gangs(first: str = "running") -> ClusterBuilder:
    c = cluster(node("n1").gpus(8), node("n2").gpus(8))
    c.running(job("g1").gpus(8).queue("borrower").build(), on=[("n1", list(range(8)))], job_id="g1", started_at=90,
              state=first)
    c.running(job("g2").gpus(8).queue("borrower").build(), on=[("n2", list(range(8)))], job_id="g2", started_at=0)
    return c


def test_the_cycle_after_a_reclaim_evicts_no_second_gang_while_the_first_is_leaving() -> None:
    ent, owed = {"owner": 8, "borrower": 0}, [ReclaimRequest("owner", 8)]
    c = two_borrowed_gangs()
    c.pending(job("w").gpus(8).queue("owner").build(), "w")
    first = run_cycle(c.snapshot(NOW, ent), Policy(preempt=False), NOW, owed)
    assert evicted(first) == ["g1"]

    c.proj.jobs["g1"].state = "preempting"  # in its grace period; quota still counts it as the borrower's
    then = run_cycle(c.snapshot(NOW + 5, ent), Policy(preempt=False), NOW + 5, owed)

    assert then.preemptions == (), "g1's 8 GPUs are on their way to the owner"


def test_reclaim_alone_counts_a_leaving_gang_against_what_is_owed() -> None:
    c = two_borrowed_gangs(first="preempting")

    assert reclaim(c.snapshot(NOW, {"owner": 8, "borrower": 0}), [("owner", 8)], Policy(), NOW) == ()
    assert [p.job_id for p in reclaim(c.snapshot(NOW, {"owner": 16, "borrower": 0}), [("owner", 16)], Policy(),
                                      NOW)] == ["g2"]


def test_a_leaving_gang_no_longer_counts_for_its_queue_so_reclaim_stops_at_the_entitlement() -> None:
    # the borrower holds 16 of which 8 are leaving: it stays at its entitlement of 8, so g2 is not taken
    c = two_borrowed_gangs(first="preempting")
    for name in ("w1", "w2"):
        c.pending(job(name).gpus(8).queue("owner").build(), name)

    plan = run_cycle(c.snapshot(NOW, {"owner": 16, "borrower": 8}), Policy(preempt=False), NOW,
                     [ReclaimRequest("owner", 16)])

    assert plan.preemptions == ()


def test_a_leaving_gang_is_not_reclaimed_again() -> None:
    c = two_borrowed_gangs(first="preempting")
    for name in ("w1", "w2"):
        c.pending(job(name).gpus(8).queue("owner").build(), name)

    plan = run_cycle(c.snapshot(NOW, {"owner": 16, "borrower": 0}), Policy(preempt=False), NOW,
                     [ReclaimRequest("owner", 16)])

    assert evicted(plan) == ["g2"]


# --- reclaim takes only from other queues --------------------------------------------------------------------------


def test_reclaim_without_entitlements_still_takes_only_other_queues_gangs() -> None:
    c = cluster(node("n1").gpus(8))
    c.running(job("mine").gpus(4).queue("owner").build(), on=[("n1", [0, 1, 2, 3])], job_id="mine", started_at=99)
    c.running(job("theirs").gpus(4).queue("other").build(), on=[("n1", [4, 5, 6, 7])], job_id="theirs",
              started_at=0)
    c.pending(job("w").gpus(4).queue("owner").build(), "w")

    plan = run_cycle(c.snapshot(NOW), Policy(preempt=False), NOW, [ReclaimRequest("owner", 4)])

    assert evicted(plan) == ["theirs"]
    assert [p.job_id for p in reclaim(c.snapshot(NOW), [("owner", 4)], Policy(), NOW)] == ["theirs"]


# --- queue limits bind evictions too -------------------------------------------------------------------------------


def test_no_room_is_made_for_a_job_whose_queue_filled_to_its_limit_after_it_was_tried() -> None:
    # "urgent" (4 GPUs) is tried first and waits; "filler" (2 GPUs, same queue) then takes the 2 free GPUs:
    # research holds 2 of its 4, and urgent would take it to 6
    c = cluster(node("n1").gpus(8)).queue("research", limit=4)
    c.running(job("x").gpus(6).priority("low").queue("other").build(), on=[("n1", list(range(6)))], job_id="x")
    c.pending(job("urgent").gpus(4).priority("high").queue("research").build(), "urgent", at=1)
    c.pending(job("filler").gpus(2).queue("research").build(), "filler", at=2)

    plan = run_cycle(c.snapshot(NOW), Policy(backfill=False, cross_queue_preemption=True), NOW)

    assert list(plan.placements) == ["filler"]
    assert plan.preemptions == ()


def test_a_second_preemptor_of_a_queue_at_its_limit_gets_no_victims() -> None:
    c = cluster(node("n1").gpus(8), node("n2").gpus(8)).queue("research", limit=8)
    for n in ("n1", "n2"):
        c.running(job(f"x-{n}").gpus(8).priority("low").queue("other").build(), on=[(n, list(range(8)))],
                  job_id=f"x-{n}", started_at=0)
    c.pending(job("u1").gpus(8).priority("high").queue("research").build(), "u1", at=1)
    c.pending(job("u2").gpus(8).priority("high").queue("research").build(), "u2", at=2)

    plan = run_cycle(c.snapshot(NOW), Policy(backfill=False, cross_queue_preemption=True), NOW)

    # u1's room (a whole node) counts against research's limit at once: u2 would need a second node's eviction
    assert [p.for_job for p in plan.preemptions] == ["u1"], "u1's 8 GPUs take research to its limit"
    assert "preemption" not in plan.unschedulable["u2"], plan.unschedulable["u2"]


def test_no_reclaim_is_made_for_a_job_whose_queue_filled_to_its_limit_after_it_was_tried() -> None:
    c = cluster(node("n1").gpus(8)).queue("owner", limit=4)
    c.running(job("b").gpus(6).queue("borrower").build(), on=[("n1", list(range(6)))], job_id="b")
    c.pending(job("w").gpus(4).queue("owner").build(), "w", at=1)
    c.pending(job("filler").gpus(2).queue("owner").build(), "filler", at=2)

    plan = run_cycle(c.snapshot(NOW, {"owner": 8, "borrower": 0}), Policy(backfill=False, preempt=False), NOW,
                     [ReclaimRequest("owner", 8)])

    assert list(plan.placements) == ["filler"]
    assert plan.preemptions == ()


def test_a_second_reclaimer_of_a_queue_at_its_limit_gets_no_victims() -> None:
    c = borrowed_cluster().queue("owner", limit=4)
    c.pending(job("w1").gpus(4).queue("owner").build(), "w1", at=1)
    c.pending(job("w2").gpus(4).queue("owner").build(), "w2", at=2)

    plan = run_cycle(c.snapshot(NOW, {"owner": 8, "borrower": 0}), Policy(preempt=False), NOW,
                     [ReclaimRequest("owner", 8)])

    assert len(plan.preemptions) == 4 and "reclaimed for queue owner" in plan.unschedulable["w1"]
    assert "reclaimed" not in plan.unschedulable["w2"], "w1's 4 GPUs take the owner to its limit"
