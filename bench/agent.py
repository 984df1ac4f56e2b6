"""Node-agent benchmark: tasks started per second on one agent, and the CPU cost of an idle agent.

    python -m bench.agent [--tasks 200] [--idle-seconds 20]

The agent runs as its own process (`gpuorch agent --backend simulated`, a DGX H100
profile), heartbeating and sampling telemetry every second. Tasks are placed by
appending job events directly (no scheduler in the loop); each runs `true` under
the launcher. Target: heartbeats + telemetry at a 1 s interval cost <= 2% of one core.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import e2e
from bench.fsops import describe_fs
from services.stack import build_service
from shared import events as ev
from shared.eventlog import EventLog
from shared.events import Envelope, GpuShare, TaskPlacement
from shared.model import JobSpec, TaskResources
from shared.natsd import NatsServer, free_port
from shared.profiles import build
from shared.settings import Settings

CPU_TARGET_PCT = 2.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def forker_cpu(agent_pid: int) -> float:
    """CPU seconds of the agent's task keeper, its account keepers, and the tasks (alive, or reaped by them)."""
    return sum(sum(e2e.cpu_seconds(p)) for p in e2e.descendants(agent_pid))


async def count(log: EventLog, type_: str) -> int:
    return len([r async for r in log.replay(1, ["gpuorch.events.job.>"]) if getattr(r, "type", "").endswith(f"{type_}.v1")])


async def run(tasks: int, idle_s: float, work: Path, profile: Path | None = None) -> dict:
    server = NatsServer(work / "nats").start()
    log = await EventLog.connect(server.url)
    inventory = build_service("inventory", Settings(data_dir=work / "data"))  # appends the agent's reports
    relaying = asyncio.create_task(inventory.run(log))
    node = build("dgx-h100", "bench-0")
    agent = subprocess.Popen(
        [sys.executable, *(["-m", "cProfile", "-o", str(profile)] if profile else []), "-m", "services.cli", "agent", "--backend", "simulated", "--profile", "dgx-h100", "--node-id",
         node.node_id, "--nats", server.url, "--port", str(free_port()), "--work-dir", str(work / "agent"),
         "--kill-tasks-on-exit"],
        stdout=open(work / "agent.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while await log.last_seq() == 0:  # node.registered
            await asyncio.sleep(0.1)
        await asyncio.sleep(2)
        c0, t0 = cpu_seconds(agent.pid), time.perf_counter()
        await asyncio.sleep(idle_s)
        idle_pct = 100 * (cpu_seconds(agent.pid) - c0) / (time.perf_counter() - t0)

        spec = JobSpec(name="t", resources=TaskResources(gpus=0.001), command=("true",))
        envs = []
        for i in range(tasks):
            gpu = node.gpus[i % len(node.gpus)]
            placement = TaskPlacement(task=0, node_id=node.node_id, gpus=(GpuShare(uuid=gpu.uuid, milli=1),))
            envs += [Envelope(ev.JobSubmitted(job_id=f"b{i}", spec=spec)), Envelope(ev.JobQueued(job_id=f"b{i}")),
                     Envelope(ev.JobPlaced(job_id=f"b{i}", placements=(placement,)))]
        t0, a0, f0 = time.perf_counter(), cpu_seconds(agent.pid), forker_cpu(agent.pid)
        await log.append_many(envs)
        started = 0
        while started < tasks:
            await asyncio.sleep(0.2)
            started = await count(log, "task_started")
        start_rate = tasks / (time.perf_counter() - t0)
        while await count(log, "task_exited") < tasks:
            await asyncio.sleep(0.2)
        total_rate = tasks / (time.perf_counter() - t0)
        agent_ms = 1000 * (cpu_seconds(agent.pid) - a0) / tasks
        launch_ms = 1000 * (forker_cpu(agent.pid) - f0) / tasks
        return {"tasks": tasks, "started_per_s": start_rate, "started_and_exited_per_s": total_rate, "idle_cpu_pct": idle_pct,
                "agent_cpu_ms_per_task": agent_ms, "launch_cpu_ms_per_task": launch_ms}
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(15)
        except subprocess.TimeoutExpired:
            agent.kill()
        inventory.stop()
        await relaying
        await log.close()
        server.stop()


def forget_ended(n: int = 2000) -> float:
    """Microseconds an agent that holds ENDED_KEPT ended jobs spends taking one more ended word's bookkeeping."""
    from services.inventory.agent import ENDED_KEPT, Agent
    from services.inventory.work import WorkOrder
    with tempfile.TemporaryDirectory() as tmp:
        agent = Agent(build("t4-4x", "n1"), Path(tmp))
        for i in range(ENDED_KEPT + n):
            job_id = f"j-{i}"
            agent.orders[job_id] = WorkOrder.model_construct(seq=1, job_id=job_id, ended=True)
            if hasattr(agent, "ended"):  # an agent before issue 15's tenth round scanned its words instead
                agent.ended[job_id] = None
            if i == ENDED_KEPT:
                t0 = time.perf_counter()
            agent._forget_ended()
    return 1e6 * (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=200)
    ap.add_argument("--idle-seconds", type=float, default=20)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", type=Path, help="run the agent under cProfile, its stats to this file (last run's)")
    ap.add_argument("--forget-ended", action="store_true", help="only: the cost of an ended job at ENDED_KEPT held")
    args = ap.parse_args()
    if args.forget_ended:
        print(f"{forget_ended():.1f} us an ended job, with ENDED_KEPT ended jobs held")
        return
    results = []
    print(f"task directories (TMPDIR) on {describe_fs(os.path.realpath(tempfile.gettempdir()))}")
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            r = asyncio.run(run(args.tasks, args.idle_seconds, Path(tmp), args.profile))
        results.append(r)
        print(f"run: {r['started_per_s']:.1f} tasks started/s, {r['started_and_exited_per_s']:.1f} started+exited/s, "
              f"CPU per task: agent {r['agent_cpu_ms_per_task']:.2f} ms, forker + launcher + task "
              f"{r['launch_cpu_ms_per_task']:.2f} ms; idle agent CPU {r['idle_cpu_pct']:.2f}% of one core", flush=True)
    med = {k: statistics.median(r[k] for r in results) for k in results[0] if k != "tasks"}
    print(f"\nmedian of {args.runs}: {med['started_per_s']:.1f} tasks started/s on one agent; CPU per task: agent "
          f"{med['agent_cpu_ms_per_task']:.2f} ms, forker + launcher + task {med['launch_cpu_ms_per_task']:.2f} ms; "
          f"idle CPU (heartbeat + telemetry at 1 s) {med['idle_cpu_pct']:.2f}% of one core "
          f"(target <= {CPU_TARGET_PCT}%: {'met' if med['idle_cpu_pct'] <= CPU_TARGET_PCT else 'missed'})")


if __name__ == "__main__":
    main()
