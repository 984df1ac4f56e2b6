"""JobSpec.tasks_per_node, what sbatch's --nodes=N means: the same number of tasks on each of N distinct nodes.
The scheduling core honours it: a node holds exactly that many tasks of the gang, or none."""

from __future__ import annotations

import pytest

from services.scheduler.core import Plan, Policy, run_cycle
from shared.model import JobSpec
from tests.builders import cluster, job, node


def per_node(spec: JobSpec, k: int) -> JobSpec:
    return JobSpec.model_validate({**spec.model_dump(), "tasks_per_node": k})


def tasks_on(plan: Plan, job_id: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in plan.placements[job_id].tasks:
        out[t.node_id] = out.get(t.node_id, 0) + 1
    return out


@pytest.mark.parametrize("policy", ["fgd+", "bestfit", "binpack", "spread"])
def test_one_task_per_node_spreads_a_gang_that_one_node_would_hold(policy: str) -> None:
    c = cluster(node("a").gpus(8), node("b").gpus(8))
    c.pending(per_node(job("two-nodes").gpus(4).tasks(2).build(), 1), "two-nodes")
    c.pending(job("one-node").gpus(2).tasks(2).build(), "one-node")

    plan = run_cycle(c.snapshot(), Policy(name=policy))

    assert tasks_on(plan, "two-nodes") == {"a": 1, "b": 1}
    assert len(tasks_on(plan, "one-node")) == 1, "without tasks_per_node a gang still prefers one node"


def test_each_node_used_holds_exactly_tasks_per_node_tasks() -> None:
    c = cluster(node("a").gpus(8), node("b").gpus(8), node("c").gpus(8))
    c.pending(per_node(job("ddp").gpus(1).tasks(8).build(), 4), "ddp")

    plan = run_cycle(c.snapshot())

    assert sorted(tasks_on(plan, "ddp").values()) == [4, 4]


def test_a_node_that_cannot_hold_tasks_per_node_tasks_is_left_out() -> None:
    c = cluster(node("a").gpus(8), node("b").gpus(8), node("c").gpus(8))
    c.running(job("busy").gpus(5).build(), on=[("b", [0, 1, 2, 3, 4])])
    c.pending(per_node(job("ddp").gpus(1).tasks(8).build(), 4), "ddp")

    plan = run_cycle(c.snapshot())

    assert tasks_on(plan, "ddp") == {"a": 4, "c": 4}


def test_a_gang_waits_when_fewer_nodes_than_it_asks_are_free_and_says_so() -> None:
    c = cluster(node("a").gpus(8), node("b").gpus(8))
    c.running(job("busy").gpus(1).build(), on=[("b", [0])])
    c.pending(per_node(job("two-nodes").gpus(8).tasks(2).build(), 1), "two-nodes")

    plan = run_cycle(c.snapshot(), Policy(backfill=False))

    assert plan.placements == {}
    assert "2 tasks × 8 GPUs, 1 on each of 2 nodes" in plan.unschedulable["two-nodes"]


def test_tasks_must_fill_every_node_alike() -> None:
    with pytest.raises(ValueError, match="not a multiple of tasks_per_node"):
        JobSpec(name="x", tasks=6, tasks_per_node=4)
    with pytest.raises(ValueError, match="topology node keeps the gang on one node"):
        JobSpec(name="x", tasks=4, tasks_per_node=2, topology="node")
    assert JobSpec(name="x", tasks=4, tasks_per_node=4, topology="node").tasks_per_node == 4
