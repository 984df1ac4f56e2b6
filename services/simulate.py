"""`gpuorch simulate`: replay a trace, or our own event history, through the scheduling core in virtual time.

Inputs: ``--trace openb:DIR|POD_CSV`` (the FGD paper's method by default; ``--mode time``
replays creation/deletion times), ``--trace philly:FILE`` (time-based, on 8-GPU nodes
sized by ``--nodes`` or ``--load``), ``--trace jobs:DIR|YAML`` (our own job files), or
``--from-log DATA_DIR|NATS_URL`` (the submissions a gpuorch event log recorded,
replayed under the recorded policy and, with ``--policy X``, under X: "what if we had
used X"). Time-based replays run the health rules too (time limits; with ``--faults``, GPU
faults and lost nodes: cordon, drain, requeue), and ``--pool`` adds the autoscaler. Output: a metrics JSON and a PNG next to each other (``--out``), a summary
on the terminal, the seed and the command that reproduce the run exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from services.scheduler.placement import POLICIES
from services.simulation import report
from services.simulation.engine import SimResult, Simulation, live_health, live_policy, simulate_jobs
from services.simulation.faults import Faults, parse_faults
from services.simulation.paper import PaperRun, run_paper
from services.simulation.recorded import RecordedLog, compare, recorded
from services.simulation.traces import (
    TraceError, TraceJob, load_job_files, load_openb_nodes, load_openb_pods, load_philly, openb_cluster, openb_jobs,
    openb_paths, philly_nodes_for_load, profile_cluster, uniform_cluster, window, workload_name,
)
from shared.model import NodeInfo
from shared.settings import Settings

KINDS = ("openb", "philly", "jobs")
PAPER_SEED = 42  # the paper's first seed; time-based runs default to the live scheduler's seed, 0


def parse_trace(text: str) -> tuple[str, Path]:
    kind, sep, path = text.partition(":")
    if not sep or kind not in KINDS or not path:
        raise TraceError(f"--trace takes KIND:PATH with KIND one of {', '.join(KINDS)}, got {text!r}")
    p = Path(path).expanduser()
    if not p.exists():
        raise TraceError(f"{p} does not exist")
    return kind, p


def parse_policies(policy: str | None, compare_with: str | None) -> list[str]:
    names = [n.strip() for n in ",".join(x for x in (policy, compare_with) if x).split(",") if n.strip()]
    for n in names:
        if n not in POLICIES:
            raise TraceError(f"unknown policy {n!r}; choose from {', '.join(POLICIES)}")
    return list(dict.fromkeys(names))


@contextlib.contextmanager
def progress_bar(enabled: bool, what: str) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar on stderr (a terminal only); yields the update callback or None."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=None)
        last = [0.0]

        def update(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] > 0.2 or done >= total:
                bar.update(task, completed=done, total=total)
                last[0] = now

        yield update


# --- the three kinds of run -----------------------------------------------------------


def paper_report(node_csv: Path, pod_csv: Path, policies: list[str], seed: int, load: float,
                 progress: bool = False) -> tuple[dict[str, Any], dict[str, list[PaperRun]]]:
    """The FGD paper's method on one openb workload: one run per policy with this seed."""
    nodes, pods = load_openb_nodes(node_csv), load_openb_pods(pod_csv)
    out: dict[str, Any] = {"input": {"trace": f"openb:{pod_csv}", "nodes_csv": str(node_csv), "method": "fgd-paper",
                                     "workload": workload_name(pod_csv), "nodes": len(nodes),
                                     "gpus": sum(n.gpus for n in nodes), "pods": len(pods), "load": load},
                           "runs": {}}
    runs: dict[str, list[PaperRun]] = {}
    for name in policies:
        with progress_bar(progress, f"{name} seed {seed}") as bar:
            r = run_paper(nodes, pods, name, seed, load, on_pod=bar)
        runs[name] = [r]
        curve = r.curve(round(load * 100))
        out["runs"][name] = {
            "allocation_pct": {str(x): curve.get(x) for x in (100, 110, 120, 130) if x in curve},
            "pods_arrived": len(r.arrived), "pods_failed": r.failed, "pods_resampled": r.tuned,
            "simulated_events": len(r.arrived), "wall_s": round(r.seconds, 3),
            "events_per_s": round(len(r.arrived) / r.seconds) if r.seconds else None,
            "curve": curve,
        }
    return out, runs


