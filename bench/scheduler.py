"""Scheduling-cycle throughput: placements per second of ``run_cycle`` on big synthetic clusters.

    .venv/bin/python -m bench.scheduler [--nodes 1000 5000] [--jobs 10000] [--runs 5] [--policy fgd] [--busy 0.5]

Cluster: N nodes x 8 GPUs of three kinds (H100 with one NVSwitch domain, A100
with two NVLink domains of four, L40S on PCIe), 32 nodes per rack, 8 racks per
zone, empty at the start of the cycle (``--busy F``: a fraction F of the GPUs
already held by running jobs with time limits and mixed priorities, so the
cycle also takes a reservation, backfills and searches for victims). Workload: 10,000 pending jobs of mixed
shapes (fractional, 1, 2, 4, 8 GPUs per task; gangs of 1-8; some pinned to a
model, a rack, or one node; most with a time limit), drawn with a fixed seed.
A placement is one task (a pod, in kube-scheduler terms).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import statistics
import time
import tracemalloc

from services.scheduler.core import Policy, run_cycle
from services.scheduler.snapshot import GpuSnap, NodeSnap, PendingJob, RunningJob, Snapshot
from shared.model import GpuConstraints, JobSpec, TaskResources

ANCHORS = (
    ("kube-scheduler scheduler_perf, 5,000 nodes", "680 pods/s (180 pods/s with extended resources)"),
    ("YuniKorn", "833 pods/s"),
    ("Slurm", "500 jobs/s"),
    ("target (this machine, 5,000 nodes)", ">= 1,000 placements/s"),
)
KINDS = (("H100", 81920, "9.0", 1, 0.5), ("A100", 40960, "8.0", 2, 0.3), ("L40S", 46068, "8.9", 0, 0.2))


def make_nodes(n: int, seed: int = 7) -> tuple[NodeSnap, ...]:
    rng = random.Random(seed)
    nodes = []
    for i in range(n):
        model, mem, cc, domains, _ = rng.choices(KINDS, weights=[k[4] for k in KINDS])[0]
        node_id = f"n{i:05d}"
        gpus = tuple(
            GpuSnap(
                uuid=f"GPU-{node_id}-{g}",
                index=g,
                model=model,
                memory_mib=mem,
                compute_capability=cc,
                nvlink_domain=None if domains == 0 else f"{node_id}:nvl{g * domains // 8}",
            )
            for g in range(8)
        )
        rack = i // 32
        nodes.append(
            NodeSnap(node_id, gpus, {"pool": "train" if i % 5 else "serve"}, f"r{rack:03d}", f"z{rack // 8:02d}",
                     cpu_free=128_000, mem_free=1_048_576, cpu_total=128_000, mem_total=1_048_576)
        )
    return tuple(nodes)


def make_jobs(n: int, seed: int = 11) -> tuple[PendingJob, ...]:
    rng = random.Random(seed)
    sizes = [0.25, 0.5, 1, 2, 4, 8]
    size_w = [10, 10, 30, 20, 15, 15]
    gangs = [1, 2, 4, 8]
    gang_w = [70, 15, 10, 5]
    jobs = []
    for i in range(n):
        gpus = rng.choices(sizes, size_w)[0]
        tasks = rng.choices(gangs, gang_w)[0] if gpus >= 1 else 1
        per_gpu = max(gpus, 0.25)
        topology = rng.choices(["any", "node", "rack", "nvlink"], [60, 15, 15, 10])[0]
        if topology == "node" and tasks * gpus > 8:
            topology = "rack"
        models = rng.choices([(), ("H100",), ("A100",), ("H100", "A100")], [70, 15, 10, 5])[0]
        spec = JobSpec(
            name=f"j{i}",
            queue=rng.choice(["research.nlp", "research.vision", "prod.serve", "batch"]),
            priority=rng.choices(["low", "normal", "high"], [30, 60, 10])[0],
            tasks=tasks,
            resources=TaskResources(gpus=gpus, cpu_milli=int(16_000 * per_gpu), memory_mib=int(131_072 * per_gpu)),
            gpu=GpuConstraints(models=models),
            topology=topology,
            time_limit_s=rng.choice([None, 3600, 4 * 3600, 24 * 3600, 3 * 24 * 3600]),
        )
        jobs.append(PendingJob(f"job-{i:05d}", spec, submitted_at=float(i)))
    return tuple(jobs)


def occupy(nodes: tuple[NodeSnap, ...], fraction: float, seed: int = 13) -> tuple[tuple[NodeSnap, ...], tuple[RunningJob, ...]]:
    """Fill ``fraction`` of the GPUs with running jobs (placed by the scheduler itself, started in the past)."""
    if fraction <= 0:
        return nodes, ()
    rng = random.Random(seed)
    warm = make_jobs(len(nodes) * 4, seed=seed)
    plan = run_cycle(Snapshot(nodes, warm, (), None, 0.0), Policy(backfill=False, preempt=False, seed=seed), 0.0)
    specs = {j.job_id: j.spec for j in warm}
    goal, used = fraction * len(nodes) * 8000, 0
    gpu: dict[str, int] = {}
    cpu: dict[str, int] = {}
    mem: dict[str, int] = {}
    running = []
    for job_id, p in plan.placements.items():
        if used >= goal:
            break
        for t in p.tasks:
            cpu[t.node_id] = cpu.get(t.node_id, 0) + t.cpu_milli
            mem[t.node_id] = mem.get(t.node_id, 0) + t.memory_mib
            for g in t.gpus:
                gpu[g.uuid] = gpu.get(g.uuid, 0) + g.milli
                used += g.milli
        spec = specs[job_id]
        if spec.time_limit_s is None:
            spec = spec.model_copy(update={"time_limit_s": rng.choice([3600, 14_400, 86_400])})
        started = -rng.uniform(0, 3600)
        running.append(RunningJob(job_id, spec, p.tasks, placed_at=started, started_at=started))
    busy = tuple(
        dataclasses.replace(
            n,
            gpus=tuple(dataclasses.replace(g, free_milli=g.free_milli - gpu.get(g.uuid, 0)) for g in n.gpus),
            cpu_free=n.cpu_free - cpu.get(n.node_id, 0),
            mem_free=n.mem_free - mem.get(n.node_id, 0),
        )
        for n in nodes
    )
    return busy, tuple(running)


def measure(nodes: int, jobs: int, runs: int, policy: str, busy: float = 0.0) -> dict[str, float]:
    cluster, running = occupy(make_nodes(nodes), busy)
    snap = Snapshot(cluster, make_jobs(jobs), running, None, 0.0)
    pol = Policy(name=policy, seed=1)
    times, plan = [], None
    for _ in range(runs):
        gc.collect()
        t0 = time.perf_counter()
        plan = run_cycle(snap, pol, now=0.0)
        times.append(time.perf_counter() - t0)
    assert plan is not None
    tracemalloc.start()
    run_cycle(snap, pol, now=0.0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    tasks = sum(len(p.tasks) for p in plan.placements.values())
    gpus = sum(g.milli for p in plan.placements.values() for t in p.tasks for g in t.gpus) / 1000
    p50 = statistics.median(times)
    times.sort()
    p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
    return {
        "nodes": nodes, "gpus": nodes * 8, "jobs": jobs, "placed_jobs": len(plan.placements), "placed_tasks": tasks,
        "placed_gpus": gpus, "unschedulable": len(plan.unschedulable), "p50_s": p50, "p99_s": p99,
        "tasks_per_s": tasks / p50, "jobs_per_s": len(plan.placements) / p50, "peak_mib": peak / 2**20,
        "running": len(running), "preemptions": len(plan.preemptions), "reserved": plan.reservation is not None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1000, 5000])
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--policy", default="fgd")
    ap.add_argument("--busy", type=float, default=0.0, help="fraction of GPUs already running jobs")
    args = ap.parse_args()
    state = f"{args.busy:.0%} of GPUs busy" if args.busy else "empty cluster"
    print(f"run_cycle, policy {args.policy}, {args.jobs} pending jobs, {args.runs} runs per size, {state}")
    header = (
        f"{'nodes':>6} {'GPUs':>6} {'placed jobs':>11} {'tasks':>6} {'GPUs used':>9} {'p50 s':>7} {'p99 s':>7} "
        f"{'tasks/s':>8} {'jobs/s':>7} {'peak MiB':>8}"
    )
    print(header)
    for n in args.nodes:
        r = measure(n, args.jobs, args.runs, args.policy, args.busy)
        print(f"{r['nodes']:>6} {r['gpus']:>6} {r['placed_jobs']:>11} {r['placed_tasks']:>6} {r['placed_gpus']:>9.0f} "
              f"{r['p50_s']:>7.3f} {r['p99_s']:>7.3f} {r['tasks_per_s']:>8.0f} {r['jobs_per_s']:>7.0f} {r['peak_mib']:>8.1f}")
        if args.busy:
            print(f"       ({r['running']} running jobs, {r['preemptions']} preemptions, reservation: {r['reserved']})")
    print("anchors:")
    for name, value in ANCHORS:
        print(f"  {name}: {value}")


if __name__ == "__main__":
    main()
