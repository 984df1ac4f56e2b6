"""Queue limits bind at placement: no cycle takes a queue, or any of its ancestors, above its limit.

Limits count GPU-equivalents, as fair share does (``shared.fairshare.job_share``): a job's GPUs, or more where
it asks a larger share of the cluster's CPU or memory; a preempting job still counts until it has left.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from services.scheduler.core import Plan, Policy, ReclaimRequest, run_cycle
from services.scheduler.decide import decide
from services.scheduler.snapshot import Snapshot
from shared.fairshare import job_share, parent_of
from shared.model import JobSpec, TaskResources
from tests.builders import ClusterBuilder, cluster, job, node
from tests.scheduler.test_core_properties import EXAMPLES, POLICIES, PROPERTY, clusters, specs


def limited(plan: Plan, job_id: str) -> bool:
    return "at its limit of" in plan.unschedulable.get(job_id, "")


def test_a_queue_at_its_limit_of_one_gpu_runs_one_job_and_says_why_the_others_wait() -> None:
    c = cluster(node("n1").gpus(8)).queue("research", limit=1)
    for i in range(3):
        c.pending(job(f"j{i}").gpus(1).queue("research").build(), f"j{i}", at=i)

    plan = run_cycle(c.snapshot())

    assert list(plan.placements) == ["j0"]
    assert plan.unschedulable["j1"] == "queue research at its limit of 1 GPU (it holds 1; this job needs 1)"
    assert limited(plan, "j2")
    assert plan.reservation is None, "a job held back by its queue holds no capacity from others"


def test_the_scheduler_reads_the_limit_from_the_queues_in_the_log() -> None:
    c = cluster(node("n1").gpus(8)).queue("research", limit=1)
    for i in range(3):
        c.pending(job(f"j{i}").gpus(1).queue("research").build(), f"j{i}", at=i)

    plan = decide(c.proj, Policy(), now=0.0, half_life_s=3600)

    assert len(plan.placements) == 1 and sum(limited(plan, f"j{i}") for i in range(3)) == 2


def test_jobs_already_running_count_against_the_limit() -> None:
    c = cluster(node("n1").gpus(8)).queue("research", limit=2)
    c.running(job("r").gpus(2).queue("research").build(), on=[("n1", [0, 1])], job_id="r")
    c.pending(job("w").gpus(1).queue("research").build(), "w")
    c.pending(job("other").gpus(1).queue("vision").build(), "other")

    plan = run_cycle(c.snapshot())

    assert list(plan.placements) == ["other"]
    assert plan.unschedulable["w"] == "queue research at its limit of 2 GPUs (it holds 2; this job needs 1)"


def test_a_parent_limit_binds_its_children_together() -> None:
    c = cluster(node("n1").gpus(8)).queue("research", limit=3).queue("research.a").queue("research.b", limit=8)
    for q in ("a", "b"):
        for i in range(2):
            c.pending(job(f"{q}{i}").gpus(1).queue(f"research.{q}").build(), f"{q}{i}")

    plan = run_cycle(c.snapshot())

    assert len(plan.placements) == 3
    [waiting] = [j for j in ("a0", "a1", "b0", "b1") if j not in plan.placements]
    assert plan.unschedulable[waiting].startswith("queue research at its limit of 3 GPUs")


def test_a_job_larger_than_its_queue_limit_is_told_it_can_never_start() -> None:
    c = cluster(node("n1").gpus(8)).queue("research", limit=2)
    c.pending(job("big").gpus(4).queue("research").build(), "big")

    plan = run_cycle(c.snapshot())

    assert plan.unschedulable["big"] == "needs 4 GPUs, above the limit of queue research (2 GPUs): it can never start"


def test_fractions_and_cpu_heavy_jobs_count_in_gpu_equivalents() -> None:
    c = cluster(node("n1").gpus(4).cpu(64_000)).queue("research", limit=1)
    c.pending(job("half").gpus(0.5).queue("research").build(), "half", at=1)
    c.pending(job("cpu").gpus(0).cpu(16_000).queue("research").build(), "cpu", at=2)  # a quarter of the CPU: 1 GPU-eq.
    c.pending(job("other-half").gpus(0.5).queue("research").build(), "other-half", at=3)

    plan = run_cycle(c.snapshot())

    assert set(plan.placements) == {"half", "other-half"}
    assert plan.unschedulable["cpu"] == "queue research at its limit of 1 GPU (it holds 0.5; this job needs 1)"


def test_backfill_places_nothing_above_a_limit() -> None:
    c = cluster(node("n1").gpus(8)).queue("research", limit=1)
    c.running(job("busy").gpus(4).queue("other").time_limit(1000).build(), on=[("n1", [0, 1, 2, 3])], job_id="busy")
    c.pending(job("head").gpus(8).queue("other").build(), "head", at=1)  # blocked: takes the reservation
    for i in range(3):  # short jobs that end before the reservation starts: backfill candidates
        c.pending(job(f"s{i}").gpus(1).queue("research").time_limit(10).build(), f"s{i}", at=2 + i)

    plan = run_cycle(c.snapshot())

    assert plan.reservation is not None and plan.reservation.job_id == "head"
    assert list(plan.placements) == ["s0"]
    assert limited(plan, "s1") and limited(plan, "s2")


def test_no_priority_preemption_is_made_for_a_job_its_queue_limit_holds_back() -> None:
    c = cluster(node("n1").gpus(2)).queue("research", limit=1)
    c.running(job("mine").gpus(1).priority("low").queue("research").build(), on=[("n1", [0])], job_id="mine",
              started_at=0)
    c.running(job("theirs").gpus(1).priority("low").queue("x").build(), on=[("n1", [1])], job_id="theirs",
              started_at=99)  # the cheaper victim: evicting it would lift research to 2
    c.pending(job("urgent").gpus(1).priority("high").queue("research").build(), "urgent")

    plan = run_cycle(c.snapshot(now=100), Policy(cross_queue_preemption=True), now=100)

    assert plan.preemptions == ()
    assert limited(plan, "urgent")


def test_no_reclaim_is_made_for_a_job_its_queue_limit_holds_back() -> None:
    c = cluster(node("n1").gpus(8)).queue("owner", limit=2)
    c.running(job("o").gpus(2).queue("owner").build(), on=[("n1", [0, 1])], job_id="o")
    for g in range(2, 8):
        c.running(job(f"b{g}").gpus(1).queue("borrower").build(), on=[("n1", [g])], job_id=f"b{g}")
    c.pending(job("w").gpus(2).queue("owner").build(), "w")

    plan = run_cycle(c.snapshot(now=100, entitlements={"owner": 4, "borrower": 4}), Policy(preempt=False), 100,
                     reclaims=[ReclaimRequest("owner", 2)])

    assert plan.preemptions == ()
    assert limited(plan, "w")


# --- the property -----------------------------------------------------------------------------

LEAVES = ["t.a", "t.b", "u"]
QUEUES = ["t", *LEAVES]


def subtree(queue: str, q: str) -> bool:
    while queue:
        if queue == q:
            return True
        queue = parent_of(queue)
    return False


@st.composite
def small_clusters(draw) -> ClusterBuilder:
    """A few plain nodes: the first jobs fill them, so the second ones contend (preemption, reclaim)."""
    return cluster(*(node(f"n{i}").gpus(draw(st.sampled_from([1, 2, 4, 8]))) for i in range(draw(st.integers(1, 3)))))


@st.composite
def plain_specs(draw) -> JobSpec:
    """Whole GPUs, no constraints: jobs that fit where room is made for them."""
    return JobSpec(name="p", tasks=draw(st.sampled_from([1, 1, 2])), priority=draw(st.sampled_from(["low", "high"])),
                   resources=TaskResources(gpus=draw(st.sampled_from([1, 1, 2, 4]))),
                   time_limit_s=draw(st.sampled_from([None, 100])))


@st.composite
def limited_scenarios(draw) -> tuple[ClusterBuilder, Snapshot, Policy, float, list[ReclaimRequest], Plan]:
    """Limits on some queues (set before the running jobs started, or after: a queue may be above its limit
    already), running jobs, then more jobs, mostly in the queue that is owed GPUs. Three kinds, so that every
    action meets the limits: jobs that started in a first cycle of a random cluster; a full cluster of the
    lenders' 1-GPU jobs (reclaim frees room for the owed queue); a full cluster of the owed queue's low-priority
    jobs (priority preemption frees room)."""
    kind = draw(st.sampled_from(["random", "reclaim", "preempt"]))
    c = draw(st.one_of(clusters(), small_clusters())) if kind == "random" else draw(small_clusters())
    owed = draw(st.sampled_from(LEAVES))
    lenders = [q for q in LEAVES if q != owed]
    limits = {q: draw(st.sampled_from([None, None, 0.5, 1, 2, 3, 4, 8])) for q in QUEUES}

    def define() -> None:
        for q, limit in limits.items():
            c.queue(q, limit=limit)

    early = draw(st.booleans())
    if early:
        define()
    if kind == "random":
        for i, spec in enumerate(draw(st.lists(st.one_of(specs(), plain_specs()), max_size=10))):
            c.pending(spec.model_copy(update={"queue": draw(st.sampled_from([*lenders, *lenders, owed])),
                                              "priority": draw(st.sampled_from(["low", "normal", spec.priority]))}),
                      f"w1-{i}", at=i)
        for job_id, p in run_cycle(c.snapshot(0.0), Policy(seed=1), 0.0).placements.items():
            c.hold(c.proj.jobs[job_id].spec, p.tasks, job_id, started_at=-draw(st.sampled_from([0, 50, 500])))
    else:
        for n, ns in list(c.proj.nodes.items()):
            for g in range(len(ns.info.gpus)):
                q = draw(st.sampled_from(lenders)) if kind == "reclaim" else owed
                c.running(JobSpec(name="f", queue=q, priority="low"), on=[(n, [g])], job_id=f"f-{n}-{g}",
                          started_at=-draw(st.sampled_from([0, 50, 500])))
    if not early:
        define()
    for i, spec in enumerate(draw(st.lists(st.one_of(specs(), plain_specs()), min_size=1, max_size=8))):
        update = {"queue": draw(st.sampled_from([owed, owed, *lenders]))}
        if kind == "preempt":
            update["priority"] = "high"
        c.pending(spec.model_copy(update=update), f"w2-{i}", at=10 + i)
    ent, reclaims = None, []
    if kind == "reclaim" or (kind == "random" and draw(st.booleans())):
        # quota's view: the lenders borrow (entitled to little), the owed queue is owed GPUs
        ent = {owed: 8.0, **{q: float(draw(st.sampled_from([0, 0, 1, 2]))) for q in lenders}}
        reclaims = [ReclaimRequest(owed, draw(st.sampled_from([1, 2, 4, 8])))]
    below = draw(st.integers(1, 4) if kind == "preempt" else st.integers(0, 4))
    policy = Policy(name=draw(st.sampled_from(POLICIES)), seed=draw(st.integers(0, 3)), preemptible_below=below,
                    cross_queue_preemption=draw(st.booleans()))
    now = float(draw(st.sampled_from([0, 60, 600])))
    snap = c.snapshot(now, ent)
    return c, snap, policy, now, reclaims, run_cycle(snap, policy, now, reclaims)


def test_no_cycle_takes_a_queue_above_its_limit_by_placement_backfill_preemption_or_reclaim() -> None:
    """Per limited queue: what its subtree held before the cycle, plus what the cycle placed there, plus the jobs it
    evicted for there (they start once their victims leave), stays within the limit, unless the cycle placed and
    evicted nothing there. Also when the queue was above its limit already (a limit lowered under running jobs)."""
    seen = {"bound": 0, "reclaim": 0, "preempt": 0, "bound_with_evictions": 0}

    @given(limited_scenarios())
    @settings(PROPERTY, max_examples=max(EXAMPLES, 200))  # every branch below is reached in far fewer
    def check(scenario) -> None:
        c, snap, policy, now, reclaims, plan = scenario
        share = {j.job_id: job_share(j.spec, snap.ratios) for j in (*snap.pending, *snap.running)}
        queue_of = {j.job_id: j.queue for j in (*snap.pending, *snap.running)}
        evicted_for = {p.for_job for p in plan.preemptions if p.for_job}
        evicted_for |= {j for j, why in plan.unschedulable.items() if "reclaimed for queue" in why}
        for q, limit in {q: spec.limit.gpus for q, spec in c.proj.queues.items() if spec.limit is not None}.items():
            held = sum(share[r.job_id] for r in snap.running if subtree(r.queue, q))
            new = sum(share[j] for j in [*plan.placements, *evicted_for] if subtree(queue_of[j], q))
            if new > 0:
                assert held + new <= limit + 1e-6, f"queue {q}: held {held} + new {new} > limit {limit}"
        bound = any(limited(plan, j.job_id) for j in snap.pending)
        seen["bound"] += bound
        seen["reclaim"] += any(p.for_queue for p in plan.preemptions)
        seen["preempt"] += any(p.for_job for p in plan.preemptions)
        seen["bound_with_evictions"] += bound and bool(plan.preemptions)
        if bound:
            event("a queue limit held a job back")
        if plan.preemptions:
            event("evictions: " + ("reclaim" if any(p.for_queue for p in plan.preemptions) else "priority"))

    check()
    # the property reached the branches it names: limits bound, reclaim and priority preemption ran, and together
    print("limit branches reached:", seen)
    assert all(seen.values()), seen