def time_report(nodes: tuple[NodeInfo, ...], jobs: list[TraceJob], policies: list[str], seed: int, *,
                fifo: bool = False, backfill: bool = True, progress: bool = False,
                trace: str = "", health: bool = True, faults: Faults = (),
                checkpoint_s: float | None = None) -> tuple[dict[str, Any], dict[str, SimResult]]:
    out: dict[str, Any] = {"input": {"trace": trace, "nodes": len(nodes), "gpus": sum(len(n.gpus) for n in nodes),
                                     "jobs": len(jobs), "fifo": fifo, "backfill": backfill and not fifo,
                                     "health": health, "faults": describe_faults(faults), "checkpoint_s": checkpoint_s},
                           "runs": {}}
    results = {}
    for name in policies:
        with progress_bar(progress, name) as bar:
            r = simulate_jobs(nodes, jobs, name, seed, backfill=backfill, fifo=fifo, progress=bar,
                              health=live_health() if health else None, faults=faults, checkpoint_s=checkpoint_s)
        label = f"{name}{' fifo' if fifo else ''}"
        results[label] = r
        out["runs"][label] = {"metrics": r.metrics(), "timeline": report.timeline(r)}
    return out, results


def log_report(log: RecordedLog, policies: list[str], seed: int, progress: bool = False,
               source: str = "") -> tuple[dict[str, Any], dict[str, SimResult]]:
    """Replay the recorded submissions under the recorded policy (it must reproduce every recorded
    placement) and under each other policy asked for (what would have changed)."""
    rec = log.policy
    names = [rec] + [p for p in policies if p != rec]
    out: dict[str, Any] = {"input": {"from_log": source, "events": log.events, "jobs": len(log.jobs),
                                     "recorded_policy": rec, "recorded_policies": dict(log.policies),
                                     "nodes": sum(1 for _, e in log.infra if e.TYPE == "node.registered")},
                           "runs": {}}
    results = {}
    for name in names:
        with progress_bar(progress, name) as bar:
            sim = Simulation((), log.jobs, live_policy(name, seed), infra=log.infra, start=log.start)
            r = sim.run(bar)
        label = (f"{name} (recorded)" if log.policies else f"{name} (live default)") if name == rec else name
        results[label] = r
        out["runs"][label] = {"metrics": r.metrics(), "versus_recorded": compare(log, r),
                              "timeline": report.timeline(r)}
    return out, results


async def read_history(target: str) -> RecordedLog:
    """A running stack's NATS URL, or a stopped stack's data dir (its nats-server is started for the read)."""
    from shared.events import Envelope

    if "://" in target:
        from services.simulation.recorded import read_log

        return await read_log(target)
    from services.cli import open_log

    async with open_log(None, Path(target)) as evlog:
        return recorded([rec async for rec in evlog.replay(1) if isinstance(rec, Envelope)])


# --- the command ------------------------------------------------------------------------


def describe_faults(faults: Faults) -> str | dict[str, float | None] | None:
    if isinstance(faults, list):
        return f"{len(faults)} listed" if faults else None
    return {"per_1000_gpu_days": faults.per_1000_gpu_days, "repair_h": faults.repair_s and faults.repair_s / 3600,
            "seed": faults.seed}


def with_retries(jobs: list[TraceJob], max_retries: int | None) -> list[TraceJob]:
    """Every job retried this many times after a lost node (None: as each job says)."""
    if max_retries is None:
        return jobs
    return [replace(j, spec=j.spec.model_copy(update={"max_retries": max_retries})) for j in jobs]


