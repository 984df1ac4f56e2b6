"""Chaos as a benchmark: jobs keep coming while control-plane processes are SIGKILLed; nothing may be lost.

    python -m bench.chaos                   # every scenario (about 6 minutes)
    python -m bench.chaos --scenarios split,stack --seconds 60

Scenarios, each on a fresh data dir with simulated nodes, submissions running throughout
(short and long jobs, 2-task gangs, half GPUs; every command exits 0):

- ``split``:   `gpuorch up --split`; SIGKILL a random service process, or the embedded nats-server.
- ``stack``:   SIGKILL `gpuorch up` itself (its nats-server, agents and tasks live on), then `up` again.
- ``cluster``: a 3-node JetStream cluster (R3, ``sync_interval: always``) from the nats-server binary,
               `gpuorch up --split --nats a,b,c --replicas 3`; SIGKILL one NATS node, restart it later.
- ``leaders``: a second scheduler process (another instance) contends for the lease; SIGKILL the leader.

Printed per scenario and in total: kills by kind; time to ready after each (median, max); acknowledged
submissions missing from the log (must be 0); tasks started twice for one attempt (0); GPUs held by
two running tasks at once, from folding the agents' task starts and exits (0); jobs that failed
(0: no command fails); the standby's takeover time after the leader's SIGKILL; `events verify`. Each submission
carries an Idempotency-Key and is sent again with it while the answer is a broken connection or 503 (as `gpuorch
submit` does): how often, and jobs recorded twice (0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.inventory.taskdir import StateUnreadable, read_record
from shared.eventlog import EventLog
from shared.events import Envelope
from shared.natsauth import Credentials
from shared.natsd import NatsCluster, free_port

REPO = Path(__file__).resolve().parents[1]
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith(("GPUORCH_", "NATS_"))},
       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}  # packages kept apart too
SHAPES = [  # (weight, body): every command succeeds, so any failed job is the chaos's doing
    (5, {"name": "short", "resources": {"gpus": 1}, "command": ["sleep", "0.5"]}),
    (2, {"name": "gang", "tasks": 2, "resources": {"gpus": 1}, "command": ["sleep", "1"]}),
    (2, {"name": "long", "resources": {"gpus": 1}, "command": ["sleep", "8"]}),
    (1, {"name": "half", "resources": {"gpus": 0.5}, "command": ["sleep", "1"]}),
]
TERMINAL = {"succeeded", "failed", "cancelled", "rejected"}
RETRY_S = 30.0  # a submission is sent again with its key this long (a restart of `up` takes seconds)
RETRIED = ("ConnectError", "ReadError", "WriteError", "RemoteProtocolError", "ReadTimeout", "ConnectTimeout",
           "WriteTimeout", "PoolTimeout")


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")


def kill(pid: int | None, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid or 0, sig) if pid else None
    except ProcessLookupError:
        pass


class Stack:
    """`gpuorch up` as a subprocess on a data dir; its API client carries the admin token it created."""

    def __init__(self, data_dir: Path, nodes: str, split: bool, nats: str | None = None, replicas: int = 1) -> None:
        self.data_dir, self.nodes, self.split, self.nats, self.replicas = data_dir, nodes, split, nats, replicas
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._client: httpx.AsyncClient | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(self.port), "--data-dir", str(self.data_dir),
               "--nodes", self.nodes]
        cmd += ["--split"] if self.split else []
        cmd += ["--nats", self.nats, "--replicas", str(self.replicas)] if self.nats else []
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(cmd, env=ENV, start_new_session=True, stdout=open(self.data_dir / "up.out", "ab"),
                                     stderr=subprocess.STDOUT)

    def info(self, name: str = "stack.json") -> dict:
        try:
            return json.loads((self.data_dir / name).read_text())
        except (OSError, ValueError):
            return {}

    @property
    def api(self) -> httpx.AsyncClient:
        if self._client is None:
            token = (self.data_dir / "auth" / "admin.token").read_text().strip()
            self._client = httpx.AsyncClient(base_url=self.url, headers={"authorization": f"Bearer {token}"}, timeout=10)
        return self._client

    async def ready(self) -> bool:
        """Every service caught up and connected to the bus."""
        try:
            if (await self.api.get("/readyz")).status_code != 200:
                return False
            r = await self.api.get("/v1/services")
            return r.status_code == 200 and len(r.json()) == 5 and all(s.get("ready") for s in r.json())
        except (httpx.HTTPError, OSError, ValueError):
            return False

    async def until_ready(self, timeout: float = 120) -> float:
        t0 = time.monotonic()
        while not await self.ready():
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"stack on {self.data_dir} not ready after {timeout}s; see {self.data_dir / 'up.out'}")
            await asyncio.sleep(0.1)
        return time.monotonic() - t0

    async def log(self) -> EventLog:
        url = self.nats or self.info().get("nats_url", "")
        creds = Credentials.of_data_dir(self.data_dir)
        user = creds.control() if creds.path.exists() and not self.nats else None
        return await EventLog.connect(url, user=user.name if user else None, password=user.password if user else None,
                                      ensure=False)

    def stop(self) -> None:
        """Ctrl-C, then whatever is left of this data dir's processes."""
        info, split = self.info(), self.info("split.json")
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in [info.get("nats_pid"), *info.get("agent_pids", []), *(s.get("pid") for s in split.values())]:
            kill(pid)
        for task_dir in self.data_dir.glob("agents/*/jobs/*/*/*"):
            try:
                if (pid := read_record(task_dir).pid) > 1:
                    os.killpg(pid, signal.SIGKILL)
            except (OSError, StateUnreadable):
                pass


