"""Fold once per process: what one event costs the process that runs every service.

    python -m bench.fold [--jobs 2000] [--runs 3] [--json]

Starts `gpuorch up` (every service in one process, two simulated t4-4x nodes, bench.chaos.Stack) and fills its
8 GPUs with `sleep 3600` jobs, then posts ``--jobs`` jobs (`true`, 1 GPU) in batches of 100 and waits until every
service has folded them. It reads, around that, the stack process's own CPU time (/proc/<pid>/stat: user +
system, whatever else the machine runs) and its /metrics, and prints per 1,000 jobs submitted:

- CPU seconds of the stack process (API, appends, folds, cycles), and of its nats-server;
- events folded into a projection (``gpuorch_events_applied``, all services) per event appended;
- the wall time from the first POST until every service has folded the last event.

CPU seconds are the figure to compare before/after a change on a shared machine: wall time moves with the load
of other processes, CPU time much less.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.ingest import JOB, filled_stack, post

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14 and 15 of stat(5))


async def folded(c) -> tuple[float, int]:
    """(events folded by every service together, the lowest position any service has folded)."""
    families = {f.name: f for f in text_string_to_metric_families((await c.get("/metrics")).text)}
    applied = sum(s.value for s in families["gpuorch_events_applied"].samples if s.name.endswith("_total"))
    return applied, int(min(s.value for s in families["gpuorch_projection_seq"].samples))


async def until_folded(c, seq: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while (await folded(c))[1] < seq:
        if time.monotonic() > deadline:
            raise TimeoutError(f"services did not fold up to {seq} within {timeout}s")
        await asyncio.sleep(0.1)


async def last_seq(c) -> int:
    families = {f.name: f for f in text_string_to_metric_families((await c.get("/metrics")).text)}
    return int(max(s.value for s in families["gpuorch_projection_seq"].samples))


async def one_run(c, pid: int, nats_pid: int, jobs: int) -> dict[str, float]:
    await until_folded(c, await last_seq(c))
    applied0, seq0 = await folded(c)
    cpu0, nats0, t0 = cpu_seconds(pid), cpu_seconds(nats_pid), time.perf_counter()
    for _ in range(jobs // 100):
        await post(c, [JOB] * 100)
    head = await last_seq(c)
    await until_folded(c, head)
    wall, cpu, nats = time.perf_counter() - t0, cpu_seconds(pid) - cpu0, cpu_seconds(nats_pid) - nats0
    applied, seq = await folded(c)
    appended = max(seq - seq0, 1)
    return {"cpu_s_per_1000_jobs": cpu * 1000 / jobs, "nats_cpu_s_per_1000_jobs": nats * 1000 / jobs, "folds_per_event": (applied - applied0) / appended,
            "events_per_job": appended / jobs, "wall_s_per_1000_jobs": wall * 1000 / jobs}


async def measure(jobs: int, runs: int, root: Path) -> dict:
    async with filled_stack(root) as (stack, c):
        results = [await one_run(c, stack.proc.pid, stack.info()["nats_pid"], jobs) for _ in range(runs)]
    median = {k: statistics.median(r[k] for r in results) for k in results[0]}
    return {"cores": os.cpu_count(), "jobs": jobs, "runs": results, "median": median}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuorch-fold-") as root:
        r = asyncio.run(measure(args.jobs, args.runs, Path(root)))
    if args.json:
        print(json.dumps(r, indent=2))
        return
    m = r["median"]
    print(f"one process, {r['cores']} cores, {r['jobs']} jobs per run, median of {len(r['runs'])}:")
    print(f"  stack CPU s per 1,000 jobs : {m['cpu_s_per_1000_jobs']:.2f}")
    print(f"  nats-server CPU s per 1,000: {m['nats_cpu_s_per_1000_jobs']:.2f}")
    print(f"  folds per event appended   : {m['folds_per_event']:.2f}")
    print(f"  events per job             : {m['events_per_job']:.2f}")
    print(f"  wall s per 1,000 jobs      : {m['wall_s_per_1000_jobs']:.2f}")


if __name__ == "__main__":
    main()
