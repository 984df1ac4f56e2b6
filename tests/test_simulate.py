"""The simulator: the FGD paper's method, virtual-time replay through the scheduling core, and "what if" on a real log."""

from __future__ import annotations

import asyncio
import csv
import json
import random
from pathlib import Path

import pytest
from typer import Typer
from typer.testing import CliRunner

from services.scheduler.placement import NodeScorer
from services.simulate import log_report, simulate
from services.simulation.engine import Simulation, live_policy, simulate_jobs
from services.simulation.paper import Placer, arrivals, discretise, free_nodes, run_paper, target_workload
from services.simulation.recorded import read_log
from services.simulation.traces import OpenbNode, OpenbPod, TraceJob, philly_split, uniform_cluster
from shared.eventlog import EventLog
from shared.settings import Settings
from tests.builders import job, node
from tests.scheduler.reference_scores import RefNode, RefPod, best, commit, typical_pods
from tests.support import eventually, in_process_stack

# --- builders --------------------------------------------------------------------------

NODE_TYPES = [("G2", 8, 96_000, 393_216), ("T4", 2, 104_000, 524_288), ("P100", 2, 16_000, 122_880),
              ("V100M16", 4, 32_000, 131_072)]
POD_SHAPES = [(3152, 1, 810), (11_300, 1, 1000), (12_500, 0, 0), (8000, 1, 470), (4000, 1, 320), (32_000, 0, 0),
              (11_908, 1, 650), (4000, 1, 230), (16_000, 2, 1000), (24_000, 8, 1000)]


def openb_like(n_nodes: int, n_pods: int, seed: int = 1) -> tuple[list[OpenbNode], list[OpenbPod]]:
    rng = random.Random(seed)
    nodes = [OpenbNode(f"node-{i:03d}", cpu, mem, gpus, model)
             for i, (model, gpus, cpu, mem) in enumerate(rng.choice(NODE_TYPES) for _ in range(n_nodes))]
    pods = []
    for i in range(n_pods):
        cpu, k, m = rng.choices(POD_SHAPES, weights=[14, 20, 5, 10, 6, 4, 6, 3, 2, 1])[0]
        models = ("T4",) if k and rng.random() < 0.05 else ()
        pods.append(OpenbPod(f"pod-{i:04d}", cpu, rng.choice([4096, 16_384, 65_536]), k, m, models))
    return nodes, pods


def write_openb(tmp: Path, nodes: list[OpenbNode], pods: list[OpenbPod]) -> Path:
    with (tmp / "openb_node_list_gpu_node.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sn", "cpu_milli", "memory_mib", "gpu", "model"])
        w.writerows([n.name, n.cpu, n.mem, n.gpus, n.model] for n in nodes)
    pod_csv = tmp / "openb_pod_list_tiny.csv"
    with pod_csv.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec"])
        w.writerows([p.name, p.cpu, p.mem, p.count, p.milli, "|".join(p.models)] for p in pods)
    return pod_csv


def batch(n: int, gpus: float, every: float, duration: float, t0: float = 0.0, tasks: int = 1, name: str = "j") -> list[TraceJob]:
    """``n`` jobs every ``every`` s, each running ``duration`` s, which is also its time limit."""
    spec = job(name).gpus(gpus).tasks(tasks).time_limit(int(duration)).build()
    return [TraceJob(f"{name}-{i:03d}", t0 + i * every, duration, spec) for i in range(n)]


def cli() -> Typer:
    app = Typer()
    app.command()(simulate)
    app.command("noop")(lambda: None)  # two commands: `simulate` stays a subcommand, as under `gpuorch`
    return app


def timeless(doc: dict) -> dict:
    """The report without what depends on the machine's speed."""
    drop = {"wall_s", "events_per_s"}

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in drop}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return strip(doc)


# --- the FGD paper's method ------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fgd", "fgd+", "bestfit", "dotprod", "gpupacking", "gpuclustering"])
def test_the_class_placer_puts_every_pod_on_a_best_scoring_node_with_the_policys_gpus(policy: str) -> None:
    # the oracle scores every node with the method's formulas (tests/scheduler/reference_scores.py), not NodeScorer
    nodes, pods = openb_like(40, 260)
    shapes = typical_pods(p.typical_key for p in pods)
    typical = target_workload(pods)
    assert [(t.cpu, t.milli, t.count, t.models) for t in shapes] == [
        (t.cpu_milli, t.gpu_milli, t.gpu_count, t.models) for t in typical]
    assert [t.p for t in shapes] == pytest.approx([t.probability for t in typical], rel=1e-12)
    arr = arrivals(nodes, pods, seed=7)
    fast = Placer(free_nodes(nodes, arr.priority), NodeScorer(policy, typical, 7))
    ref = [RefNode(n.name, n.model, n.cpu, n.mem, [1000] * n.gpus) for n in nodes]
    seen = {"failed": 0, "tie broken": 0, "shared GPU": 0}
    for p in arr.pods:
        pod = RefPod(p.cpu, p.mem, p.count, p.milli, p.models if p.count else ())
        top = best(policy, ref, pod, shapes)
        got = fast.place(p.shape)
        if not top:
            assert got is None, f"{p.name}: placed on {got}, but no node is feasible"
            seen["failed"] += 1
            continue
        winner = min(top, key=lambda i: arr.priority[i])  # ties go to the smallest node priority (§0)
        assert got == (winner, top[winner]), f"{p.name} {pod}: best {top}, placed {got}"
        commit(ref[winner], pod, top[winner])
        seen["tie broken"] += len(top) > 1
        seen["shared GPU"] += pod.sharing and ref[winner].free[top[winner][0]] > 0
    assert all(seen.values()), f"every case reached: {seen}"