@dataclass
class Run:
    acked: set[str] = field(default_factory=set)
    refused: Counter = field(default_factory=Counter)
    sent_again: Counter = field(default_factory=Counter)  # why a submission was sent again with its key
    kills: Counter = field(default_factory=Counter)
    ready_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    takeover_s: list[float] = field(default_factory=list)


async def submit_forever(stack: Stack, run: Run, rate: float, stop: asyncio.Event, rng: random.Random) -> None:
    """Each submission carries an Idempotency-Key of its own and is sent again with it, as `gpuorch submit` does,
    while the answer is a broken connection or 503, for up to RETRY_S: every one recorded once, however often."""
    weights = [w for w, _ in SHAPES]
    n = 0
    while not stop.is_set():
        body, n = rng.choices([b for _, b in SHAPES], weights)[0], n + 1
        key, deadline = f"chaos-{os.getpid()}-{n}", time.monotonic() + RETRY_S
        while True:
            try:
                r = await stack.api.post("/v1/jobs", json=body, headers={"idempotency-key": key})
                why: str | int | None = None if r.status_code == 201 else r.status_code
            except (httpx.HTTPError, OSError) as e:
                why = type(e).__name__
            if why is None:
                run.acked.add(r.json()["id"])
                break
            if why not in (503, *RETRIED) or time.monotonic() > deadline:
                run.refused[why] += 1  # not acknowledged: nothing is promised
                break
            run.sent_again[why] += 1
            await asyncio.sleep(0.2)
        await asyncio.sleep(1 / rate)


# --- the killers -------------------------------------------------------------------------------


async def kill_split(stack: Stack, run: Run, rng: random.Random) -> None:
    split = stack.info("split.json")
    if rng.random() < 0.25:
        kind, pid = "nats-server", stack.info().get("nats_pid")
    else:
        kind = rng.choice(sorted(split))
        pid = split[kind]["pid"]
    kill(pid)
    run.kills[kind] += 1
    await asyncio.sleep(0.5)  # let the loss be seen
    run.ready_s[kind].append(await stack.until_ready() + 0.5)


async def kill_stack(stack: Stack, run: Run, rng: random.Random) -> None:
    assert stack.proc is not None
    os.killpg(stack.proc.pid, signal.SIGKILL)
    stack.proc.wait()
    run.kills["whole stack"] += 1
    t0 = time.monotonic()
    stack.start()
    await stack.until_ready()
    run.ready_s["whole stack"].append(time.monotonic() - t0)


