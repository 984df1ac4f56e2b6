"""The autoscaler's planning inside the simulator: bursts, idle timeouts, node-hours."""

from __future__ import annotations

from services.autoscaler.scaling import PoolSpec
from services.simulation.autoscaled import AutoscaledSimulation
from services.simulation.engine import live_policy
from services.simulation.traces import TraceJob
from tests.builders import job


def bursts() -> list[TraceJob]:
    out = []
    for burst, at in enumerate((0.0, 3000.0)):  # two bursts, 50 minutes apart
        for i in range(4):
            out.append(TraceJob(f"b{burst}-{i}", at, 600.0, job(f"b{burst}{i}").gpus(8).build()))
    return out


def run(idle_s: float) -> tuple[AutoscaledSimulation, dict]:
    sim = AutoscaledSimulation([], bursts(), live_policy("fgd+"), PoolSpec("p", "dgx-h100", 0, 8, 60, idle_s))
    return sim, sim.run().metrics()


def test_a_short_idle_timeout_buys_twice_and_a_long_one_keeps_the_nodes():
    short, m_short = run(idle_s=300)
    long_, m_long = run(idle_s=7200)
    assert m_short["completed"] == m_long["completed"] == 8
    assert short.pool.bought == 8 and long_.pool.bought == 4, "4 nodes per burst; the long timeout reuses them"
    assert short.node_hours() < long_.node_hours()
    assert m_long["avg_queue_delay_s"] < m_short["avg_queue_delay_s"], "warm nodes: the second burst does not wait"