def health_line(m: dict[str, Any]) -> str:
    """One run's health figures, from its metrics."""
    h = m["health"]
    faults = ", ".join(f"{n} {k}" for k, n in h["faults"].items()) or "none"
    return (f"faults: {faults}; {h['gpus_marked']} GPUs marked, {h['nodes_lost']} nodes lost, "
            f"{h['jobs_preempted_by_drains']} jobs preempted by drains, {h['jobs_requeued']} requeued, "
            f"{h['jobs_failed']} failed ({h['jobs_timed_out']} at their time limit); "
            f"{h['gpu_hours_out_of_service']} GPU-h out of service, {m['gpu_hours_interrupted']} GPU-h of runs cut short")


def _run_autoscaled(trace: str, pool: str, idle: str, policy: str, limit: int | None, days: str | None,
                    out: Path, as_json: bool, faults: str | None = None, max_retries: int | None = None,
                    seed: int = 0, health: bool = True, checkpoint_s: float | None = None) -> None:
    """A time-based trace on an empty cluster whose pool the autoscaler's planner grows and shrinks."""
    from rich.console import Console

    from services.autoscaler.scaling import PoolSpec
    from services.simulation.autoscaled import AutoscaledSimulation
    from services.simulation.engine import live_policy

    try:
        kind, path = parse_trace(trace)
        profile, max_nodes, *rest = pool.split(":")
        timeouts = [float(x) for x in idle.split(",")]
        delay = float(rest[0]) if rest else 120.0
        jobs = load_philly(path) if kind == "philly" else load_job_files(path) if kind == "jobs" else None
        if jobs is None:
            raise TraceError("--pool takes a philly: or jobs: trace")
        jobs.sort(key=lambda j: (j.submit, j.job_id))
        if days:
            start, _, span = days.partition(":")
            jobs = window(jobs, float(start), float(span or 1))
        jobs = with_retries(jobs[:limit] if limit else jobs, max_retries)
        injected = parse_faults(faults, seed) if faults else []
        if injected and not health:
            raise TraceError("--faults takes the health rules: drop --no-health")
        runs = {}
        for t in timeouts:
            sim = AutoscaledSimulation([], jobs, live_policy(policy, seed), PoolSpec("pool", profile, 0, int(max_nodes), delay, t),
                                       health=live_health() if health else None, faults=injected,
                                       checkpoint_s=checkpoint_s)
            m = sim.run().metrics()
            runs[f"{t:g}"] = {"nodes_bought": sim.pool.bought, "node_hours": round(sim.node_hours(), 1), **m}
    except (TraceError, ValueError) as e:
        _stderr().print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    doc = {"trace": trace, "pool": pool, "policy": policy, "seed": seed, "faults": describe_faults(injected),
           "checkpoint_s": checkpoint_s, "idle_timeouts": runs}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    if as_json:
        print(json.dumps(doc, indent=2))
        return
    console = Console()
    for t, r in runs.items():
        console.print(f"idle timeout {t} s: {r['nodes_bought']} nodes bought, {r['node_hours']} node-hours, "
                      f"average wait {r['avg_queue_delay_s']} s, p99 {r['p99_queue_delay_s']} s")
        if "health" in r:
            console.print(f"  {health_line(r)}", highlight=False)


