"""Autoscaling on a Philly replay: a pool of 0..N DGX nodes, node-hours bought and queueing delay for two idle timeouts.

    python -m bench.autoscale [--jobs 400] [--max-nodes 64] [--delay 120] [--idle 300,3600]

Reads ../shared/data/philly/philly_jobs.csv (says so and stops when it is missing).
The cluster starts empty; nodes are bought by the autoscaler's real planning.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from services.autoscaler.scaling import PoolSpec
from services.simulation.autoscaled import AutoscaledSimulation
from services.simulation.engine import live_policy
from services.simulation.traces import load_philly

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "philly" / "philly_jobs.csv"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--jobs", type=int, default=400)
    ap.add_argument("--max-nodes", type=int, default=64)
    ap.add_argument("--delay", type=float, default=120, help="provision delay, seconds")
    ap.add_argument("--idle", default="300,3600", help="idle timeouts to compare, seconds")
    args = ap.parse_args()
    if not args.trace.exists():
        sys.exit(f"no Philly trace at {args.trace}: the shared data folder is missing")
    jobs = load_philly(args.trace, limit=args.jobs)
    print(f"Philly, first {len(jobs)} jobs; pool dgx-h100 0..{args.max_nodes}, provision delay {args.delay:g} s")
    print(f"{'idle timeout':>12} {'nodes bought':>12} {'node-hours':>10} {'avg wait s':>10} {'p99 wait s':>10} {'avg JCT h':>9} {'wall s':>6}")
    for idle in (float(x) for x in args.idle.split(",")):
        t0 = time.perf_counter()
        sim = AutoscaledSimulation([], jobs, live_policy("fgd+"),
                                   PoolSpec("pool", "dgx-h100", 0, args.max_nodes, args.delay, idle))
        m = sim.run().metrics()
        print(f"{idle:>12g} {sim.pool.bought:>12} {sim.node_hours():>10.1f} {m['avg_queue_delay_s']:>10.1f} "
              f"{m['p99_queue_delay_s']:>10.1f} {m['avg_jct_s'] / 3600:>9.1f} {time.perf_counter() - t0:>6.1f}")


if __name__ == "__main__":
    main()