def test_the_paper_method_is_reproducible_for_a_seed_and_varies_across_seeds() -> None:
    nodes, pods = openb_like(30, 200)
    a, b, c = run_paper(nodes, pods, "fgd", 42), run_paper(nodes, pods, "fgd", 42), run_paper(nodes, pods, "fgd", 43)
    assert (a.arrived, a.allocated, a.curve()) == (b.arrived, b.allocated, b.curve())
    assert a.arrived != c.arrived


def test_resampling_appends_clones_until_the_next_per_gpu_milli_would_pass_the_target() -> None:
    nodes, pods = openb_like(12, 40)
    arr = arrivals(nodes, pods, seed=3, tune=1.3)
    target = 1.3 * 1000 * sum(n.gpus for n in nodes)
    total = sum(p.gpu_milli for p in arr.pods)
    assert sorted(p.name for p in arr.pods[: len(pods)]) == sorted(p.name for p in pods)  # originals first, shuffled
    assert arr.tuned == len(arr.pods) - len(pods) > 0
    assert total <= target + 7000  # at most one multi-GPU pod's overshoot
    assert sorted(arr.priority) == list(range(len(nodes)))


@pytest.mark.parametrize(
    "arrived, allocated, expected",
    [
        pytest.param([1000, 2000], [1000, 2000], {1: 1.0, 2: 2.0}, id="one row per bin"),
        pytest.param([1000, 1040, 3000], [900, 1000, 2000], {1: 0.95, 2: 1.3, 3: 2.0}, id="empty bin takes its neighbours"),
        pytest.param([2500, 3500], [2500, 3000], {2: 2.5, 4: 3.0}, id="2.5 and 3.5 round half to even"),
    ],
)
def test_discretisation_bins_by_rounded_arrived_percent(arrived, allocated, expected) -> None:
    curve = discretise(arrived, allocated, capacity=100_000, top=4)
    assert {x: curve[x] for x in expected} == expected


# --- virtual time through the scheduling core ---------------------------------------------