async def kill_cluster_node(stack: Stack, run: Run, rng: random.Random, cluster: NatsCluster) -> None:
    i = rng.randrange(3)
    cluster.kill(i)
    run.kills["nats cluster node"] += 1
    await asyncio.sleep(0.5)
    run.ready_s["nats cluster node"].append(await stack.until_ready() + 0.5)
    await asyncio.sleep(rng.uniform(2, 5))  # the cluster runs on two nodes for a while
    cluster.start_one(i)


async def kill_leader(stack: Stack, run: Run, rng: random.Random, standby: subprocess.Popen) -> None:
    """SIGKILL whichever scheduler holds the lease; time until the other one's election is in the log."""
    log = await stack.log()
    try:
        elections = [r for r in [r async for r in log.replay(1, ["gpuorch.events.leader.scheduler"])] if isinstance(r, Envelope)]
        holder = elections[-1].data.holder  # host:pid:instance
        pid = int(holder.split(":")[1])
        kill(pid)
        run.kills["scheduler leader"] += 1
        t0, seen = time.monotonic(), len(elections)
        while True:
            now = [r async for r in log.replay(1, ["gpuorch.events.leader.scheduler"])]
            if len(now) > seen and now[-1].data.holder != holder:
                run.takeover_s.append(time.monotonic() - t0)
                break
            if time.monotonic() - t0 > 60:
                run.takeover_s.append(float("inf"))
                break
            await asyncio.sleep(0.1)
    finally:
        await log.close()
    run.ready_s["scheduler leader"].append(await stack.until_ready())


# --- what the log says -----------------------------------------------------------------------


async def audit(stack: Stack, run: Run, settle_s: float) -> dict:
    """Wait for the acknowledged jobs to end, then fold the log independently of the services' code."""
    from services.cli import verify_log

    deadline = time.monotonic() + settle_s
    log = await stack.log()
    try:
        while True:
            records = [r async for r in log.replay(1) if isinstance(r, Envelope)]
            state: dict[str, str] = {}
            for r in records:
                if r.data.aggregate == "job":
                    t = r.data.TYPE.split(".")[1]
                    if t in TERMINAL or t in ("queued", "placed", "submitted", "preempting"):
                        state[r.data.job_id] = t
            open_jobs = [j for j in run.acked if state.get(j) not in TERMINAL]
            if not open_jobs or time.monotonic() > deadline:
                break
            await asyncio.sleep(2)
        verify = await verify_log(log)
    finally:
        await log.close()
    submitted = {r.data.job_id for r in records if r.data.TYPE == "job.submitted"}
    attempt: dict[str, int] = {}
    placement: dict[tuple[str, int, int], tuple] = {}
    starts: Counter = Counter()
    held: dict[str, int] = defaultdict(int)
    running: dict[tuple[str, int, int], tuple] = {}
    double_booked, failed = 0, []
    for r in records:
        e = r.data
        if e.TYPE == "job.placed":
            attempt[e.job_id] = r.seq
            for p in e.placements:
                placement[(e.job_id, r.seq, p.task)] = tuple((g.uuid, g.milli) for g in p.gpus)
        elif e.TYPE == "job.task_started":
            key = (e.job_id, attempt.get(e.job_id, 0), e.task)
            starts[key] += 1
            if starts[key] == 1 and key in placement:
                running[key] = placement[key]
                for uuid, milli in placement[key]:
                    held[uuid] += milli
                    double_booked += held[uuid] > 1000
        elif e.TYPE == "job.task_exited":
            for k in [k for k in running if k[0] == e.job_id and k[2] == e.task]:
                for uuid, milli in running.pop(k):
                    held[uuid] -= milli
        elif e.TYPE == "job.failed":
            failed.append(f"{e.job_id}: {e.reason}"[:160])
    invalid = sum(v["invalid_transitions"] for v in verify)
    return {
        "acked": len(run.acked), "lost": len(run.acked - submitted), "unfinished": len(open_jobs),
        "sent_again": dict(run.sent_again),
        "recorded_twice": sum(1 for n in Counter(r.data.job_id for r in records
                                                 if r.data.TYPE == "job.submitted").values() if n > 1),
        "started_twice": sum(1 for n in starts.values() if n > 1), "double_booked": double_booked,
        "failed": len(failed), "failed_examples": failed[:5], "refused": dict(run.refused),
        "kills": dict(run.kills), "ready_s": {k: (statistics.median(v), max(v)) for k, v in run.ready_s.items()},
        "takeover_s": run.takeover_s, "verify_invalid": invalid,
        "verify": {v["service"]: {k: v[k] for k in v if k in ("invalid_transitions", "skipped", "fenced", "refused")}
                   for v in verify},
    }