def _run_scenario(name: str, hours: float, seed: int, out: Path, as_json: bool) -> None:
    """Queues sharing a cluster through the live fold, fair share and cycle (services/simulation/fairshare.py)."""
    from rich.console import Console

    from services.simulation.fairshare import fairshare_1000, run, weighted

    if name == "fairshare-1000":
        chosen = fairshare_1000()
    elif name.startswith("weights-"):
        try:
            chosen = weighted(tuple(float(w) for w in name.removeprefix("weights-").split(":")))
        except ValueError:
            raise typer.BadParameter(f"weights-A:B:C takes numbers, got {name!r}") from None
    else:
        raise typer.BadParameter(f"unknown scenario {name!r}: fairshare-1000 or weights-A:B:C")
    t0 = time.perf_counter()
    result = run(chosen, hours, seed)
    result["events_per_s"] = round(result["events"] / max(1e-9, time.perf_counter() - t0), 1)
    result["command"] = f"gpuorch simulate --scenario {name} --hours {hours:g} --seed {seed}"
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    if as_json:
        print(json.dumps(result, indent=2))
        return
    console = Console()
    console.print(f"[bold]{name}[/bold], {hours:g} simulated hours, {result['gpus']} GPUs, seed {seed}: "
                  f"{result['events']} events at {result['events_per_s']}/s")
    for q, h in result["gpu_hours"].items():
        console.print(f"  {q:<24} {h:>10.1f} GPU-h  {100 * result['share'][q]:5.1f} %")
    console.print(f"  Jain's index (weight-normalised): {result['jain_index_weighted']}; "
                  f"preemptions: {result['preemptions']}; invalid transitions: {result['invalid_transitions']}")


def simulate(
    trace: Annotated[str | None, typer.Option(
        "--trace", help="openb:DIR|POD_CSV, philly:FILE, or jobs:DIR|YAML (our own job files)")] = None,
    from_log: Annotated[str | None, typer.Option(
        "--from-log", help="replay the submissions of a gpuorch event log: a stopped stack's data dir or a NATS URL")] = None,
    policy: Annotated[str | None, typer.Option(
        help=f"placement policy ({', '.join(POLICIES)}); with --from-log: 'what if we had used it' (default fgd)")] = None,
    compare_with: Annotated[str | None, typer.Option("--compare", help="more policies to run on the same input, comma-separated")] = None,
    seed: Annotated[int | None, typer.Option(help="seed of shuffling, resampling and tie-break order (default 42 for openb, else 0 as live)")] = None,
    load: Annotated[float | None, typer.Option(help="openb: arrivals up to this x GPU capacity (1.3); philly: size the cluster for this load (1.0)")] = None,
    nodes: Annotated[str | None, typer.Option(help="philly: number of 8-GPU nodes; jobs: profile:count,...; openb: node CSV")] = None,
    mode: Annotated[str | None, typer.Option(help="openb only: paper (default: the FGD paper's method) or time (creation/deletion times)")] = None,
    fifo: Annotated[bool, typer.Option("--fifo", help="strict first-come-first-served: no job starts before an earlier one")] = False,
    backfill: Annotated[bool, typer.Option(help="reserve for the first blocked job and backfill around it")] = True,
    limit: Annotated[int | None, typer.Option(min=1, help="time-based traces: only the first N jobs")] = None,
    days: Annotated[str | None, typer.Option(help="time-based traces: START:DAYS, the jobs submitted in that window")] = None,
    out: Annotated[Path, typer.Option(help="write OUT.json and OUT.png")] = Path("simulation"),
    as_json: Annotated[bool, typer.Option("--json", help="print the metrics JSON on stdout")] = False,
    progress: Annotated[bool, typer.Option(help="show a progress bar on a terminal")] = True,
    scenario: Annotated[str | None, typer.Option(
        help="a named fair-share scenario instead of a trace: fairshare-1000, or weights-A:B:C (saturating queues)")] = None,
    hours: Annotated[float, typer.Option(help="--scenario: simulated hours")] = 24.0,
    pool: Annotated[str | None, typer.Option(
        help="time-based traces: start empty and autoscale a pool PROFILE:MAX_NODES[:DELAY_S] (e.g. dgx-h100:64:120)")] = None,
    idle_timeout: Annotated[str, typer.Option(help="--pool: idle timeouts to compare, seconds, comma-separated")] = "300,3600",
    faults: Annotated[str | None, typer.Option(
        help="time-based traces: inject GPU faults and lost nodes: a YAML/JSON list, or RATE[:REPAIR_H] "
             "(per 1,000 GPU-days; Llama 3's training saw 0.47)")] = None,
    max_retries: Annotated[int | None, typer.Option(
        min=0, max=100, help="time-based traces: retries of every job after a lost node (default: each job's own)")] = None,
    health: Annotated[bool, typer.Option(help="time-based traces: run the health rules (time limits, faults)")] = True,
    checkpoint_min: Annotated[float | None, typer.Option(
        min=0.1, help="time-based traces: jobs checkpoint every M minutes; a restart runs only the rest")] = None,
) -> None:
    """Replay a trace or recorded history through the scheduler's core in virtual time, and compare policies."""
    err = _stderr()
    if scenario is not None:
        _run_scenario(scenario, hours, 1 if seed is None else seed, out, as_json)
        return
    if pool is not None:
        _run_autoscaled(trace or "", pool, idle_timeout, policy or "fgd+", limit, days, out, as_json, faults, max_retries,
                        0 if seed is None else seed, health, checkpoint_min and checkpoint_min * 60)
        return
    try:
        if (trace is None) == (from_log is None):
            raise TraceError("give exactly one of --trace, --from-log or --scenario")
        if from_log is not None and (faults or max_retries is not None or checkpoint_min):
            raise TraceError("--faults, --max-retries and --checkpoint-min are for --trace: a recorded log replays "
                             "its own node events and durations")
        policies = parse_policies(policy, compare_with) if from_log else parse_policies(policy or "fgd+", compare_with)
        t0 = time.perf_counter()
        if from_log is not None:
            used_seed = 0 if seed is None else seed
            history = asyncio.run(read_history(from_log))
            doc, results = log_report(history, policies, used_seed, progress, from_log)
            png = report.plot_timelines(results, out.with_suffix(".png"), f"what if: {from_log}")
        else:
            kind, path = parse_trace(trace or "")
            doc, png, used_seed = _run_trace(kind, path, policies, seed, load, nodes, mode, fifo, backfill, limit, days, progress,
                                             out, health, faults, max_retries, checkpoint_min and checkpoint_min * 60)
    except (TraceError, ValueError) as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    doc["seed"] = used_seed
    doc["command"] = _command(trace, from_log, policy, compare_with, used_seed, load, nodes, mode, fifo, backfill, limit, days,
                              out, faults, max_retries, health, checkpoint_min)
    doc["wall_s"] = round(time.perf_counter() - t0, 3)
    doc["plot"] = str(png)
    out.with_suffix(".json").parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    if as_json:
        print(json.dumps(doc, indent=1))
    else:
        _summary(doc, out)


