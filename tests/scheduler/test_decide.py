"""``decide``: one cycle from the folded cluster (fair share, reclaim, the queues' policy, the core), outside the
stack; and the glue from settings and queue specs to the ``Policy`` the core reads."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest

from services.scheduler.core import Policy
from services.scheduler.decide import configured_policy, decide, effective_priority, queue_policy
from services.scheduler.snapshot import pending_view
from shared import cluster as cluster_module
from shared.fairshare import Ratios, job_share
from shared.model import GpuAmount, QueueSpec
from shared.settings import Settings
from tests.builders import ClusterBuilder, cluster, job, node

HOUR = 3600.0
NOW = 10_000.0


def borrowed(**queues: QueueSpec) -> ClusterBuilder:
    """One 8-GPU node held whole by queue ``b`` (four 2-GPU jobs started at 0), and a 4-GPU job of queue ``a``
    waiting since NOW - 100; ``a`` and ``b`` are each guaranteed 4 GPUs unless ``queues`` says otherwise."""
    c = cluster(node("n1").gpus(8))
    c.proj.queues.update({"a": QueueSpec(guaranteed=GpuAmount(gpus=4)), "b": QueueSpec(guaranteed=GpuAmount(gpus=4)),
                          **queues})
    for i in range(4):
        c.running(job(f"b{i}").gpus(2).queue("b").build(), on=[("n1", [2 * i, 2 * i + 1])], job_id=f"b{i}")
    c.pending(job("a0").gpus(4).queue("a").build(), "a0", at=NOW - 100)
    c.proj.jobs["a0"].updated_at = NOW - 100
    return c


# --- decide --------------------------------------------------------------------------------------------------


def test_a_queue_below_its_guarantee_reclaims_from_the_borrower_with_the_reclaim_grace() -> None:
    plan = decide(borrowed().proj, Policy(reclaim_grace_s=120), NOW, HOUR)

    assert [p.job_id for p in plan.preemptions] == ["b0", "b1"], "the cheapest victims that free 4 GPUs"
    assert {(p.reason, p.grace_s, p.for_queue) for p in plan.preemptions} == {
        ("reclaimed for queue a (queue b is over its share)", 120, "a")}
    assert plan.unschedulable["a0"] == "waiting for b0, b1 to leave: reclaimed for queue a (grace 120 s)"


@pytest.mark.parametrize(("reclaim_after_s", "reclaims"), [
    pytest.param(0.0, True, id="at once"),
    pytest.param(99.0, True, id="waited longer than asked"),
    pytest.param(101.0, False, id="not waited long enough yet"),
])
def test_reclaim_waits_for_work_that_has_waited_reclaim_after_s(reclaim_after_s: float, reclaims: bool) -> None:
    plan = decide(borrowed().proj, Policy(), NOW, HOUR, reclaim_after_s=reclaim_after_s)

    assert bool(plan.preemptions) is reclaims


def test_a_borrower_younger_than_its_queues_minimum_runtime_is_not_reclaimed() -> None:
    young = borrowed(b=QueueSpec(guaranteed=GpuAmount(gpus=4), preempt_min_runtime_s=int(NOW) + 1))
    old_enough = borrowed(b=QueueSpec(guaranteed=GpuAmount(gpus=4), preempt_min_runtime_s=int(NOW) - 1))

    assert decide(young.proj, Policy(), NOW, HOUR).preemptions == ()
    assert decide(old_enough.proj, Policy(), NOW, HOUR).preemptions != ()


def test_decide_reads_the_projection_and_changes_nothing_and_decides_the_same_twice() -> None:
    c = borrowed()
    before = c.proj.digest()

    first, again = decide(c.proj, Policy(seed=7), NOW, HOUR), decide(c.proj, Policy(seed=7), NOW, HOUR)

    assert c.proj.digest() == before
    assert first == again


@pytest.mark.parametrize(("half_life_s", "heavy", "light"), [
    pytest.param(HOUR, 1, 3, id="remembered: the queue that used much gets less"),
    pytest.param(60.0, 2, 2, id="forgotten: an even split"),
])
def test_usage_counts_against_a_queue_until_it_decays_with_the_half_life(half_life_s: float, heavy: int,
                                                                         light: int) -> None:
    c = cluster(node("n1").gpus(4))
    c.proj.queues.update({"heavy": QueueSpec(), "light": QueueSpec()})
    c.proj.accounting["heavy"] = {0: 100_000.0}  # GPU-seconds held in the first hour, ~2.3 h before NOW
    for i in range(4):
        c.pending(job(f"h{i}").gpus(1).queue("heavy").build(), f"h{i}", at=i)  # heavy's jobs came first
        c.pending(job(f"l{i}").gpus(1).queue("light").build(), f"l{i}", at=10 + i)

    placed = decide(c.proj, Policy(), NOW, half_life_s).placements

    assert (sum(j.startswith("h") for j in placed), sum(j.startswith("l") for j in placed)) == (heavy, light)


# --- the policy: settings and queue specs --------------------------------------------------------------------


def test_the_configured_policy_comes_from_the_settings() -> None:
    policy = configured_policy(Settings(policy="binpack", reclaim_grace_s=60, max_preemptions_per_hour=1))

    assert (policy.name, policy.reclaim_grace_s, policy.max_preemptions_per_hour) == ("binpack", 60, 1)
    assert configured_policy(Settings()) == Policy(name="fgd+", reclaim_grace_s=300, max_preemptions_per_hour=3)


def test_an_unknown_policy_name_is_refused_with_the_names_to_choose_from() -> None:
    with pytest.raises(ValueError, match="unknown policy 'nope'; choose one of .*fgd"):
        configured_policy(Settings(policy="nope"))


def test_queue_specs_add_minimum_runtimes_and_reclaim_priorities_to_the_policy_and_keep_the_rest() -> None:
    queues = {
        "default": QueueSpec(),
        "production": QueueSpec(priority=2, preempt_min_runtime_s=600),
        "production.inference": QueueSpec(),
        "research": QueueSpec(priority=1),
        "research.nlp": QueueSpec(preempt_min_runtime_s=60),
        "research.nlp.big": QueueSpec(priority=-1),
    }
    base = Policy(name="binpack", reclaim_grace_s=60, min_runtime_s={"gone": 5}, queue_priority={"gone": 9})

    policy = queue_policy(base, queues)

    assert policy.min_runtime_s == {"production": 600, "research.nlp": 60}, "a queue's own, never inherited"
    assert policy.queue_priority == {"default": 0, "production": 2, "production.inference": 2, "research": 1,
                                     "research.nlp": 1, "research.nlp.big": -1}
    assert replace(policy, min_runtime_s={}, queue_priority={}) == replace(base, min_runtime_s={}, queue_priority={})


@pytest.mark.parametrize(("path", "priority"), [
    pytest.param("production.inference", 2, id="from its parent"),
    pytest.param("production.inference.eu", 2, id="from its grandparent"),
    pytest.param("research.nlp", 3, id="its own before its parent's"),
    pytest.param("exploration", 0, id="none anywhere"),
    pytest.param("unknown.leaf", 0, id="an unknown queue"),
])
def test_a_queues_reclaim_priority_is_its_own_else_its_nearest_ancestors(path: str, priority: int) -> None:
    queues = {"production": QueueSpec(priority=2), "production.inference": QueueSpec(),
              "research": QueueSpec(priority=1), "research.nlp": QueueSpec(priority=3), "exploration": QueueSpec()}

    assert effective_priority(queues, path) == priority


# --- the cycle's read: one pass over the jobs, views made once --------------------------------------------------


def test_the_one_pass_load_is_each_jobs_share_summed_by_state() -> None:
    """``queue_loads`` (one pass: a cycle's read made four) against the sums written out job by job."""
    c = borrowed()  # b: four running 2-GPU jobs; a: one 4-GPU job waiting since NOW - 100
    c.pending(job("a1").gpus(1).queue("a").build(), "a1", at=NOW - 10)
    c.proj.jobs["a1"].updated_at = NOW - 10
    c.pending(job("b9").gpus(1).cpu(60_000).queue("b").build(), "b9")  # CPU-heavy: its dominant share is CPU
    c.proj.jobs["b9"].state, c.proj.jobs["b9"].updated_at = "submitted", NOW - 10  # pending, not queued
    c.ended(job("a-old").gpus(8).queue("a").build(), "a-old")
    ratios = c.proj.share_ratios()
    share = {j.job_id: job_share(j.spec, ratios) for j in c.proj.jobs.values()}

    load = c.proj.queue_loads(waited_before=NOW - 50)

    assert load.alloc == {"b": sum(share[f"b{i}"] for i in range(4))}
    assert load.pending == {"a": share["a0"] + share["a1"], "b": share["b9"]}
    assert load.waited == {"a": share["a0"]}, "a1 and b9 have not waited since NOW - 50"
    assert load.smallest == {"a": share["a1"]}, "the smallest queued job; b9 is not queued yet"
    assert share["b9"] > 1, "the oracle's shares are dominant-resource shares, not GPUs"
    assert c.proj.queue_load() == (load.alloc, load.pending)
    assert c.proj.queue_load(waited_before=NOW - 50) == (load.alloc, load.waited)


def test_a_jobs_share_is_kept_for_gpus_and_for_dominant_shares_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """GET /v1/queues and a scrape ask every job's share in GPUs and in dominant shares, in turn: each is kept (with
    one kept, each asking made it anew for every job), and made again when the spec changes. Right values: the
    oracle is ``job_share`` called directly, before the count starts."""
    c = borrowed()
    c.pending(job("b9").gpus(1).cpu(60_000).queue("b").build(), "b9")
    ratios, gpus = c.proj.share_ratios(), Ratios()
    want = {r: {j.job_id: job_share(j.spec, r) for j in c.proj.jobs.values()} for r in (ratios, gpus)}
    made = []
    monkeypatch.setattr(cluster_module, "job_share", lambda spec, r: made.append(spec) or job_share(spec, r))
    for _ in range(3):
        for r in (ratios, gpus, Ratios(*dataclasses.astuple(ratios))):
            assert {j.job_id: j.share(r) for j in c.proj.jobs.values()} == want[gpus if r == gpus else ratios]
    assert len(made) == 2 * len(c.proj.jobs), "each job's share made once per ratios"
    record = c.proj.jobs["b9"]
    record.spec = job("b9").gpus(2).queue("b").build()
    assert record.share(gpus) == 2.0 and len(made) == 2 * len(c.proj.jobs) + 1


def test_a_waiting_jobs_view_is_made_once_and_again_when_the_job_changes() -> None:
    c = cluster(node("n1").gpus(8)).pending(job("w").gpus(1).build(), "w", at=5.0, owner="ann")
    record = c.proj.jobs["w"]
    first = pending_view(record)
    assert pending_view(record) is first, "kept while nothing changed"
    changes = [
        lambda: record.preemptions.append(7.0),
        lambda: setattr(record, "spec", job("w").gpus(2).build()),
        lambda: setattr(record, "submitted_at", 6.0),
        lambda: setattr(record, "owner", "bob"),
    ]
    for change in changes:
        before = pending_view(record)
        change()
        after = pending_view(record)
        assert after is not before
        assert (after.spec, after.submitted_at, after.preemptions, after.owner) == (
            record.spec, record.submitted_at, len(record.preemptions), record.owner)


# --- reclaim honours guarantees whole gangs at a time (found with gpuorch up: a guarantee never came back) ---------


def three_big_jobs_of(queue: str, **queues: QueueSpec) -> ClusterBuilder:
    """Three 8-GPU nodes, each held whole by one 8-GPU job of ``queue``; a 4-GPU job of ``research.vision`` waits."""
    c = cluster(*(node(f"n{i}").gpus(8) for i in range(3)))
    c.proj.queues.update(queues)
    for i in range(3):
        c.running(job(f"big{i}").gpus(8).queue(queue).build(), on=[(f"n{i}", list(range(8)))], job_id=f"big{i}",
                  started_at=0)
    c.pending(job("v0").gpus(4).queue("research.vision").build(), "v0", at=NOW - 100)
    c.proj.jobs["v0"].updated_at = NOW - 100
    return c


def test_a_guarantee_is_reclaimed_from_a_borrower_even_when_a_whole_gang_takes_it_below_its_fair_share() -> None:
    """nlp (guaranteed 4) borrows 20 GPUs as three 8-GPU jobs; vision is guaranteed 4 and owed them. Its fair share
    with vision's demand is 20, so evicting one job leaves nlp at 16: below that share, far above its guarantee.
    Reclaim used to refuse (it kept every victim queue at its fair share), so vision's guarantee never came back
    while nlp ran: its job waited as 'owed 4 GPUs, but no running job may be evicted for it'. (Their parent keeps
    its 24: a move between siblings.)"""
    four = QueueSpec(guaranteed=GpuAmount(gpus=4))
    queues = {"research": QueueSpec(guaranteed=GpuAmount(gpus=24)), "research.nlp": four, "research.vision": four}
    plan = decide(three_big_jobs_of("research.nlp", **queues).proj, Policy(), NOW, HOUR)

    [victim] = plan.preemptions
    assert victim.job_id.startswith("big") and victim.for_queue == "research.vision", plan.unschedulable
    assert plan.unschedulable["v0"].startswith(f"waiting for {victim.job_id} to leave: reclaimed for queue "
                                               "research.vision")


def test_reclaim_never_takes_a_victim_below_its_guarantee_nor_a_parent_the_reclaimer_does_not_share() -> None:
    """The same, but the borrower is guaranteed 20: one 8-GPU job less would leave it at 16, below its guarantee
    (it would be owed 4 and take them back: churn). And where the guarantee is its parent's (lab guaranteed 20, its
    leaf none), evicting any of lab's jobs would take lab below 20 for a queue outside it. Nothing is taken."""
    four = QueueSpec(guaranteed=GpuAmount(gpus=4))
    for queue, queues in [
        ("research.nlp", {"research.nlp": QueueSpec(guaranteed=GpuAmount(gpus=20)), "research.vision": four}),
        ("lab.x", {"lab": QueueSpec(guaranteed=GpuAmount(gpus=20)), "lab.x": QueueSpec(), "research": four,
                   "research.vision": four}),
    ]:
        plan = decide(three_big_jobs_of(queue, **queues).proj, Policy(), NOW, HOUR)
        assert plan.preemptions == (), queue
        assert "its queue research.vision is owed 4 GPUs, but no running job may be evicted for it (each would take " \
               "its own queue or a parent queue below its guarantee, or is protected)" in plan.unschedulable["v0"], \
               plan.unschedulable