# --- scenarios ---------------------------------------------------------------------------------


async def scenario(name: str, seconds: float, rate: float, seed: int, root: Path) -> dict:
    rng = random.Random(seed)
    run = Run()
    cluster = standby = None
    nodes = "t4-4x:3,l4-8x:1"
    if name == "cluster":
        cluster = NatsCluster(root / "cluster", sync_always=True).start()
        stack = Stack(root / "data", nodes, split=True, nats=cluster.url, replicas=3)
    else:
        stack = Stack(root / "data", nodes, split=name in ("split", "leaders"))
    stack.start()
    try:
        run.ready_s["first start"].append(await stack.until_ready())
        if name == "leaders":
            url = stack.info().get("nats_url", "")
            user = Credentials.of_data_dir(stack.data_dir).control()
            standby = subprocess.Popen(
                [sys.executable, "-m", "services.scheduler", "--nats", url, "--port", str(free_port()), "--instance", "standby"],
                env={**ENV, "GPUORCH_NATS_USER": user.name, "GPUORCH_NATS_PASSWORD": user.password,
                     "GPUORCH_DATA_DIR": str(stack.data_dir)},
                stdout=open(root / "standby.out", "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        stop = asyncio.Event()
        submitter = asyncio.create_task(submit_forever(stack, run, rate, stop, rng))
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            await asyncio.sleep(rng.uniform(4, 8))
            if name == "split":
                await kill_split(stack, run, rng)
            elif name == "stack":
                await kill_stack(stack, run, rng)
            elif name == "cluster":
                await kill_cluster_node(stack, run, rng, cluster)
            elif name == "leaders":
                await kill_leader(stack, run, rng, standby)
        stop.set()
        await submitter
        return await audit(stack, run, settle_s=90)
    finally:
        if stack._client is not None:
            await stack._client.aclose()
        stack.stop()
        if standby is not None:
            kill(standby.pid)
        if cluster is not None:
            cluster.stop()


def show(name: str, r: dict) -> None:
    ready = ", ".join(f"{k} {m:.1f}/{x:.1f} s" for k, (m, x) in r["ready_s"].items())
    takeover = ", ".join(f"{t:.1f}" for t in r["takeover_s"]) or "-"
    print(f"\n== {name}: kills {r['kills']}")
    print(f"   time to ready (median/max): {ready}")
    print(f"   acknowledged {r['acked']}, lost {r['lost']} (target 0), unfinished {r['unfinished']}, refused {r['refused']}")
    print(f"   sent again with their key {r['sent_again']}, recorded twice {r['recorded_twice']} (0)")
    print(f"   tasks started twice {r['started_twice']} (0), GPU double-booked {r['double_booked']} (0), "
          f"jobs failed {r['failed']} (0) {r['failed_examples']}")
    print(f"   standby takeover after the leader's SIGKILL: {takeover} s; events verify: "
          f"{'clean' if not r['verify_invalid'] else str(r['verify_invalid']) + ' invalid transitions'} {r['verify']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="split,stack,cluster,leaders")
    ap.add_argument("--seconds", type=float, default=60, help="chaos time per scenario")
    ap.add_argument("--rate", type=float, default=4, help="submissions per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    out = {}
    for name in args.scenarios.split(","):
        with tempfile.TemporaryDirectory(prefix=f"chaos-{name}-") as tmp:
            out[name] = asyncio.run(scenario(name, args.seconds, args.rate, args.seed, Path(tmp)))
        show(name, out[name])
    total = {k: sum(r[k] for r in out.values()) for k in ("acked", "lost", "recorded_twice", "started_twice",
                                                          "double_booked", "failed", "verify_invalid")}
    print(f"\nall: {total}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
