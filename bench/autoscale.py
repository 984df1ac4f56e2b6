"""Autoscaling on a Philly replay: a pool of 0..N DGX nodes, node-hours bought and queueing delay for two idle timeouts,
without faults and with GPU faults and lost nodes drawn at given rates (the health rules inside the replay).

    python -m bench.autoscale [--jobs 400] [--max-nodes 64] [--delay 120] [--idle 300,3600]
                              [--faults 0,0.47,5] [--repair-h 4] [--max-retries 3] [--seed 0] [--checkpoint-min M]

Reads ../shared/data/philly/philly_jobs.csv (says so and stops when it is missing).
The cluster starts empty; nodes are bought by the autoscaler's real planning.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from services.autoscaler.scaling import PoolSpec
from services.simulation.autoscaled import AutoscaledSimulation
from services.simulation.engine import live_health, live_policy
from services.simulation.faults import FaultRate
from services.simulation.traces import load_philly

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "philly" / "philly_jobs.csv"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--jobs", type=int, default=400)
    ap.add_argument("--max-nodes", type=int, default=64)
    ap.add_argument("--delay", type=float, default=120, help="provision delay, seconds")
    ap.add_argument("--idle", default="300,3600", help="idle timeouts to compare, seconds")
    ap.add_argument("--faults", default="0,0.47,5", help="fault rates to compare, per 1,000 GPU-days (0.47: Llama 3's run)")
    ap.add_argument("--repair-h", type=float, default=4.0, help="hours until a faulted node is back")
    ap.add_argument("--max-retries", type=int, default=3, help="retries of every job after a lost node")
    ap.add_argument("--seed", type=int, default=0, help="seed of the fault draws")
    ap.add_argument("--checkpoint-min", type=float, default=None, help="jobs checkpoint every M minutes (default: never)")
    args = ap.parse_args()
    if not args.trace.exists():
        sys.exit(f"no Philly trace at {args.trace}: the shared data folder is missing")
    jobs = [replace(j, spec=j.spec.model_copy(update={"max_retries": args.max_retries}))
            for j in load_philly(args.trace, limit=args.jobs)]
    print(f"Philly, first {len(jobs)} jobs; pool dgx-h100 0..{args.max_nodes}, provision delay {args.delay:g} s; "
          f"faults repaired after {args.repair_h:g} h, {args.max_retries} retries, seed {args.seed}, "
          f"checkpoints {'every %g min' % args.checkpoint_min if args.checkpoint_min else 'none'}")
    print(f"{'faults/1k GPU-d':>15} {'idle s':>6} {'bought':>6} {'node-hours':>10} {'avg wait s':>10} {'p99 wait s':>10} "
          f"{'avg JCT h':>9} {'faults':>6} {'marked':>6} {'lost':>4} {'drained':>7} {'requeued':>8} {'failed':>6} "
          f"{'GPU-h cut':>9} {'GPU-h down':>10} {'wall s':>6}")
    for rate in (float(x) for x in args.faults.split(",")):
        for idle in (float(x) for x in args.idle.split(",")):
            t0 = time.perf_counter()
            sim = AutoscaledSimulation([], jobs, live_policy("fgd+"),
                                       PoolSpec("pool", "dgx-h100", 0, args.max_nodes, args.delay, idle),
                                       health=live_health(), faults=FaultRate(rate, args.repair_h * 3600 or None, args.seed),
                                       checkpoint_s=args.checkpoint_min and args.checkpoint_min * 60)
            m = sim.run().metrics()
            h = m["health"]
            injected = sum(v for k, v in h["faults"].items() if k not in ("repaired", "not present"))
            print(f"{rate:>15g} {idle:>6g} {sim.pool.bought:>6} {sim.node_hours():>10.1f} {m['avg_queue_delay_s']:>10.1f} "
                  f"{m['p99_queue_delay_s']:>10.1f} {m['avg_jct_s'] / 3600:>9.1f} {injected:>6} {h['gpus_marked']:>6} "
                  f"{h['nodes_lost']:>4} {h['jobs_preempted_by_drains']:>7} {h['jobs_requeued']:>8} {m['failed']:>6} "
                  f"{m['gpu_hours_interrupted']:>9.1f} {h['gpu_hours_out_of_service']:>10.1f} {time.perf_counter() - t0:>6.1f}")


if __name__ == "__main__":
    main()
