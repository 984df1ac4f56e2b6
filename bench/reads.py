"""What the reads that walk every job cost with a large backlog, in process: a scrape's collectors and a cycle's read.

    python -m bench.reads [--jobs 20000] [--nodes 16] [--repeats 9]

A projection of ``--nodes`` DGX H100 nodes and ``--jobs`` queued jobs (1, 1, 2, 4 and 8 GPUs in turn), folded from
events as a service folds them. A stack that has run a while has had its job records read first by different
readers (a snapshot dumps some specs, a cycle makes some pending views, a list or a scrape asks some shares); the
bench does the same, a third of the jobs each, before timing ("mixed first readers"), and also times the records
read in one order only. Each figure is the median of ``--repeats`` calls, with the folds not running (no thread
contends), so it is the CPU a call holds the folds for on this machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from services.quota.metrics import QuotaCollector
from services.scheduler.metrics import SchedulerCollector
from services.scheduler.snapshot import snapshot_from_cluster
from shared import events as ev
from shared.cluster import ClusterProjection
from shared.events import Envelope
from shared.model import JobSpec
from shared.profiles import build

SHAPES = (1, 1, 2, 4, 8)


def backlog(nodes: int, jobs: int) -> ClusterProjection:
    proj, seq = ClusterProjection(), 0

    def fold(event: ev.Event) -> None:
        nonlocal seq
        seq += 1
        proj.apply(Envelope(event, seq=seq))

    for i in range(nodes):
        fold(ev.NodeRegistered(node_id=f"dgx-{i}", node=build("dgx-h100", f"dgx-{i}")))
    for i in range(jobs):
        spec = JobSpec(name="backlog", command=["sleep", "3600"], resources={"gpus": SHAPES[i % len(SHAPES)]})
        fold(ev.JobSubmitted(job_id=f"j-{i}", spec=spec))
        fold(ev.JobQueued(job_id=f"j-{i}"))
    return proj


def mix_first_readers(proj: ClusterProjection) -> None:
    """Each third of the records read first by another reader, as a stack's snapshots, cycles and lists do."""
    ratios = proj.share_ratios()
    for i, job in enumerate(proj.jobs.values()):
        if i % 3 == 0:
            job.spec_json()
        elif i % 3 == 1:
            job.share(ratios)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.reads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    for mixed in (False, True):
        proj = backlog(args.nodes, args.jobs)
        if mixed:
            mix_first_readers(proj)
        scheduler, quota = SchedulerCollector(lambda: proj), QuotaCollector(lambda: proj, 7 * 86400.0)
        figures = {
            "scrape: scheduler collector": median_ms(lambda: list(scheduler.collect()), args.repeats),
            "scrape: quota collector": median_ms(lambda: list(quota.collect()), args.repeats),
            "cycle read (snapshot + queue loads)": median_ms(
                lambda: (snapshot_from_cluster(proj, 0.0), proj.queue_loads()), args.repeats),
        }
        label = "mixed first readers" if mixed else "one first reader"
        print(f"{args.jobs} queued jobs, {args.nodes} nodes, {label}: " +
              ", ".join(f"{k} {v:.1f} ms" for k, v in figures.items()))


if __name__ == "__main__":
    main()
