"""Pure autoscaling decisions."""

from __future__ import annotations

import math

from services.autoscaler.scaling import (DeploymentSpec, PoolSpec, PoolState, ReplicaHistory, desired_replicas,
                                         lost_to_replace, scale_down, scale_up)
from shared.profiles import build
from tests.builders import cluster, job, node


def pending_snapshot(*specs, nodes=()):
    c = cluster(*nodes)
    for i, s in enumerate(specs):
        c.pending(s, f"j{i}")
    return c.snapshot(now=100)


def pool(name="h100", profile="dgx-h100", max_nodes=10, **kw) -> PoolState:
    return PoolState(PoolSpec(name=name, profile=profile, max_nodes=max_nodes, **kw))


def test_a_gang_gets_the_fewest_nodes_that_make_it_placeable():
    snap = pending_snapshot(job("gang").gpus(8).tasks(3).build())
    assert scale_up(snap, [pool()], snap.pending, build) == {"h100": 3}


def test_gangs_that_fit_now_buy_nothing_and_the_cost_cap_and_max_bound_a_pool():
    snap = pending_snapshot(job("small").gpus(1).build(), nodes=[node("n").gpus(8)])
    assert scale_up(snap, [pool()], snap.pending, build) == {}
    big = pending_snapshot(job("gang").gpus(8).tasks(4).build())
    assert scale_up(big, [pool(max_nodes=2)], big.pending, build) == {}  # 2 nodes can never hold it: buy nothing
    capped = PoolState(PoolSpec(name="h100", profile="dgx-h100", max_nodes=10, cost_per_node_hour=30, hourly_cost_cap=100))
    assert capped.spec.affordable(0) == 3
    assert scale_up(big, [capped], big.pending, build) == {}


def test_a_whole_gang_goes_to_one_pool_that_can_hold_it():
    snap = pending_snapshot(job("h").gpus(8).tasks(2).models("H100-80GB").build())
    got = scale_up(snap, [pool("l4", "l4-8x"), pool("h100", "dgx-h100")], snap.pending, build)
    assert got == {"h100": 2}


def test_lost_pool_nodes_go_after_the_timeout_even_at_min_but_never_with_work():
    p = PoolState(PoolSpec(name="p", profile="t4-4x", min_nodes=3, max_nodes=5), nodes=("a", "b", "c"))
    got = lost_to_replace([p], busy={"b": True}, lost_since={"a": 0, "b": 0, "c": 95}, now=100, after_s=10)
    assert got == {"p": ["a"]}, "b still holds work, c is lost for 5 s only; min 3 keeps none of them"


def test_idle_nodes_past_the_timeout_go_never_below_min_never_busy():
    p = PoolState(PoolSpec(name="p", profile="t4-4x", min_nodes=1, max_nodes=5, idle_timeout_s=60), nodes=("a", "b", "c"))
    got = scale_down([p], busy={"c": True}, idle_since={"a": 0, "b": 10, "c": 0}, now=100)
    assert got == {"p": ["a", "b"]}
    got = scale_down([p], busy={}, idle_since={"a": 0, "b": 10, "c": 0}, now=100)
    assert len(got["p"]) == 2, "min 1 of 3 nodes stays"
    assert scale_down([p], busy={}, idle_since={"a": 50, "b": 50, "c": 50}, now=100) == {}


def test_a_metric_oscillating_around_the_target_changes_replicas_at_most_once_per_window():
    spec = DeploymentSpec("svc", min_replicas=1, max_replicas=10, target_pending_per_replica=10, stabilization_s=60)
    history, current, changes = ReplicaHistory(), 3, []
    for t in range(0, 600, 5):  # pending swings 25 <-> 35 around 3 replicas x 10
        pending = 25 + 10 * (t // 5 % 2)
        new = desired_replicas(spec, current, pending, float(t), history)
        if new != current:
            changes.append(t)
            current = new
    windows = [math.floor(t / 60) for t in changes]
    assert len(changes) == len(set(windows)) and len(changes) <= 600 / 60
    for a, b in zip(changes, changes[1:]):
        assert b - a >= 60


def test_replicas_follow_demand_and_go_to_zero_after_idle():
    spec = DeploymentSpec("svc", min_replicas=0, max_replicas=5, target_pending_per_replica=4, stabilization_s=10,
                          scale_to_zero_after_s=30)
    h = ReplicaHistory()
    assert desired_replicas(spec, 0, 17, 0.0, h) == 5
    n = 5
    for t in range(1, 100):
        n = desired_replicas(spec, n, 0, float(t), h)
    assert n == 0


def test_no_node_is_bought_for_a_queue_whose_limit_the_job_would_pass():
    from services.autoscaler.service import Autoscaler
    from shared.fairshare import Ratios
    from shared.model import GpuAmount, QueueSpec
    from shared.settings import Settings

    scaler = Autoscaler(Settings())
    scaler.proj.queues["capped"] = QueueSpec(limit=GpuAmount(gpus=8))
    four = pending_snapshot(job("four").gpus(4).queue("capped").build()).pending[0]
    heavy = pending_snapshot(job("heavy").gpus(1).cpu(32_000).queue("capped").build()).pending[0]
    ratios = Ratios.of(16, 64_000, 0)  # 4 CPUs per GPU: 32 CPUs are 8 GPUs' worth
    assert not scaler._at_limit("capped", four, {"capped": 4.0}, ratios)
    assert scaler._at_limit("capped", four, {"capped": 5.0}, ratios)
    assert scaler._at_limit("capped", heavy, {"capped": 1.0}, ratios), "its CPUs count against the limit"
    assert not scaler._at_limit("uncapped", four, {"uncapped": 100.0}, ratios)