def _run_trace(kind: str, path: Path, policies: list[str], seed: int | None, load: float | None, nodes: str | None,
               mode: str | None, fifo: bool, backfill: bool, limit: int | None, days: str | None, progress: bool,
               out: Path, health: bool = True, faults: str | None = None,
               max_retries: int | None = None, checkpoint_s: float | None = None) -> tuple[dict[str, Any], Path, int]:
    if kind == "openb" and (mode or "paper") == "paper":
        if faults or max_retries is not None or checkpoint_s:
            raise TraceError("--faults, --max-retries and --checkpoint-min are for time-based replays "
                             "(the paper's method has no time)")
        node_csv, pod_csv = openb_paths(path)
        node_csv = Path(nodes) if nodes else node_csv
        used = PAPER_SEED if seed is None else seed
        doc, runs = paper_report(node_csv, pod_csv, policies, used, load or 1.3, progress)
        return doc, report.plot_paper(runs, out.with_suffix(".png"), f"openb {workload_name(pod_csv)}, seed {used}"), used
    if mode not in (None, "time"):
        raise TraceError("--mode is paper or time (and paper is for openb traces only)")
    used = 0 if seed is None else seed
    if kind == "openb":
        node_csv, pod_csv = openb_paths(path)
        cluster = openb_cluster(load_openb_nodes(Path(nodes) if nodes else node_csv))
        jobs = openb_jobs(load_openb_pods(pod_csv))
    elif kind == "philly":
        jobs = load_philly(path)
    else:
        jobs = load_job_files(path)
        cluster = profile_cluster(nodes or Settings().nodes)
    jobs.sort(key=lambda j: (j.submit, j.job_id))
    if days:
        start, _, span = days.partition(":")
        jobs = window(jobs, float(start), float(span or 1))
    jobs = with_retries(jobs[:limit] if limit else jobs, max_retries)
    if kind == "philly":
        cluster = uniform_cluster(int(nodes) if nodes else philly_nodes_for_load(jobs, load or 1.0))
    injected = parse_faults(faults, used) if faults else []
    if injected and not health:
        raise TraceError("--faults takes the health rules: drop --no-health")
    doc, results = time_report(cluster, jobs, policies, used, fifo=fifo, backfill=backfill, progress=progress,
                               trace=f"{kind}:{path}", health=health, faults=injected, checkpoint_s=checkpoint_s)
    return doc, report.plot_timelines(results, out.with_suffix(".png"), f"{kind}: {path.name}, seed {used}"), used


