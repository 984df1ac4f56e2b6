"""The quota rules of the design, each stated so that breaking it fails a test: dominant share, usage decay,
guarantees, limits, and how much a queue is owed back.

``python -m bench.mutants`` breaks these rules one at a time in a copy of the code; the mutants each test
kills are named in docs/benchmarks/mutants.md. Every expected figure is worked out by hand (or, for decay, by
summing the half-life curve numerically here), never by calling the code under test.
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from shared import events as ev
from shared.cluster import ClusterProjection
from shared.events import Envelope, GpuShare, TaskPlacement
from shared.fairshare import Ratios, accrue, divide, job_share, reclaim_requests
from shared.model import GpuAmount, QueueSpec
from tests.builders import gpu_uuid, job, node

HOUR = 3600.0
BASE = 1_795_510_800.0  # an hour boundary (2026-11-24T09:00:00Z)


def q(guaranteed: float = 0, limit: float | None = None, weight: float = 1) -> QueueSpec:
    return QueueSpec(guaranteed=GpuAmount(gpus=guaranteed), limit=None if limit is None else GpuAmount(gpus=limit),
                     weight=weight)


# --- dominant share ------------------------------------------------------------------------------------------------

CLUSTER = Ratios(cpu_milli=4_000, memory_mib=65_536)  # per GPU: 16 GPUs, 64 CPUs and 1 TiB


@pytest.mark.parametrize("tasks, gpus, cpu, mem, expected", [
    (1, 0, 8_000, 0, 2),  # a CPU-only job: 8 of 64 CPUs is 2 of 16 GPUs' worth
    (1, 1, 16_000, 0, 4),  # a quarter of the CPUs outweighs its one GPU
    (1, 1, 0, 262_144, 4),  # a quarter of the memory outweighs its one GPU
    (3, 2, 0, 0, 6),  # every task counts
    (2, 1, 16_000, 65_536, 8),  # per task: 4 CPUs' worth; two tasks
])
def test_a_jobs_share_is_its_largest_share_of_any_resource_over_all_its_tasks(tasks, gpus, cpu, mem, expected) -> None:
    spec = job("j").gpus(gpus).cpu(cpu).mem(mem).tasks(tasks).build()

    assert job_share(spec, CLUSTER) == pytest.approx(expected)


# --- decay ---------------------------------------------------------------------------------------------------------


def integral(gpus: float, start: float, end: float, now: float, half_life: float, steps: int = 20_000) -> float:
    """GPU-seconds held in [start, end), each second weighted 2^-(age / half_life) at ``now`` (midpoint rule)."""
    dt = (end - start) / steps
    return sum(gpus * dt * 2.0 ** (-(now - (start + (i + 0.5) * dt)) / half_life) for i in range(steps))


def test_decayed_usage_is_the_usage_weighted_by_its_age() -> None:
    h = 2 * HOUR
    # 2 GPUs held for one half-life, seen at its end; usage of 1000 from before fades to half meanwhile
    assert accrue(1000.0, 2, h, h) == pytest.approx(1000.0 / 2 + integral(2, 0, h, h, h), rel=1e-6)
    # and a quarter after two half-lives with nothing held
    assert accrue(1000.0, 0, 2 * h, h) == pytest.approx(250.0)


def fold(*holdings: tuple[str, str, float, float]) -> ClusterProjection:
    """(job, queue, start, end) one GPU each on n1, as the log holds them; queues a and b; both want more."""
    proj = ClusterProjection()
    first = min([BASE, *(start for _, _, start, _ in holdings)]) - HOUR
    envs = [(first, ev.NodeRegistered(node_id="n1", node=node("n1").gpus(8).build())),
            *((first, ev.QueueDefined(path=p, spec=QueueSpec())) for p in ("a", "b"))]
    for i, (job_id, queue, start, end) in enumerate(holdings):
        share = GpuShare(uuid=gpu_uuid("n1", i), milli=1000)
        envs += [(start, ev.JobSubmitted(job_id=job_id, spec=job(job_id).gpus(1).queue(queue).build())),
                 (start, ev.JobQueued(job_id=job_id)),
                 (start, ev.JobPlaced(job_id=job_id, placements=(TaskPlacement(task=0, node_id="n1", gpus=(share,)),))),
                 (end, ev.JobSucceeded(job_id=job_id))]
    for p in ("a", "b"):  # waiting work in both: both want all 8 GPUs
        envs += [(BASE - HOUR, ev.JobSubmitted(job_id=f"wait-{p}", spec=job("w").gpus(8).queue(p).build())),
                 (BASE - HOUR, ev.JobQueued(job_id=f"wait-{p}"))]
    for seq, (t, e) in enumerate(sorted(envs, key=lambda te: te[0]), start=1):
        assert proj.apply(replace(Envelope(e, time=datetime.fromtimestamp(t, UTC)), seq=seq)), proj.invalid_transitions
    return proj


def test_an_hour_used_one_half_life_ago_counts_half() -> None:
    proj = fold(("j", "a", BASE, BASE + HOUR))
    half_life = 6 * HOUR

    usage = proj.decayed_usage(BASE + HOUR / 2 + half_life, half_life)  # the hour counts at its middle

    assert usage["a"] == pytest.approx(HOUR / 2)


def test_the_queue_that_used_the_gpus_lately_is_entitled_to_less_than_the_one_that_used_them_long_ago() -> None:
    week = 7 * 24 * HOUR
    proj = fold(("old", "a", BASE - week, BASE - week + 10 * HOUR), ("new", "b", BASE - 10 * HOUR, BASE))

    ent = proj.division(BASE, half_life_s=24 * HOUR).entitlement

    assert ent["a"] + ent["b"] == pytest.approx(8)
    assert ent["b"] < 3.5 < 4.5 < ent["a"], ent


def test_usage_lowers_a_queues_weight_in_proportion_to_its_share() -> None:
    # weights 2:1, only "a" has used anything: its weight 2 is lowered, so it gets less than two thirds
    ent = divide(90, {"a": q(weight=2), "b": q(weight=1)}, {"a": 1000, "b": 1000}, usage={"a": 100.0}).entitlement
    assert ent["a"] < 60 - 1 and ent["b"] > 30 + 1
    # Slurm's factor 2^-(usage share / weight share): a's weight 2 x 2^-(1 / (2/3)) = 0.707, against b's 1
    assert ent["a"] / ent["b"] == pytest.approx(2 * 2 ** -1.5)


# --- guarantees ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity, queues, demand, expected", [
    pytest.param(40, {"a": q(30, weight=1), "b": q(0, weight=9)}, {"a": 100, "b": 100}, {"a": 31, "b": 9},
                 id="a guarantee is served before any weight"),
    pytest.param(40, {"a": q(30), "b": q()}, {"a": 5, "b": 100}, {"a": 5, "b": 35},
                 id="an idle guarantee is lent to others"),
    pytest.param(30, {"a": q(40), "b": q(20)}, {"a": 100, "b": 100}, {"a": 20, "b": 10},
                 id="guarantees larger than the cluster shrink in proportion"),
])
def test_guarantees(capacity, queues, demand, expected) -> None:
    ent = divide(capacity, queues, demand).entitlement
    assert {k: ent[k] for k in expected} == pytest.approx(expected)


# --- limits --------------------------------------------------------------------------------------------------------


def test_a_parents_limit_caps_its_children_together_and_the_rest_goes_to_others() -> None:
    queues = {"team": q(limit=10), "team.a": q(), "team.b": q(), "other": q()}

    ent = divide(40, queues, {"team.a": 100, "team.b": 100, "other": 100}).entitlement

    assert ent == pytest.approx({"team": 10, "team.a": 5, "team.b": 5, "other": 30})


def test_a_queues_limit_caps_its_entitlement_however_large_its_weight() -> None:
    ent = divide(40, {"a": q(limit=4, weight=9), "b": q()}, {"a": 100, "b": 100}).entitlement
    assert ent == pytest.approx({"a": 4, "b": 36})


# --- what a queue is owed back -------------------------------------------------------------------------------------


QUEUES = {"research": q(60), "prod": q(40)}


@pytest.mark.parametrize("allocated, waiting, entitlement, smallest, owed", [
    pytest.param({"research": 0, "prod": 100}, {"research": 100}, {"research": 50, "prod": 50}, None,
                 [("research", 50)], id="capped by the entitlement, below the guarantee"),
    pytest.param({"research": 50, "prod": 50}, {"research": 100}, {"research": 50, "prod": 50}, None, [],
                 id="holding its entitlement, it is owed nothing though below its guarantee"),
    pytest.param({"research": 0, "prod": 100}, {"research": 100}, {"research": 80, "prod": 20}, None,
                 [("research", 60)], id="capped by the guarantee, below the entitlement"),
    pytest.param({"research": 0, "prod": 100}, {"research": 10}, {"research": 60, "prod": 40}, None,
                 [("research", 10)], id="capped by what waits"),
    pytest.param({"research": 58, "prod": 42}, {"research": 8}, {"research": 60, "prod": 40}, {"research": 4}, [],
                 id="not for less than its smallest waiting job"),
    pytest.param({"research": 58, "prod": 42}, {"research": 8}, {"research": 60, "prod": 40}, {"research": 1}, [],
                 id="not for a deficit within 5 percent of the guarantee"),
    pytest.param({"research": 50, "prod": 50}, {"research": 8}, {"research": 60, "prod": 40}, {"research": 4},
                 [("research", 8)], id="for a deficit its waiting jobs can use"),
])
def test_what_a_queue_is_owed(allocated, waiting, entitlement, smallest, owed) -> None:
    got = reclaim_requests(QUEUES, allocated, waiting, entitlement, smallest)
    assert [(name, pytest.approx(gpus)) for name, gpus in owed] == got


def test_a_queue_whose_guarantee_the_cluster_cannot_cover_is_owed_its_entitlement_not_its_guarantee() -> None:
    queues = {"research": q(60), "prod": q(60)}  # 120 guaranteed on 100 GPUs: 50 each
    ent = divide(100, queues, {"research": 100, "prod": 100}).entitlement

    assert reclaim_requests(queues, {"research": 0, "prod": 100}, {"research": 100}, ent) == [
        ("research", pytest.approx(50))]
    assert not math.isclose(ent["research"], 60)
