"""Ingest benchmark: how fast POST /v1/jobs accepts jobs, in batches and one at a time.

    python -m bench.ingest [--runs 3] [--json]

Starts `gpuorch up` (bench.chaos.Stack: embedded nats-server, every service in one process, two simulated
t4-4x nodes) on free ports, as its admin (admins are not rate limited), and fills the 8 GPUs with `sleep 3600`
jobs, so that every measured job is accepted and then waits queued: no task runs, the scheduler's cycles still
see every job. Each run measures, in the same stack:

- ``batch``:  jobs/s accepted in batches of 100 (a JSON list), 4 clients posting 5 batches each;
- ``single``: jobs/s accepted one per request, 64 concurrent clients (``bench.loadgen``), 8 jobs each; then the
  same with an Idempotency-Key on each request (``single_keyed``: the keyed path's cost);
- ``open``:   POST latency p50/p99 at 200 jobs/s offered for 4 s (open loop: a request starts on time whether
  or not the earlier ones have answered).

It prints the median of the runs beside the targets (issue 15) and the "before" figures. The load generator
shares the machine with the stack: on a small machine both compete for its cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from bench.chaos import Stack
from bench.loadgen import Client

NODES = "t4-4x:2"
JOB = {"name": "ingest", "resources": {"gpus": 1}, "command": ["true"]}
BLOCKER = {"name": "blocker", "resources": {"gpus": 1}, "command": ["sleep", "3600"]}
TARGETS = {"batch_jobs_per_s": 2000, "single_jobs_per_s": 500, "open_p99_ms": 100}
BEFORE = {"single_jobs_per_s": 112, "open_p50_ms": 531, "open_p99_ms": 983, "cores": 16}


def client(stack: Stack) -> httpx.AsyncClient:
    token = (stack.data_dir / "auth" / "admin.token").read_text().strip()
    return httpx.AsyncClient(base_url=stack.url, headers={"authorization": f"Bearer {token}"}, timeout=60,
                             limits=httpx.Limits(max_connections=512, max_keepalive_connections=512))


# answers other than 201, by status (503: the fold did not catch up within 2 s) or by the client error's name
FAILED: dict[int | str, int] = {}


def count(answer: int | str, text: str = "") -> None:
    """An answer other than 201 (a status, or the name of the client's error) into FAILED; one that is neither
    503 nor a dropped connection ends the bench."""
    FAILED[answer] = FAILED.get(answer, 0) + 1
    if isinstance(answer, int) and answer != 503:
        raise RuntimeError(f"POST /v1/jobs answered {answer}: {text[:300]}")


async def post(c: httpx.AsyncClient, body: object) -> None:
    try:
        r = await c.post("/v1/jobs", json=body)
    except httpx.HTTPError as e:  # a connection the server dropped under load
        return count(type(e).__name__)
    if r.status_code != 201:
        count(r.status_code, r.text)


def lean(stack: Stack) -> Client:
    """The measured load's client (bench.loadgen: httpx cost more CPU per request than the server did)."""
    token = (stack.data_dir / "auth" / "admin.token").read_text().strip()
    return Client(stack.url, {"authorization": f"Bearer {token}"})


async def fire(c: Client, raw: bytes) -> None:
    """One prepared POST /v1/jobs, as ``post``."""
    try:
        r = await c.send(raw)
    except OSError as e:
        return count(type(e).__name__)
    if r.status != 201:
        count(r.status, r.body.decode(errors="replace"))


async def batches(c: Client, clients: int = 4, each: int = 5, size: int = 100) -> float:
    """Jobs per second, ``clients`` posting ``each`` batches of ``size`` one after another."""
    raw = c.prepare("POST", "/v1/jobs", [JOB] * size)

    async def one_client() -> None:
        for _ in range(each):
            await fire(c, raw)
    t0 = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(clients)))
    return clients * each * size / (time.perf_counter() - t0)


async def singles(c: Client, clients: int = 64, each: int = 8, keyed: bool = False) -> float:
    """Jobs per second, ``clients`` each posting ``each`` single jobs one after another (``keyed``: each with an
    Idempotency-Key of its own, as the --split gateway and `gpuorch submit` send them)."""
    raw = c.prepare("POST", "/v1/jobs", JOB)
    run = os.urandom(4).hex()

    async def one_client() -> None:
        for i in range(each):
            await fire(c, c.prepare("POST", "/v1/jobs", JOB, {"idempotency-key": f"{run}-{id(asyncio.current_task())}-{i}"})
                       if keyed else raw)
    t0 = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(clients)))
    return clients * each / (time.perf_counter() - t0)


