"""Event-log benchmark: append (one at a time, batched), replay+fold, restart (snapshot+tail vs full replay).

    python -m bench.eventlog            # 100k and 1M events, 3 runs each (about 10 minutes)
    python -m bench.eventlog --quick    # 20k and 100k events

Anchors (NATS project, `nats bench`, Go, laptop): 35.7k msg/s synchronous publish,
404k msg/s asynchronous publish. Targets from Python on this 2-core machine:
>= 15k events/s batched append, >= 30k events/s replay, restart from snapshot < 2 s at 1M events.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.workload import workload
from services.scheduler.projection import SchedulerProjection
from shared.eventlog import EventLog, Undecodable
from shared.natsd import NatsServer
from shared.runtime import Service
from shared.telemetry import setup_tracing

ANCHORS = {"nats_bench_sync_pub": 35_700, "nats_bench_async_pub": 404_000}
TARGETS = {"append_batched": 15_000, "replay": 30_000, "restart_snapshot_1m_s": 2.0}


async def fresh_log(store: Path, sync_always: bool = False) -> tuple[NatsServer, EventLog]:
    server = NatsServer(store, sync_always=sync_always).start()
    return server, await EventLog.connect(server.url)


async def append_one_at_a_time(store: Path, n: int, sync_always: bool) -> float:
    server, log = await fresh_log(store, sync_always)
    try:
        envs = list(workload(n))
        t = time.perf_counter()
        for env in envs:
            await log.append(env)
        return len(envs) / (time.perf_counter() - t)
    finally:
        await log.close()
        server.stop()


async def append_batched(store: Path, n: int, sync_always: bool, chunk: int = 5000) -> float:
    server, log = await fresh_log(store, sync_always)
    try:
        envs = list(workload(n))
        t = time.perf_counter()
        for i in range(0, len(envs), chunk):
            await log.append_many(envs[i : i + chunk])
        return len(envs) / (time.perf_counter() - t)
    finally:
        await log.close()
        server.stop()


async def fill(log: EventLog, n: int) -> int:
    envs = workload(n)
    chunk: list = []
    for env in envs:
        chunk.append(env)
        if len(chunk) == 10_000:
            await log.append_many(chunk)
            chunk = []
    if chunk:
        await log.append_many(chunk)
    return await log.last_seq()


async def replay_fold(log: EventLog) -> tuple[float, int]:
    proj = SchedulerProjection()
    t = time.perf_counter()
    async for rec in log.replay(1):
        proj.skip(rec.seq) if isinstance(rec, Undecodable) else proj.apply(rec)
    return proj.applied / (time.perf_counter() - t), proj.applied


async def restart_seconds(log: EventLog) -> float:
    """Time from a service's start to ready (restore snapshot if any, replay the tail)."""
    svc = Service("scheduler", SchedulerProjection(), snapshot_every=10**12)
    t = time.perf_counter()
    task = asyncio.create_task(svc.run(log))
    await svc.ready.wait()
    elapsed = time.perf_counter() - t
    svc.stop()
    await task
    return elapsed


async def drop_snapshots(log: EventLog) -> None:
    try:
        await log.js.delete_object_store("gpuorch-snapshots")
    except Exception:  # noqa: BLE001 - none yet
        pass


async def restart_pair(store: Path, n: int, runs: int) -> dict:
    server, log = await fresh_log(store)
    try:
        last = await fill(log, n)
        full = []
        for _ in range(runs):
            await drop_snapshots(log)  # each run saves one on stop: drop it, or the next is not a full replay
            full.append(await restart_seconds(log))
        await drop_snapshots(log)
        # snapshot covering all but the last 1,000 events, then a restart replays that tail
        proj = SchedulerProjection()
        async for rec in log.replay(1):
            if rec.seq > last - 1000:
                break
            proj.apply(rec)
        await log.save_snapshot("scheduler", proj.seq, proj.snapshot())
        snap_size = len(proj.snapshot())
        tail = []
        for _ in range(runs):
            await log.save_snapshot("scheduler", proj.seq, proj.snapshot())
            tail.append(await restart_seconds(log))
        return {"events": last, "full_replay_s": statistics.median(full), "snapshot_plus_tail_s": statistics.median(tail),
                "snapshot_bytes": snap_size, "runs": runs}
    finally:
        await log.close()
        server.stop()


async def main(quick: bool, runs: int) -> dict:
    sizes = (20_000, 100_000) if quick else (100_000, 1_000_000)
    out: dict = {"anchors": ANCHORS, "targets": TARGETS, "runs": runs}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        k = 0

        def store() -> Path:
            nonlocal k
            k += 1
            return base / f"s{k}"

        for sync in (False, True):
            label = "sync_always" if sync else "default_fsync"
            one = [await append_one_at_a_time(store(), 3000, sync) for _ in range(runs)]
            many = [await append_batched(store(), sizes[0] if quick else 100_000, sync) for _ in range(runs)]
            out[f"append_one_per_s[{label}]"] = round(statistics.median(one))
            out[f"append_batched_per_s[{label}]"] = round(statistics.median(many))
            print(f"append {label}: one-at-a-time {statistics.median(one):,.0f}/s  batched {statistics.median(many):,.0f}/s", flush=True)

        server, log = await fresh_log(store())
        try:
            await fill(log, sizes[0] if quick else 100_000)
            rates = [(await replay_fold(log))[0] for _ in range(runs)]
        finally:
            await log.close()
            server.stop()
        out["replay_fold_per_s"] = round(statistics.median(rates))
        print(f"replay+fold: {statistics.median(rates):,.0f} events/s", flush=True)

        for n in sizes:
            r = await restart_pair(store(), n, runs)
            out[f"restart[{n}]"] = r
            print(f"restart at {r['events']:,} events: full replay {r['full_replay_s']:.2f}s, "
                  f"snapshot+tail {r['snapshot_plus_tail_s']:.2f}s (snapshot {r['snapshot_bytes'] / 1e6:.1f} MB)", flush=True)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (20k / 100k)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON at the end")
    args = ap.parse_args()
    setup_tracing("gpuorch-bench")  # off unless OTEL_TRACES_EXPORTER says otherwise: measure the overhead both ways
    result = asyncio.run(main(args.quick, args.runs))
    batched = result["append_batched_per_s[default_fsync]"]
    print(f"\nbatched append {batched:,}/s vs target {TARGETS['append_batched']:,} "
          f"({batched / TARGETS['append_batched']:.2f}x); nats bench async anchor {ANCHORS['nats_bench_async_pub']:,}/s "
          f"({batched / ANCHORS['nats_bench_async_pub']:.3f}x)")
    print(f"one-at-a-time append {result['append_one_per_s[default_fsync]']:,}/s vs nats bench sync anchor "
          f"{ANCHORS['nats_bench_sync_pub']:,}/s ({result['append_one_per_s[default_fsync]'] / ANCHORS['nats_bench_sync_pub']:.2f}x)")
    print(f"replay {result['replay_fold_per_s']:,}/s vs target {TARGETS['replay']:,} ({result['replay_fold_per_s'] / TARGETS['replay']:.2f}x)")
    if args.json:
        print(json.dumps(result, indent=2))
