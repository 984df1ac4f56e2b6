"""The health rules inside the simulator: faults judged by the XID table, drains, lost nodes, time limits, repairs."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from typer import Typer
from typer.testing import CliRunner

from services.autoscaler.scaling import PoolSpec
from shared import events as ev
from services.health.rules import HealthPolicy
from services.simulate import simulate
from services.simulation.autoscaled import AutoscaledSimulation
from services.simulation.engine import SimResult, Simulation, live_policy
from services.simulation.faults import FaultEntry, FaultRate
from services.simulation.traces import TraceJob, uniform_cluster
from tests.builders import job

POLICY = HealthPolicy()  # heartbeat timeout 10 s (a round every 1 s), fault grace 30 s, drain on xid and ecc
LOST_AT = POLICY.heartbeat_timeout_s + 1.0  # silent longer than the timeout, seen at the next round


def train(name: str = "train", gpus: int = 8, duration: float = 1000, at: float = 0, retries: int = 0,
          limit: int | None = None) -> TraceJob:
    b = job(name).gpus(gpus)
    spec = (b.time_limit(limit) if limit else b).build().model_copy(update={"max_retries": retries})
    return TraceJob(name, at, duration, spec)


def run(jobs: Sequence[TraceJob], faults: Sequence[FaultEntry] = (), nodes: int = 2) -> tuple[Simulation, SimResult]:
    sim = Simulation(uniform_cluster(nodes), jobs, live_policy("fgd+"), health=POLICY, faults=list(faults))
    result = sim.run()
    assert result.invalid == []
    return sim, result


def nodes_of(sim: Simulation, job_id: str) -> set[str]:
    return {p.node_id for p in sim.proj.jobs[job_id].placements}


def first_node(jobs: Sequence[TraceJob], job_id: str = "train") -> str:
    """Where the job lands without faults (the replay is deterministic): the node to break."""
    sim, _ = run(jobs)
    (node,) = nodes_of(sim, job_id)
    return node


def test_xid_79_marks_the_gpu_cordons_and_drains_the_node_and_the_job_restarts_elsewhere_after_the_grace():
    jobs = [train()]
    bad = first_node(jobs)
    sim, result = run(jobs, [FaultEntry(t=100, node=bad, gpu=3, xid=79)])
    out, node = sim.outcomes["train"], sim.proj.nodes[bad]
    assert node.cordoned and list(node.unhealthy) == [node.info.gpus[3].uuid]
    assert "fallen off the bus" in node.unhealthy[node.info.gpus[3].uuid]
    assert nodes_of(sim, "train") != {bad}, "requeued on the other node"
    assert out.preemptions == 1 and out.state == "succeeded"
    assert out.ended == 100 + POLICY.fault_grace_s + 1000, "stopped with the grace, then run again from the start"
    assert out.interrupted_gpu_s == 8 * (100 + POLICY.fault_grace_s)
    h = result.health
    assert h is not None and h["faults"] == {"xid 79": 1}
    assert (h["gpus_marked"], h["nodes_cordoned"], h["jobs_preempted_by_drains"], h["nodes_drained"]) == (1, 1, 1, 1)


def test_with_checkpoints_a_restarted_job_runs_only_what_its_last_checkpoint_did_not_keep():
    jobs = [train()]
    bad = first_node(jobs)
    sim = Simulation(uniform_cluster(2), jobs, live_policy("fgd+"), health=POLICY,
                     faults=[FaultEntry(t=100, node=bad, gpu=3, xid=79)], checkpoint_s=60)
    sim.run()
    out = sim.outcomes["train"]
    stopped = 100 + POLICY.fault_grace_s  # ran 130 s: two checkpoints kept 120 s of it
    assert out.saved_s == 120 and out.interrupted_gpu_s == 8 * 10
    assert out.ended == stopped + 1000 - 120


def test_an_application_xid_marks_nothing_and_the_job_runs_on():
    jobs = [train()]
    sim, result = run(jobs, [FaultEntry(t=100, node=first_node(jobs), gpu=0, xid=13)])
    assert result.health is not None and result.health["faults"] == {"xid 13": 1} and result.health["gpus_marked"] == 0
    assert sim.outcomes["train"].ended == 1000 and sim.outcomes["train"].preemptions == 0


@pytest.mark.parametrize("retries", [0, 1])
def test_a_dead_node_is_lost_after_the_heartbeat_timeout_and_its_jobs_requeue_while_retries_last(retries: int):
    jobs = [train(retries=retries)]
    bad = first_node(jobs)
    sim, result = run(jobs, [FaultEntry(t=100, node=bad, lost=True)])
    out = sim.outcomes["train"]
    assert sim.proj.nodes[bad].lost and result.health is not None and result.health["nodes_lost"] == 1
    if retries:
        assert out.requeues == 1 and out.state == "succeeded" and nodes_of(sim, "train") != {bad}
        assert out.ended == 100 + LOST_AT + 1000, "never succeeds on the dead node; restarts when it is found lost"
    else:
        assert out.state == "failed" and out.ended == 100 + LOST_AT and result.health["jobs_failed"] == 1
        assert sim.proj.jobs["train"].reason.startswith(f"node lost: {bad}")


def test_a_job_placed_on_a_node_that_died_unnoticed_never_starts_and_is_requeued_when_it_is_lost():
    # half of each node is taken; the node holding "a" dies at 100; "late" arrives at 105 and fits only there
    jobs = [train("a", 4, retries=1), train("b", 8, duration=5000), train("late", 4, 500, at=105, retries=1)]
    sim, _ = run(jobs, [FaultEntry(t=100, node=first_node(jobs, "a"), lost=True)])
    late = sim.outcomes["late"]
    assert late.started == 105 and late.requeues == 1
    assert late.ended == 5000 + 500, "started again when b freed the healthy node"


def test_a_recorded_node_loss_requeues_its_jobs_like_a_detected_one():
    jobs = [train(retries=1)]
    bad = first_node(jobs)
    sim = Simulation(uniform_cluster(2), jobs, live_policy("fgd+"), health=POLICY,
                     infra=[(100.0, ev.NodeLost(node_id=bad, reason="recorded"))], start=0.0)
    sim.run()
    out = sim.outcomes["train"]
    assert out.requeues == 1 and out.ended == 100 + 1000 and nodes_of(sim, "train") != {bad}


def test_a_job_past_its_time_limit_is_stopped_and_its_gpus_go_to_the_next_job():
    jobs = [train("long", duration=500, limit=100), train("next", at=1)]
    sim, result = run(jobs, nodes=1)
    assert sim.outcomes["long"].state == "failed" and sim.proj.jobs["long"].reason == "time limit exceeded"
    assert sim.proj.jobs["long"].timed_out
    assert sim.outcomes["next"].started == 100 + 1.0, "the limit is seen at the next round"
    assert result.health is not None and (result.health["jobs_timed_out"], result.health["jobs_failed"]) == (1, 1)


def test_a_repaired_node_is_resumed_and_takes_work_again():
    jobs = [train(duration=1000)]
    sim, result = run(jobs, [FaultEntry(t=10, node="node-000", gpu=0, xid=48, repair_s=3600)], nodes=1)
    out = sim.outcomes["train"]
    assert out.ended == 10 + 3600 + 1000, "waits for the repair: the only node is cordoned"
    node = sim.proj.nodes["node-000"]
    assert not node.cordoned and not node.unhealthy
    h = result.metrics()["health"]
    assert h["faults"] == {"repaired": 1, "xid 48": 1}
    assert h["gpu_hours_out_of_service"] == 8.0, "8 GPUs for the hour of the repair"


def test_a_later_fault_without_a_repair_of_its_own_does_not_cancel_the_pending_one():
    jobs = [train(duration=1000)]
    faults = [FaultEntry(t=100, node="node-000", gpu=0, xid=79, repair_s=600),
              FaultEntry(t=200, node="node-000", gpu=1, xid=13)]  # an application XID: marks nothing
    sim, _ = run(jobs, faults, nodes=1)
    assert sim.outcomes["train"].ended == 100 + 600 + 1000, "resumed at 700 and run again"


def test_faults_drawn_at_a_rate_follow_it_and_the_seed():
    # 10 nodes x 8 GPUs for 100 days: 8,000 GPU-days; at 50 per 1,000 GPU-days, 400 faults expected
    jobs = [train("start", gpus=1, duration=1), train("end", gpus=1, duration=1, at=100 * 86400)]

    def draw(seed: int) -> dict[str, int]:
        sim = Simulation(uniform_cluster(10), jobs, live_policy("fgd+"), health=POLICY, faults=FaultRate(50, 4 * 3600, seed))
        h = sim.run().health
        assert h is not None
        return {k: v for k, v in h["faults"].items() if k != "repaired"}

    a = draw(1)
    total = sum(a.values())
    assert 320 <= total <= 480, f"{total} faults: 400 expected, 20 is one standard deviation"
    assert 0.15 <= a["node lost"] / total <= 0.35, "a quarter of the mix is node losses"
    assert draw(1) == a and draw(2) != a


def test_a_lost_pool_node_is_replaced_by_the_autoscaler_and_the_gang_restarts():
    gang = TraceJob("gang", 0, 3600, job("gang").gpus(8).tasks(2).build().model_copy(update={"max_retries": 1}))
    sim = AutoscaledSimulation([], [gang], live_policy("fgd+"), PoolSpec("p", "dgx-h100", 0, 4, 60, 300),
                               health=POLICY, faults=[FaultEntry(t=600, node="p-1", lost=True)])
    result = sim.run()
    out = sim.outcomes["gang"]
    assert result.invalid == [] and out.requeues == 1 and out.started == 60
    assert sim.pool.bought == 3, "two for the gang, one to replace the lost node"
    assert out.ended == 600 + LOST_AT + 60 + 3600, "found lost, a node bought and provisioned, then the whole run again"
    assert "p-1" not in sim.pool.nodes, "the lost node was idle past the timeout: terminated"


# --- the command ---------------------------------------------------------------------------


def cli() -> Typer:
    app = Typer()
    app.command()(simulate)
    return app


def philly_csv(path: Path) -> Path:
    rows = ["timestamp,duration,num_gpus,gpu_time,cluster"]
    for i in range(24):
        gpus = (1, 4, 8, 16)[i % 4]
        rows.append(f"2017-10-09 {8 + i // 4:02d}:{(i * 7) % 60:02d}:00,{1800 + 600 * (i % 5)},{gpus},0,c")
    path.write_text("\n".join(rows) + "\n")
    return path


def test_simulate_with_a_pool_and_faults_reports_node_hours_waits_and_health_for_two_idle_timeouts(tmp_path: Path):
    trace = philly_csv(tmp_path / "philly.csv")
    faults = tmp_path / "faults.yaml"
    faults.write_text("faults:\n  - {t: 900, node: pool-1, gpu: 2, xid: 79, repair_s: 7200}\n"
                      "  - {t: 1000, node: pool-2, lost: true}\n")
    out = tmp_path / "run"
    res = CliRunner().invoke(cli(), ["--trace", f"philly:{trace}", "--pool", "dgx-h100:8:60", "--idle-timeout", "300,3600",
                                     "--faults", str(faults), "--max-retries", "2", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.with_suffix(".json").read_text())
    assert set(doc["idle_timeouts"]) == {"300", "3600"}
    for r in doc["idle_timeouts"].values():
        assert r["nodes_bought"] >= 2 and r["node_hours"] > 0 and r["avg_queue_delay_s"] is not None
        assert r["completed"] == 24 and r["failed"] == 0, "every job finishes: retries cover the lost node"
        assert r["health"]["faults"] == {"node lost": 1, "xid 79": 1}, r["health"]
        assert r["health"]["gpus_marked"] == r["health"]["nodes_lost"] == 1 and r["health"]["jobs_requeued"] >= 1


@pytest.mark.parametrize("text, why", [
    ("- {t: 5, node: n, xid: 79, lost: true}\n", "either xid: N or lost: true"),
    ("- {t: -1, node: n, xid: 79}\n", "t: Input should be greater than or equal to 0"),
    ("- {t: 5, node: n, xid: 79, when: 3}\n", "when: Extra inputs are not permitted"),
    ("{nope\n", "cannot read faults"),
])
def test_bad_faults_are_refused_with_the_reason(tmp_path: Path, text: str, why: str):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text("jobs:\n  - {name: a, resources: {gpus: 1}, duration_s: 60}\n")
    faults = tmp_path / "faults.yaml"
    faults.write_text(text)
    res = CliRunner().invoke(cli(), ["--trace", f"jobs:{jobs}", "--faults", str(faults), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and why in " ".join(res.output.split()), res.output