async def open_loop(c: Client, rate: float = 200, seconds: float = 4) -> tuple[float, float]:
    """POST latency (p50, p99 in ms) with one request started every 1/``rate`` s, answered or not."""
    latencies: list[float] = []
    raw = c.prepare("POST", "/v1/jobs", JOB)

    async def timed() -> None:
        t = time.perf_counter()
        await fire(c, raw)
        latencies.append(time.perf_counter() - t)
    t0, tasks = time.perf_counter(), []
    for i in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
        tasks.append(asyncio.create_task(timed()))
    await asyncio.gather(*tasks)
    cuts = statistics.quantiles(latencies, n=100)
    return cuts[49] * 1000, cuts[98] * 1000


async def settled(c: httpx.AsyncClient, timeout: float = 30) -> None:
    """Until every service has folded what any had folded half a second before: no backlog carried into the next
    measure (heartbeats keep the log moving, so "no change" never comes)."""
    seen, deadline = 0, time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = await c.get("/v1/services")
        seqs = [s["seq"] for s in r.json()] if r.status_code == 200 else []  # a busy stack may answer 503 a while
        if seqs and min(seqs) >= seen > 0:
            return
        seen = max(seqs, default=0)
        await asyncio.sleep(0.5)


@contextlib.asynccontextmanager
async def filled_stack(root: Path) -> AsyncIterator[tuple[Stack, httpx.AsyncClient]]:
    """`gpuorch up` on NODES with its 8 GPUs held by BLOCKER jobs (every job posted next waits queued) and warmed
    up (the first requests pay for imports and caches); its admin client. Stopped on the way out."""
    stack = Stack(root / "data", NODES, split=False)
    stack.start()
    try:
        await stack.until_ready()
        async with client(stack) as c:
            while len((await c.get("/v1/nodes")).json()) < 2:
                await asyncio.sleep(0.2)
            await post(c, [BLOCKER] * 8)
            await post(c, [JOB] * 100)
            yield stack, c
    finally:
        stack.stop()


async def measure(runs: int, root: Path) -> dict:
    async with filled_stack(root) as (stack, c):
        results, load = [], lean(stack)
        for _ in range(runs):
            run: dict[str, float] = {}
            await settled(c)
            run["batch_jobs_per_s"] = await batches(load)
            await settled(c)
            run["single_jobs_per_s"] = await singles(load)
            await settled(c)
            run["single_keyed_jobs_per_s"] = await singles(load, keyed=True)
            await settled(c)
            run["open_p50_ms"], run["open_p99_ms"] = await open_loop(load)
            results.append(run)
        load.close()
    median = {k: statistics.median(r[k] for r in results) for k in results[0]}
    return {"cores": os.cpu_count(), "runs": results, "median": median, "failed": FAILED,
            "targets": TARGETS, "before": BEFORE}


def show(r: dict) -> None:
    m = r["median"]
    print(f"ingest on {r['cores']} cores, median of {len(r['runs'])} runs (answers other than 201: "
          f"{r['failed'] or 'none'})")
    print(f"  batches of 100, 4 clients : {m['batch_jobs_per_s']:7.0f} jobs/s   target >= "
          f"{TARGETS['batch_jobs_per_s']}")
    print(f"  single, 64 clients        : {m['single_jobs_per_s']:7.0f} jobs/s   target >= "
          f"{TARGETS['single_jobs_per_s']}   before {BEFORE['single_jobs_per_s']} (16 cores)")
    print(f"  single, with a key each   : {m['single_keyed_jobs_per_s']:7.0f} jobs/s   (Idempotency-Key: what the "
          "--split gateway and `gpuorch submit` send)")
    print(f"  200 jobs/s offered        : p50 {m['open_p50_ms']:.0f} ms, p99 {m['open_p99_ms']:.0f} ms   target p99 <= "
          f"{TARGETS['open_p99_ms']}   before {BEFORE['open_p50_ms']}/{BEFORE['open_p99_ms']} ms (16 cores)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuorch-ingest-") as root:
        result = asyncio.run(measure(args.runs, Path(os.environ.get("INGEST_DIR") or root)))
    print(json.dumps(result, indent=2)) if args.json else show(result)


if __name__ == "__main__":
    main()
