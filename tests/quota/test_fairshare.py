"""Fair-share division: table-driven examples and the invariants as properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.fairshare import Ratios, accrue, divide, dominant_gpus, jain_index, job_share, leaves
from shared.model import GpuAmount, JobSpec, QueueSpec, TaskResources


def q(guaranteed: float = 0, limit: float | None = None, weight: float = 1) -> QueueSpec:
    return QueueSpec(guaranteed=GpuAmount(gpus=guaranteed), limit=None if limit is None else GpuAmount(gpus=limit), weight=weight)


CASES = [
    ("guarantees first, capped by demand",
     100, {"a": q(60), "b": q(40)}, {"a": 10, "b": 500}, {"a": 10, "b": 90}),
    ("remainder split by weight 2:1",
     90, {"a": q(weight=2), "b": q(weight=1)}, {"a": 1000, "b": 1000}, {"a": 60, "b": 30}),
    ("a limit caps a queue and its share goes to the others",
     100, {"a": q(limit=20), "b": q()}, {"a": 1000, "b": 1000}, {"a": 20, "b": 80}),
    ("idle capacity is not entitled",
     100, {"a": q(10), "b": q(10)}, {"a": 5, "b": 5}, {"a": 5, "b": 5}),
    ("oversubscribed guarantees shrink in proportion",
     50, {"a": q(60), "b": q(40)}, {"a": 1000, "b": 1000}, {"a": 30, "b": 20}),
    ("a parent divides its entitlement among its children",
     100, {"r": q(80), "r.x": q(weight=3), "r.y": q(weight=1), "p": q(20)},
     {"r.x": 1000, "r.y": 1000, "p": 1000}, {"r": 80, "r.x": 60, "r.y": 20, "p": 20}),
]


@pytest.mark.parametrize("label,capacity,queues,demand,expected", CASES, ids=[c[0] for c in CASES])
def test_division_examples(label, capacity, queues, demand, expected):
    ent = divide(capacity, queues, demand).entitlement
    for path, want in expected.items():
        assert ent[path] == pytest.approx(want), (label, path, ent)


def test_with_equal_weights_the_queue_that_used_more_gets_less_of_the_remainder():
    queues = {"a": q(10), "b": q(10)}
    ent = divide(100, queues, {"a": 1000, "b": 1000}, usage={"a": 5000, "b": 1000}).entitlement
    assert ent["a"] < ent["b"]
    assert ent["a"] >= 10 and ent["b"] >= 10
    assert ent["a"] + ent["b"] == pytest.approx(100)


def test_decayed_usage_halves_every_half_life_and_grows_with_gpus_held():
    assert accrue(100.0, 0, 3600, 3600) == pytest.approx(50.0)
    assert accrue(0.0, 8, 10, 1e12) == pytest.approx(80.0, rel=1e-6)
    assert jain_index([1, 1, 1]) == pytest.approx(1) and jain_index([1, 0, 0]) == pytest.approx(1 / 3)


names = st.sampled_from(["a", "b", "c", "a.x", "a.y", "b.x", "c.z.w"])
specs = st.builds(
    lambda g, extra, w, has_limit: q(g, g + extra if has_limit else None, w),
    st.integers(0, 40), st.integers(0, 60), st.sampled_from([0.5, 1, 2, 3]), st.booleans(),
)


@st.composite
def trees(draw):
    paths = draw(st.sets(names, min_size=1, max_size=6))
    queues = {p: draw(specs) for p in paths}
    # guarantees of children never above their parent's (the API refuses that)
    for p in sorted(queues, key=lambda s: -s.count(".")):
        parent = p.rsplit(".", 1)[0] if "." in p else None
        if parent in queues:
            kids = [k for k in queues if k.rsplit(".", 1)[0] == parent and "." in k]
            total = sum(queues[k].guaranteed.gpus for k in kids)
            if total > queues[parent].guaranteed.gpus:
                queues[parent] = q(total, None, queues[parent].weight)
    demand = {p: draw(st.integers(0, 100)) for p in leaves(queues)}
    usage = {p: draw(st.integers(0, 10_000)) for p in leaves(queues)}
    return queues, demand, usage


@settings(max_examples=150, deadline=None)
@given(trees(), st.integers(0, 300))
def test_invariants(tree, capacity):
    queues, demand, usage = tree
    d = divide(capacity, queues, demand, usage)
    ent = d.entitlement
    tops = [p for p in ent if "." not in p]
    assert sum(ent[p] for p in tops) <= capacity + 1e-6
    for p, e in ent.items():
        kids = [k for k in ent if k.rsplit(".", 1)[0] == p and "." in k]
        if kids:
            assert sum(ent[k] for k in kids) <= e + 1e-6
        spec = queues.get(p)
        if spec is not None and spec.limit is not None:
            assert e <= spec.limit.gpus + 1e-6
        assert e <= d.demand[p] + 1e-6
    if sum(min(queues.get(p, q()).guaranteed.gpus, d.demand[p]) for p in tops) <= capacity:
        for p in tops:
            assert ent[p] >= min(queues.get(p, q()).guaranteed.gpus, d.demand[p]) - 1e-6


@settings(max_examples=100, deadline=None)
@given(trees(), st.integers(0, 200), st.integers(1, 100))
def test_more_capacity_never_lowers_anyones_entitlement(tree, capacity, more):
    queues, demand, usage = tree
    before = divide(capacity, queues, demand, usage).entitlement
    after = divide(capacity + more, queues, demand, usage).entitlement
    for p in before:
        assert after[p] >= before[p] - 1e-6, p


def test_weights_two_to_one_split_the_remainder_within_one_gpu():
    ent = divide(1000, {"a": q(100, weight=2), "b": q(100, weight=1)}, {"a": 10_000, "b": 10_000}).entitlement
    assert abs((ent["a"] - 100) - 2 * (ent["b"] - 100)) < 1


def test_a_queue_below_its_guarantee_with_waiting_work_is_owed_the_difference():
    from shared.fairshare import reclaim_requests

    queues = {"research": q(40), "prod": q(60)}
    ent = divide(100, queues, {"research": 40, "prod": 100}).entitlement
    asks = reclaim_requests(queues, {"research": 0, "prod": 100}, {"research": 40}, ent)
    assert asks == [("research", pytest.approx(40))]
    assert reclaim_requests(queues, {"research": 40, "prod": 60}, {"research": 8}, ent) == []
    assert reclaim_requests(queues, {"research": 0, "prod": 10}, {}, ent) == []


def _borrowers():
    from tests.builders import cluster, job, node

    c = cluster(node("n1").gpus(8))
    c.running(job("young").gpus(4).queue("borrower").build(), on=[("n1", [0, 1, 2, 3])], job_id="young", started_at=90)
    c.running(job("old").gpus(4).queue("borrower").build(), on=[("n1", [4, 5, 6, 7])], job_id="old", started_at=0)
    return c


def test_reclaim_never_evicts_a_job_younger_than_its_queues_min_runtime():
    from services.scheduler.core import Policy, reclaim

    c = _borrowers()
    snap = c.snapshot(now=100, entitlements={"owner": 4, "borrower": 0})
    policy = Policy(min_runtime_s={"borrower": 60})
    assert [p.job_id for p in reclaim(snap, [("owner", 4)], policy, now=100)] == ["old"]
    assert [p.job_id for p in reclaim(snap, [("owner", 4)], Policy(), now=100)] == ["young"]  # cheapest otherwise


def test_the_thrashing_guard_leaves_a_job_preempted_too_often_this_hour_alone():
    from services.scheduler.core import Policy, reclaim

    c = _borrowers()
    c.proj.jobs["young"].preemptions = [10.0, 40.0, 70.0]
    snap = c.snapshot(now=100, entitlements={"owner": 4, "borrower": 0})
    assert [p.job_id for p in reclaim(snap, [("owner", 4)], Policy(max_preemptions_per_hour=3), now=100)] == ["old"]
    assert [p.job_id for p in reclaim(snap, [("owner", 4)], Policy(max_preemptions_per_hour=4), now=100)] == ["young"]


def test_reclaim_takes_from_the_lowest_priority_queue_first():
    from services.scheduler.core import Policy, reclaim
    from tests.builders import cluster, job, node

    c = cluster(node("n1").gpus(8))
    c.running(job("r").gpus(4).queue("research").build(), on=[("n1", [0, 1, 2, 3])], job_id="r", started_at=0)
    c.running(job("e").gpus(4).queue("exploration").build(), on=[("n1", [4, 5, 6, 7])], job_id="e", started_at=50)
    snap = c.snapshot(now=100, entitlements={"production": 4, "research": 0, "exploration": 0})
    policy = Policy(queue_priority={"production": 2, "research": 1, "exploration": 0})
    assert [p.job_id for p in reclaim(snap, [("production", 4)], policy, now=100)] == ["e"]
    # the older research job costs more GPU-hours, yet a lower queue priority makes it the victim
    policy = Policy(queue_priority={"production": 2, "research": 0, "exploration": 1})
    assert [p.job_id for p in reclaim(snap, [("production", 4)], policy, now=100)] == ["r"]


def test_a_leaf_inherits_its_parents_reclaim_priority():
    from services.scheduler.decide import effective_priority

    queues = {"production": QueueSpec(priority=2), "production.inference": QueueSpec(), "research.nlp": QueueSpec(priority=1)}
    assert effective_priority(queues, "production.inference") == 2
    assert effective_priority(queues, "research.nlp") == 1
    assert effective_priority(queues, "exploration") == 0


# --- dominant resource (DRF) -------------------------------------------------------------------

R = Ratios.of(16, 64_000, 1_024_000)  # 16 GPUs, 64 CPUs, 1 TiB: 4 CPUs and 64 GiB per GPU


@pytest.mark.parametrize("gpus, cpu, mem, expected", [
    (4, 0, 0, 4),  # GPUs and nothing else: its GPUs
    (4, 16_000, 256_000, 4),  # CPU and memory in proportion: still its GPUs
    (1, 32_000, 0, 8),  # half the CPUs: half the GPUs' worth
    (0, 8_000, 0, 2),  # a CPU-only job counts too
    (1, 0, 512_000, 8),  # half the memory
])
def test_a_demand_counts_its_largest_share_of_any_resource_in_gpu_equivalents(gpus, cpu, mem, expected):
    assert dominant_gpus(gpus, cpu, mem, R) == pytest.approx(expected)


def test_a_jobs_share_counts_all_its_tasks_and_a_cluster_without_cpu_figures_counts_gpus_only():
    spec = JobSpec(name="j", tasks=2, resources=TaskResources(gpus=1, cpu_milli=16_000))
    assert job_share(spec, R) == pytest.approx(8)  # 32 CPUs of 64
    assert job_share(spec, Ratios.of(16, 0, 0)) == pytest.approx(2)
    assert job_share(spec, Ratios.of(0, 64_000, 0)) == pytest.approx(2), "no GPUs: nothing to convert to"


def test_a_mig_slice_counts_its_compute_sevenths():
    spec = JobSpec(name="m", tasks=2, resources=TaskResources(gpus=1), gpu={"mig": "3g.40gb"})
    assert job_share(spec, Ratios()) == pytest.approx(6 / 7)


def test_two_queues_with_equal_weights_get_equal_dominant_shares():
    # "cpu" wants 16 jobs of 1 GPU + 8 CPUs (each 2 GPU-equivalents), "gpu" wants 16 GPUs: split 8:8 in
    # GPU-equivalents, so "cpu" runs 4 jobs (4 GPUs, 32 CPUs: half the CPUs) and "gpu" 8 GPUs
    cpu_job = job_share(JobSpec(name="c", resources=TaskResources(gpus=1, cpu_milli=8_000)), R)
    d = divide(16, {"cpu": q(), "gpu": q()}, {"cpu": 16 * cpu_job, "gpu": 16.0})
    assert d.entitlement["cpu"] == pytest.approx(8) and d.entitlement["gpu"] == pytest.approx(8)
    assert d.entitlement["cpu"] / cpu_job == pytest.approx(4)
