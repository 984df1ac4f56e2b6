"""Philly jobs replayed in virtual time: strict FIFO versus our default scheduler with backfill.

    .venv/bin/python -m bench.philly [--trace FILE] [--start-day 70] [--days 7] [--warmup-days 2]
        [--loads 0.8,1.0,1.2] [--policy fgd] [--workers 2] [--json] [--markdown FILE] [--plot DIR]

The jobs submitted in a window of the trace (after a warm-up whose jobs run but
are not measured) are replayed through the scheduler service's own decision
function (services/simulation/engine.py) on identical 8-GPU nodes, as many as
make the window's GPU-seconds ``load`` x the cluster's. Each job's time limit is
its real duration. FIFO: a job never starts while an earlier one waits. Default:
the first blocked job gets a reservation and later jobs backfill around it.
Measured over the window's jobs: average and p99 queueing delay, average job
completion time, GPU utilization over the window, makespan (window start to the
last measured job's end).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from services.simulation.engine import SimResult, Simulation, live_policy
from services.simulation.report import plot_timelines
from services.simulation.traces import TraceJob, load_philly, philly_nodes_for_load, uniform_cluster, window

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "philly" / "philly_jobs.csv"
MODES = ("fifo", "backfill")
COLUMNS = (("avg_queue_delay_s", "avg wait s"), ("p99_queue_delay_s", "p99 wait s"), ("avg_jct_s", "avg JCT s"),
           ("utilization_pct", "utilization %"), ("makespan_s", "makespan s"), ("never_started", "never started"),
           ("events_per_s", "events/s"))


def workload(trace: Path, start_day: float, days: float, warmup_days: float) -> tuple[list[TraceJob], set[str], float, float]:
    """(jobs to replay, the measured ones, window start and end): warm-up jobs run but are not measured."""
    jobs = load_philly(trace)
    replay = window(jobs, start_day - warmup_days, days + warmup_days)
    t0 = warmup_days * 86400
    measured = {j.job_id for j in replay if j.submit >= t0}
    return replay, measured, t0, t0 + days * 86400


def run_one(args: tuple[str, float, float, float, float, str, str]) -> tuple[float, str, int, dict, SimResult]:
    trace, start_day, days, warmup, load, mode, policy = args
    jobs, measured, t0, t1 = workload(Path(trace), start_day, days, warmup)
    nodes = philly_nodes_for_load([j for j in jobs if j.job_id in measured], load)
    sim = Simulation(uniform_cluster(nodes), jobs, live_policy(policy, 0, backfill=mode == "backfill"), fifo=mode == "fifo",
                     start=0.0)
    result = sim.run()
    m = result.metrics(jobs=measured, window=(t0, t1))
    m["makespan_s"] = round(max((o.ended or 0.0) for j, o in result.outcomes.items() if j in measured) - t0, 3)
    m["nodes"], m["gpus"] = nodes, nodes * 8
    result.samples = result.samples[:: max(1, len(result.samples) // 4000)]  # enough for the plot
    return load, mode, nodes, m, result


def table(rows: list[tuple[float, str, dict]]) -> str:
    out = ["| load | GPUs | scheduler | " + " | ".join(c for _, c in COLUMNS) + " |",
           "|---|---|---|" + "---|" * len(COLUMNS)]
    for load, mode, m in rows:
        label = "FIFO" if mode == "fifo" else "default (backfill)"
        cells = [("-" if m[k] is None else f"{m[k]:,.0f}" if k != "utilization_pct" else f"{m[k]:.1f}") for k, _ in COLUMNS]
        out.append(f"| {load:.0%} | {m['gpus']} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.philly", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--start-day", type=float, default=70.0, help="window start, days after the trace's first job")
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--warmup-days", type=float, default=2.0, help="jobs of these days before the window run, unmeasured")
    ap.add_argument("--loads", default="0.8,1.0,1.2")
    ap.add_argument("--policy", default="fgd", help="node scorer of both schedulers")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="write philly_<load>.png into this directory")
    args = ap.parse_args(argv)
    if not args.trace.exists():
        print(f"error: no Philly trace at {args.trace} (the shared data folder is missing?): pass --trace", file=sys.stderr)
        return 2
    loads = [float(x) for x in args.loads.split(",")]
    jobs = [(str(args.trace), args.start_day, args.days, args.warmup_days, load, mode, args.policy)
            for load in loads for mode in MODES]
    t0 = time.perf_counter()
    results: dict[tuple[float, str], tuple[dict, SimResult]] = {}
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        for load, mode, nodes, m, r in pool.map(run_one, jobs):
            results[(load, mode)] = (m, r)
            print(f"load {load:.0%} {mode}: {nodes} nodes, {m['jobs']} jobs, avg wait {m['avg_queue_delay_s']} s, "
                  f"{m['wall_s']} s", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0
    rows = [(load, mode, results[(load, mode)][0]) for load in loads for mode in MODES]
    if args.json:
        print(json.dumps({"window": {"start_day": args.start_day, "days": args.days, "warmup_days": args.warmup_days},
                          "policy": args.policy, "results": [{"load": l, "scheduler": md, **m} for l, md, m in rows]}))
    else:
        print(table(rows))
    print(f"wall time {wall:.0f} s", file=sys.stderr)
    if args.markdown:
        cmd = f"python -m bench.philly {' '.join(argv if argv is not None else sys.argv[1:])}"
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(f"Command: `{cmd}`\n\nWall time: {wall:.0f} s with {args.workers} worker(s).\n\n"
                                 + table(rows) + "\n")
    if args.plot:
        for load in loads:
            runs = {("FIFO" if mode == "fifo" else "default (backfill)"): results[(load, mode)][1] for mode in MODES}
            plot_timelines(runs, args.plot / f"philly_{round(load * 100)}.png",
                           f"Philly days {args.start_day:g}-{args.start_day + args.days:g} at {load:.0%} load "
                           f"({results[(load, MODES[0])][0]['gpus']} GPUs), warm-up {args.warmup_days:g} d")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