def test_the_same_trace_and_seed_give_identical_metrics(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(
        "jobs:\n"
        "  - {name: train, tasks: 2, resources: {gpus: 8}, submit_at: 0, duration_s: 3600}\n"
        "  - {name: small, resources: {gpus: 1}, submit_at: 10, duration_s: 600, count: 20}\n"
        "  - {name: frac, resources: {gpus: 0.5}, submit_at: 20, duration_s: 900, count: 12}\n"
        "  - {name: big, tasks: 3, resources: {gpus: 8}, submit_at: 30, duration_s: 1800}\n"
    )
    nodes, pods = openb_like(20, 150)
    pod_csv = write_openb(tmp_path, nodes, pods)
    for trace, extra in ((f"jobs:{jobs}", ["--compare", "bestfit,fgd+"]), (f"openb:{pod_csv}", ["--compare", "fgd+"])):
        docs = []
        for run in ("a", "b"):
            out = tmp_path / f"{run}-{trace.split(':')[0]}"
            res = CliRunner().invoke(cli(), ["simulate", "--trace", trace, "--seed", "5", "--out", str(out), *extra])
            assert res.exit_code == 0, res.output
            docs.append(json.loads(out.with_suffix(".json").read_text()))
            assert out.with_suffix(".png").stat().st_size > 10_000
        assert timeless(docs[0]["runs"]) == timeless(docs[1]["runs"])
        assert docs[0]["seed"] == 5 and "--seed 5" in docs[0]["command"]
        assert all(r.get("metrics", {}).get("invalid_transitions", 0) == 0 for r in docs[0]["runs"].values())


def test_fifo_never_starts_a_job_while_an_earlier_one_waits_and_backfill_does() -> None:
    # a whole node is busy for an hour; a two-node gang queues behind it; small jobs arrive after the gang
    jobs = [TraceJob("blocker", 0, 3600, job("blocker").gpus(8).build()),
            TraceJob("gang", 1, 600, job("gang").gpus(8).tasks(2).build())]
    jobs += batch(6, 1, 5, 300, t0=2, name="small")
    fifo = simulate_jobs(uniform_cluster(2), jobs, "fgd", fifo=True)
    backfill = simulate_jobs(uniform_cluster(2), jobs, "fgd")
    starts = {o.job_id: o.started for o in fifo.outcomes.values()}
    assert all(starts[j] >= starts["gang"] for j in starts if j.startswith("small"))
    assert all(o.started is not None and o.started < 3600 for j, o in backfill.outcomes.items() if j.startswith("small"))
    assert backfill.metrics()["avg_queue_delay_s"] < fifo.metrics()["avg_queue_delay_s"]
    assert backfill.outcomes["gang"].started == fifo.outcomes["gang"].started == 3600


def test_a_replay_stopped_midway_leaves_the_fold_consistent() -> None:
    jobs = batch(30, 1, 10, 200) + batch(10, 0.5, 7, 400, name="half") + batch(3, 8, 50, 100, tasks=2, name="gang")
    sim = Simulation(uniform_cluster(3), [j for j in jobs if j.submit < 150], live_policy("fgd"))
    result = sim.run(until=120)
    assert sim.queued and sim.holding
    assert result.invalid == [] and result.samples[-1].t <= 120
    held = sum(g.milli for j in sim.holding for p in sim.proj.jobs[j].placements for g in p.gpus)
    assert held == sim.allocated == sum(sum(n.gpu_alloc.values()) for n in sim.proj.nodes.values())


def test_philly_jobs_wider_than_a_node_become_gangs_of_whole_nodes() -> None:
    assert [philly_split(n) for n in (1, 4, 8, 12, 16, 64)] == [(1, 1), (1, 4), (1, 8), (3, 4), (2, 8), (8, 8)]


# --- what if, on a real log ------------------------------------------------------------------


async def test_a_recorded_history_replays_to_the_same_placements_and_shows_what_another_policy_changes(
    eventlog: EventLog, nats_url: str, tmp_path: Path
) -> None:
    shapes = [0.5, 1, 0.25, 2, 1, 0.5, 4, 1, 0.75, 1, 2, 0.5]
    async with in_process_stack(eventlog) as (client, services):
        nodes = [node("a").gpus(8).build(), node("b").gpus(4).build(), node("c").gpus(4).build()]
        await eventlog.append_many([_registered(n) for n in nodes])
        proj = services["scheduler"].projection
        await eventually(lambda: len(proj.nodes) == 3, what="nodes registered")
        ids = []
        for i, g in enumerate(shapes):  # one at a time: each live cycle decides on exactly one new job
            r = await client.post("/v1/jobs", json=job(f"j{i}").gpus(g).cpu(2000).build().model_dump(mode="json"))
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
            await eventually(lambda: proj.jobs[ids[-1]].state == "placed", what=f"j{i} placed")
        r = await client.post("/v1/jobs", json=job("wide").gpus(8).build().model_dump(mode="json"))
        wide = r.json()["id"]
        await eventually(lambda: proj.jobs[wide].reason != "", what="the 8-GPU job waits")
        holder = next(i for i in ids if any(p.node_id == "a" for p in proj.jobs[i].placements))
        for i in ids:  # free node a: the waiting job must land there
            if any(p.node_id == "a" for p in proj.jobs[i].placements):
                assert (await client.delete(f"/v1/jobs/{i}")).status_code == 200
        await eventually(lambda: proj.jobs[wide].state == "placed", what="the 8-GPU job placed")
        assert holder
    log = await read_log(nats_url)
    live = Settings().policy  # what the stack ran: the recorded policy
    assert log.policy == live and len(log.placements) == len(shapes) + 1

    doc, _ = await asyncio.to_thread(log_report, log, ["spread"], 0)
    same = doc["runs"][f"{live} (recorded)"]["versus_recorded"]
    assert same["same_placement"] == same["recorded_placements"] == len(shapes) + 1, same["differences"]
    other = doc["runs"]["spread"]["versus_recorded"]
    assert other["different_placement"] > 0 and other["differences"]

    out = tmp_path / "whatif"
    res = await asyncio.to_thread(CliRunner().invoke, cli(), ["simulate", "--from-log", nats_url, "--policy", "bestfit",
                                                              "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["input"]["recorded_policy"] == live and set(report["runs"]) == {f"{live} (recorded)", "bestfit"}
    assert report["runs"][f"{live} (recorded)"]["versus_recorded"]["different_placement"] == 0


def _registered(n):
    from shared import events as ev
    from shared.events import Envelope

    return Envelope(ev.NodeRegistered(node_id=n.node_id, node=n))