def _command(trace, from_log, policy, compare_with, seed, load, nodes, mode, fifo, backfill, limit, days, out,
             faults=None, max_retries=None, health=True, checkpoint_min=None) -> str:
    """The command line that reproduces this run exactly (every default that matters made explicit)."""
    args = ["gpuorch", "simulate"]
    for flag, value in (("--trace", trace), ("--from-log", from_log), ("--policy", policy), ("--compare", compare_with),
                        ("--seed", seed), ("--load", load), ("--nodes", nodes), ("--mode", mode), ("--limit", limit),
                        ("--days", days), ("--faults", faults), ("--max-retries", max_retries),
                        ("--checkpoint-min", checkpoint_min), ("--out", out)):
        if value is not None:
            args += [flag, str(value)]
    args += ["--fifo"] if fifo else []
    args += [] if backfill else ["--no-backfill"]
    args += [] if health else ["--no-health"]
    return " ".join(shlex.quote(a) for a in args)


def _stderr():
    from rich.console import Console

    return Console(stderr=True)


def _summary(doc: dict[str, Any], out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    table = Table(title=f"simulation (seed {doc['seed']})")
    runs = doc["runs"]
    if doc["input"].get("method") == "fgd-paper":
        for col in ("policy", "alloc % @100", "@110", "@120", "@130", "failed pods", "events/s"):
            table.add_column(col, justify="right")
        for name, r in runs.items():
            a = r["allocation_pct"]
            table.add_row(name, *(f"{a[x]:.2f}" if x in a else "-" for x in ("100", "110", "120", "130")),
                          str(r["pods_failed"]), str(r["events_per_s"]))
    else:
        cols = (("avg_queue_delay_s", "avg wait s"), ("p99_queue_delay_s", "p99 wait s"), ("avg_jct_s", "avg JCT s"),
                ("utilization_pct", "util %"), ("makespan_s", "makespan s"), ("events_per_s", "events/s"))
        table.add_column("run")
        for _, label in cols:
            table.add_column(label, justify="right")
        table.add_column("same placement as recorded", justify="right")
        for name, r in runs.items():
            m, vs = r["metrics"], r.get("versus_recorded")
            same = f"{vs['same_placement']}/{vs['recorded_placements']}" if vs else "-"
            table.add_row(name, *("-" if m[k] is None else f"{m[k]:,.1f}" for k, _ in cols), same)
    console.print(table)
    for name, r in runs.items():
        if "metrics" in r and "health" in r["metrics"]:
            console.print(f"{name} health: {health_line(r['metrics'])}", highlight=False, soft_wrap=True)
    console.print(f"wrote {out.with_suffix('.json')} and {doc['plot']}", highlight=False)
    console.print(f"reproduce with: {doc['command']}", highlight=False, soft_wrap=True)
