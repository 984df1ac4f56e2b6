"""A large backlog (issue 15): GET /v1/jobs latency during and after a flood, and restart time on that data dir.

    python -m bench.backlog                 # 20,000 jobs (about 5 minutes on 2 cores: the flood takes most)
    python -m bench.backlog --jobs 5000 --json backlog.json
    python -m bench.backlog --views         # only: ms to build a page of 100 job views (no stack)

`gpuorch up` (one t4-4x node: four GPUs) on a fresh data dir; 20,000 one-GPU `sleep 3600` jobs are submitted
by concurrent clients (arrays of ``--batch`` elements), so four run and the rest wait. Meanwhile and afterwards,
one client times GET /v1/jobs: the first page (100 jobs), a filtered page (``state=running``: four matches, so
every job is walked) and a deep page (100 jobs from a cursor 10,000 jobs down). Then the stack is stopped with
SIGINT and started again, then SIGKILLed and started again: time from the start of `up` to /readyz answering 200
and to every service ready (median of ``--restarts``). Figures: docs/benchmarks/backlog.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from bench.chaos import Stack

TARGETS = {"list_p99_s": 0.2, "restart_s": 5.0}
BEFORE = {"list_p99_during_s": 3.07, "list_p99_after_s": 1.33, "restart_clean_s": 14.0, "restart_sigkill_s": 51.0}
JOB = {"name": "wait", "resources": {"gpus": 1}, "command": ["sleep", "3600"]}
KINDS = ("first", "filtered", "deep")


def quantiles(xs: list[float], at: list[float] | None = None) -> dict[str, float | int]:
    """p50, p99 and max of these seconds; ``at``: when each was taken (seconds since the measure began), to tell
    when the slowest was (``max_at_s``)."""
    order = sorted(range(len(xs)), key=xs.__getitem__)
    pick = (lambda q: xs[order[min(len(xs) - 1, int(q * len(xs)))]]) if xs else (lambda q: float("nan"))
    out = {"n": len(xs), "p50_ms": round(pick(0.5) * 1000, 1), "p99_ms": round(pick(0.99) * 1000, 1),
           "max_ms": round(xs[order[-1]] * 1000, 1) if xs else float("nan")}
    if at and xs:
        out["max_at_s"] = round(at[order[-1]], 1)
    return out


async def flood(stack: Stack, jobs: int, batch: int, clients: int, done: asyncio.Event) -> tuple[float, int]:
    """Submit ``jobs`` jobs as arrays of ``batch``, ``clients`` at a time: the seconds it took, and how many
    answers were 503 (recorded, but not yet folded by the scheduler within 2 s)."""
    t0, left, slow = time.monotonic(), [jobs], [0]

    async def client() -> None:
        while left[0] > 0:
            n = min(batch, left[0])
            left[0] -= n
            body = {**JOB, "array": {"indices": list(range(n))}} if n > 1 else JOB
            r = await stack.api.post("/v1/jobs", json=body, timeout=60)
            slow[0] += r.status_code == 503  # recorded, but the scheduler's fold was over 2 s behind: it says so
            assert r.status_code == 201 or (r.status_code == 503 and "is recorded" in r.text), r.text

    await asyncio.gather(*(client() for _ in range(clients)))
    done.set()
    return time.monotonic() - t0, slow[0]


async def deep_cursor(stack: Stack, depth: int) -> str | None:
    """The cursor ``depth`` jobs down, by following the pages as a client would."""
    cursor, seen = None, 0
    while seen < depth:
        params = {"limit": min(1000, depth - seen), **({"cursor": cursor} if cursor else {})}
        r = await stack.api.get("/v1/jobs", params=params, timeout=60)
        seen += len(r.json())
        cursor = r.headers.get("x-next-cursor")
        if cursor is None:
            return None
    return cursor


async def sample(stack: Stack, kind: str, cursor: str | None) -> float | None:
    params = {"first": {}, "filtered": {"state": "running"}, "deep": {"cursor": cursor}}[kind]
    if kind == "deep" and cursor is None:
        return None
    t0 = time.monotonic()
    r = await stack.api.get("/v1/jobs", params={"limit": 100, **params}, timeout=60)
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


async def measure(stack: Stack, until: asyncio.Event | None, rounds: int, depth: int) -> dict[str, dict]:
    """Time the three kinds in turn: while ``until`` is not set (during a flood), else ``rounds`` times each."""
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    at: dict[str, list[float]] = {k: [] for k in KINDS}
    cursor, i, t0 = None, 0, time.monotonic()
    while (until is not None and not until.is_set()) or (until is None and i < rounds):
        if cursor is None:
            cursor = await deep_cursor(stack, depth)  # None until the backlog is that deep
        for kind in KINDS:
            began = time.monotonic() - t0
            if (t := await sample(stack, kind, cursor)) is not None:
                times[kind].append(t)
                at[kind].append(began)
        i += 1
        await asyncio.sleep(0.02 if until is not None else 0)
    return {k: quantiles(v, at[k]) for k, v in times.items()}


async def own_lag(until: asyncio.Event, lags: list[tuple[float, float]], every_s: float = 0.01) -> None:
    """This process's own event loop, late by how much after each 10 ms sleep until ``until`` (when, seconds late):
    a page's time is measured here, beside the flood's clients, so a stall of this loop shows in it too."""
    t0 = time.monotonic()
    while not until.is_set():
        began = time.monotonic()
        await asyncio.sleep(every_s)
        lags.append((began - t0, time.monotonic() - began - every_s))


def lag_summary(lags: list[tuple[float, float]]) -> dict[str, float]:
    worst = max(lags, key=lambda x: x[1], default=(float("nan"), float("nan")))
    return {"max_ms": round(worst[1] * 1000, 1), "max_at_s": round(worst[0], 1),
            "over_100_ms": sum(1 for _, lag in lags if lag > 0.1)}


async def restart(stack: Stack, how: str) -> dict[str, float]:
    """Stop the stack (SIGINT: Ctrl-C, or SIGKILL of `up` and its group), start it again: seconds to ready."""
    assert stack.proc is not None
    if how == "sigint":
        stack.stop()
    else:
        os.killpg(stack.proc.pid, signal.SIGKILL)
        stack.proc.wait()
    stack._client = None
    t0 = time.monotonic()
    stack.start()
    readyz = None
    while True:
        try:
            if readyz is None and (await stack.api.get("/readyz")).status_code == 200:
                readyz = time.monotonic() - t0
        except Exception:  # noqa: BLE001 - not listening yet, or no token written yet
            pass
        if readyz is not None and await stack.ready():
            return {"readyz_s": round(readyz, 2), "all_ready_s": round(time.monotonic() - t0, 2)}
        if time.monotonic() - t0 > 180:
            raise TimeoutError(f"not ready after 180 s: see {stack.data_dir / 'up.out'}")
        await asyncio.sleep(0.05)


OTHERS = ("/v1/queues", "/v1/usage", "/v1/nodes", "/v1/services", "/metrics")


async def others(stack: Stack, rounds: int = 10) -> dict[str, dict[str, float]]:
    """The other reads a dashboard or an operator polls, with the backlog (each walks every job, or did): p50 and
    the slowest of ``rounds`` calls, one after another."""
    out = {}
    for path in OTHERS:
        times = []
        for _ in range(rounds):
            t0 = time.monotonic()
            r = await stack.api.get(path, timeout=60)
            assert r.status_code == 200, r.text
            times.append(time.monotonic() - t0)
        out[path] = {"p50_ms": round(statistics.median(times) * 1000, 1), "max_ms": round(max(times) * 1000, 1)}
    return out


async def run(jobs: int, batch: int, clients: int, rounds: int, restarts: int, data_dir: Path) -> dict:
    stack = Stack(data_dir, "t4-4x:1", split=False)
    stack.start()
    try:
        await stack.until_ready()
        done = asyncio.Event()
        depth = min(10_000, jobs // 2)
        lags: list[tuple[float, float]] = []
        (flood_s, slow), during, _ = await asyncio.gather(flood(stack, jobs, batch, clients, done),
                                                          measure(stack, done, 0, depth), own_lag(done, lags))
        after = await measure(stack, None, rounds, depth)
        other_reads = await others(stack)
        restarts_out = {how: [await restart(stack, how) for _ in range(restarts)] for how in ("sigint", "sigkill")}
        count = len((await stack.api.get("/v1/jobs", params={"limit": 1000})).json())
        return {"cores": len(os.sched_getaffinity(0)), "jobs": jobs, "flood_s": round(flood_s, 1), "flood_503": slow,
                "first_page_after_restart": count, "during": during, "after": after, "others_after": other_reads,
                "bench_loop_lag_during": lag_summary(lags), "restart": {
                    how: {"readyz_s": statistics.median(r["readyz_s"] for r in rs),
                          "all_ready_s": statistics.median(r["all_ready_s"] for r in rs), "runs": rs}
                    for how, rs in restarts_out.items() if rs},
                "targets": TARGETS, "before": BEFORE}
    finally:
        stack.stop()


def show(out: dict) -> None:
    print(f"{out['jobs']} jobs on {out['cores']} cores; flood took {out['flood_s']} s "
          f"({out['flood_503']} answers 503: recorded, the scheduler over 2 s behind)")
    for when in ("during", "after"):
        for kind, q in out[when].items():
            slowest = f", slowest {q['max_ms']} ms at {q['max_at_s']} s" if "max_at_s" in q else ""
            print(f"  GET /v1/jobs {kind:<8} {when:<6}: p50 {q['p50_ms']} ms, p99 {q['p99_ms']} ms (n={q['n']}{slowest})")
    if lag := out.get("bench_loop_lag_during"):
        print(f"  this bench's own event loop during the flood: late by at most {lag['max_ms']} ms (at {lag['max_at_s']} s), "
              f"{lag['over_100_ms']} times over 100 ms")
    for how, r in out["restart"].items():
        print(f"  restart after {how:<7}: /readyz {r['readyz_s']} s, every service ready {r['all_ready_s']} s")
    for path, q in out.get("others_after", {}).items():
        print(f"  GET {path:<21} after : p50 {q['p50_ms']} ms, slowest {q['max_ms']} ms (10 calls)")
    print(f"  targets: p99 <= {TARGETS['list_p99_s'] * 1000:.0f} ms, restart <= {TARGETS['restart_s']} s; before: "
          f"p99 {BEFORE['list_p99_during_s']} s during / {BEFORE['list_p99_after_s']} s after, restart "
          f"{BEFORE['restart_clean_s']} s clean / {BEFORE['restart_sigkill_s']} s after SIGKILL")


def view_page_ms(pages: int = 30) -> float:
    """Median ms to build the views of a page of 100 jobs (``job_view``, what ``GET /v1/jobs`` returns), each job
    viewed before: a page polled again, as the bench's clients and a dashboard do."""
    from services.scheduler.api import job_view
    from shared.cluster import JobRecord
    from shared.model import JobSpec

    spec = JobSpec.model_validate({"name": "bench", "command": ["python", "train.py", "--epochs", "3"],
                                   "env": {"A": "1", "B": "2"}, "resources": {"gpus": 1}})
    records = [JobRecord(f"j-{i}", spec, state="queued") for i in range(100)]
    times = []
    for _ in range(pages):
        t = time.perf_counter()
        for r in records:
            job_view(r)
        times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=20, help="jobs per POST (an array; 1: single jobs)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent submitters")
    ap.add_argument("--rounds", type=int, default=100, help="samples of each page kind after the flood")
    ap.add_argument("--restarts", type=int, default=1, help="restarts of each kind (their median; 3 for the doc)")
    ap.add_argument("--json", nargs="?", const="-", help="print (or write to this file) the figures as JSON")
    ap.add_argument("--views", action="store_true", help="only: ms to build a page of 100 job views, no stack")
    args = ap.parse_args()
    if args.views:
        print(f"a page of 100 job views: {view_page_ms():.2f} ms (median of 30 pages)")
        return
    with tempfile.TemporaryDirectory(prefix="backlog-") as tmp:
        out = asyncio.run(run(args.jobs, args.batch, args.clients, args.rounds, args.restarts, Path(tmp)))
    if args.json == "-":
        print(json.dumps(out, indent=2))
    else:
        show(out)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
