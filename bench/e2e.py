"""End to end, side by side with a real Slurm (issue 15): the same short jobs through gpuorch and through Slurm.

    python -m bench.e2e [--json [FILE]] [--jobs 500] [--repeats 3] [--only gpuorch|slurm] [--rows ROW,...] [--profile]
                        [--timeline]
    python -m bench.e2e --idle SECONDS   # only: what an idle 16-node stack's processes spend

Workloads (``--workloads``): ``1gpu``, jobs of `true` asking 1 GPU each; ``mix``, the same command asking
1,1,2,4,8 GPUs in turn. Always 8 parallel submitters. Each run starts its scheduler afresh, submits ``--jobs``
jobs, waits until every one has ended and reads every job's own times; each figure is the median of
``--repeats`` runs:

- submitted/s: jobs over the time from the first submission until the last was answered;
- finished/s: jobs over the time from the first submission until the last job ended;
- submit -> start p50/p99: from the scheduler's record of the submission to the allocation (gpuorch's
  ``placed_at``, Slurm's ``sched: Allocate``) and to the task's start (gpuorch's ``started_at``, slurmd's
  ``Launching batch job``); it includes the wait behind the other jobs for GPUs.

Rows (``--rows``, default all):

- ``slurm-1x8``: Slurm 22.05 from Debian (`slurm-wlm`, munge), slurmctld and one slurmd on this machine, one
  node with 8 GPU GRES backed by character devices, set up as /work/shared/SLURM_ANCHOR.md says (its "tuned"
  configuration; accounting off); `sbatch --wrap true --gres=gpu:N -o /dev/null` from 8 threads. Installed with
  apt-get when missing (root only). Start and end from slurmctld's and slurmd's logs.
- ``gpuorch-1x8``: `gpuorch up --nodes dgx-h100:1` (one 8-GPU node: Slurm's shape), 8 concurrent single POSTs.
- ``gpuorch-16x8``, ``gpuorch-16x8-batch``: `--nodes dgx-h100:16` (128 GPUs, the issue's target shape), single
  POSTs from 8 clients, or the batch API (each of the 8 submitters posts its share of jobs as one JSON list).
- ``split-16x8``, ``split-16x8-batch``: the same with `gpuorch up --split` (one OS process per service).

For gpuorch, the end is polled with ``GET /v1/jobs?name=RUN&state=S`` for each unended state S (cursor paging; one
state per request, as the --split gateway keeps only the last of repeated parameters) and the times are the jobs' own (``GET /v1/jobs``); a stage breakdown (submitted -> queued -> placed ->
task started -> task exited -> succeeded, medians over the jobs) is read from the log (``GET /v1/events?subject=job``).
``--profile`` runs one-process stacks under cProfile and prints their top functions. ``--timeline`` prints, per
quarter second of each run, the machine's CPU busy share and how many jobs were placed, started, exited and
succeeded in it (where the pipeline idles). Every process started
(gpuorch up and its children, slurmctld, slurmd, munged, slurmstepd) is stopped on exit, Ctrl-C or error.
Figures: docs/benchmarks/e2e.md.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import pstats
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx

from bench.chaos import ENV, Stack, kill
from bench.fsops import describe_fs

WORKLOADS = {"1gpu": [1], "mix": [1, 1, 2, 4, 8]}
SUBMITTERS = 8
TARGETS = {"finished_per_s_16_nodes": 200}
ANCHOR = {  # /work/shared/SLURM_ANCHOR.md, 500 jobs, one 8-GPU node, medians of 3, 2 cores
    "1gpu": {"submitted_per_s": 103, "finished_per_s": 47.4, "start_p50_s": 4.4, "start_p99_s": 6.0},
    "mix": {"submitted_per_s": 163, "finished_per_s": 34.6, "start_p50_s": 6.4, "start_p99_s": 10.9},
}
ACTIVE = ("queued", "placed", "running", "preempting")  # every state a job may be in before it ends
STAGES = [("submitted", "queued"), ("queued", "placed"), ("placed", "task_started"),
          ("task_started", "task_exited"), ("task_exited", "succeeded"), ("submitted", "succeeded")]


@dataclass(frozen=True)
class Row:
    name: str
    system: str  # gpuorch | slurm
    nodes: int  # 8-GPU nodes
    split: bool = False
    batch: bool = False

    def describe(self) -> str:
        if self.system == "slurm":
            return f"Slurm 22.05, {self.nodes} node x 8 GPUs, sbatch x8"
        mode = "--split" if self.split else "one process"
        return f"gpuorch {mode}, dgx-h100:{self.nodes}, {'batch x8' if self.batch else 'single POST x8'}"


ROWS = [
    Row("slurm-1x8", "slurm", 1),
    Row("gpuorch-1x8", "gpuorch", 1),
    Row("gpuorch-16x8", "gpuorch", 16),
    Row("gpuorch-16x8-batch", "gpuorch", 16, batch=True),
    Row("split-16x8", "gpuorch", 16, split=True),
    Row("split-16x8-batch", "gpuorch", 16, split=True, batch=True),
]


def gpus_of(workload: str, jobs: int) -> list[int]:
    mix = WORKLOADS[workload]
    return [mix[i % len(mix)] for i in range(jobs)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- gpuorch ------------------------------------------------------------------------------------


class ProfiledStack(Stack):
    """`gpuorch up` under cProfile (one-process mode: the services run in that process; agents are not profiled)."""

    def __init__(self, *a, profile: Path | None = None, **kw) -> None:
        super().__init__(*a, **kw)
        self.profile = profile

    def start(self) -> None:
        if self.profile is None:
            return super().start()
        cmd = [sys.executable, "-m", "cProfile", "-o", str(self.profile), "-m", "services.cli", "up", "--port",
               str(self.port), "--data-dir", str(self.data_dir), "--nodes", self.nodes]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(cmd, env=ENV, start_new_session=True,
                                     stdout=open(self.data_dir / "up.out", "ab"), stderr=subprocess.STDOUT)


def api_client(stack: Stack) -> httpx.AsyncClient:
    token = (stack.data_dir / "auth" / "admin.token").read_text().strip()
    return httpx.AsyncClient(base_url=stack.url, headers={"authorization": f"Bearer {token}"}, timeout=120,
                             limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))


async def pages(c: httpx.AsyncClient, path: str, params: dict) -> list[dict]:
    """Every job of a listing, following X-Next-Cursor."""
    out, cursor = [], None
    for _ in range(10_000):
        r = await c.get(path, params={**params, "limit": 1000, **({"cursor": cursor} if cursor else {})})
        r.raise_for_status()
        out += r.json()
        cursor = r.headers.get("x-next-cursor")
        if not cursor:
            return out
    raise RuntimeError("cursor did not end")


async def first_page(c: httpx.AsyncClient, params: dict) -> list[dict]:
    r = await c.get("/v1/jobs", params=params)
    r.raise_for_status()
    return r.json()


async def events_since(c: httpx.AsyncClient, after: int) -> list[dict]:
    out: list[dict] = []
    while True:
        r = await c.get("/v1/events", params={"after": after, "subject": "job", "limit": 10_000})
        r.raise_for_status()
        page = r.json()
        if not page:
            return out
        out += page
        after = page[-1]["seq"]


def stamp(e: dict) -> float:
    return datetime.fromisoformat(e["time"].replace("Z", "+00:00")).timestamp()


def stage_times(events: list[dict], ids: set[str]) -> tuple[dict[str, list[float]], float]:
    """Per job: when it was submitted, queued, placed, its (last) task started and exited, and it succeeded;
    -> seconds of each stage, over the jobs, and the events per job."""
    seen: dict[str, dict[str, float]] = {}
    count: dict[str, int] = {}
    for e in events:
        jid = e.get("subject", "").partition("/")[2]
        if jid not in ids:
            continue
        count[jid] = count.get(jid, 0) + 1
        kind = e["type"].removeprefix("io.gpuorch.job.").rsplit(".v", 1)[0]
        at = seen.setdefault(jid, {})
        if kind in ("task_started", "task_exited"):
            at[kind] = max(at.get(kind, 0.0), stamp(e))
        elif kind in ("submitted", "queued", "placed", "succeeded"):
            at.setdefault(kind, stamp(e))  # the first (a requeued job is placed again: count the first try)
    stages: dict[str, list[float]] = {f"{a}->{b}": [] for a, b in STAGES}
    for at in seen.values():
        for a, b in STAGES:
            if a in at and b in at:
                stages[f"{a}->{b}"].append(at[b] - at[a])
    return stages, (sum(count.values()) / len(count) if count else float("nan"))


TICK = os.sysconf("SC_CLK_TCK")


class CpuSampler:
    """The machine's busy share of its CPUs (/proc/stat), every ``every`` seconds, in a (daemon) thread, from
    ``start`` to ``stop``."""

    def __init__(self, every: float = 0.1) -> None:
        self.every, self.samples, self._stop = every, [], threading.Event()  # samples: (epoch s, busy 0..1)
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _read() -> tuple[int, int]:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = f[3] + f[4]  # idle + iowait
        return sum(f) - idle, sum(f)

    def _run(self) -> None:
        busy0, all0 = self._read()
        while not self._stop.wait(self.every):
            busy1, all1 = self._read()
            self.samples.append((time.time(), (busy1 - busy0) / max(1, all1 - all0)))
            busy0, all0 = busy1, all1

    def start(self) -> "CpuSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def timeline(events: list[dict], ids: set[str], cpu: list[tuple[float, float]], t0: float, step: float = 0.25) -> str:
    """Per ``step`` seconds from the first submission: the machine's CPU busy share and how many of the run's jobs
    were placed, had a task start and exit, and succeeded in it (``--timeline``: where the pipeline idles)."""
    kinds = ("placed", "task_started", "task_exited", "succeeded")
    buckets: dict[int, dict[str, float]] = {}
    for e in events:
        kind = e["type"].removeprefix("io.gpuorch.job.").rsplit(".v", 1)[0]
        if kind in kinds and e.get("subject", "").partition("/")[2] in ids:
            b = buckets.setdefault(int((stamp(e) - t0) / step), {})
            b[kind] = b.get(kind, 0) + 1
    for t, busy in cpu:
        b = buckets.setdefault(int((t - t0) / step), {})
        b["cpu"], b["n"] = b.get("cpu", 0.0) + busy, b.get("n", 0) + 1
    lines = [f"{'t s':>6} {'cpu %':>6} " + " ".join(f"{k:>12}" for k in kinds)]
    for i in range(min(buckets, default=0), max(buckets, default=-1) + 1):
        b = buckets.get(i, {})
        cpu_pct = f"{100 * b['cpu'] / b['n']:6.0f}" if b.get("n") else f"{'':>6}"
        lines.append(f"{i * step:6.2f} {cpu_pct} " + " ".join(f"{b.get(k, 0):12.0f}" for k in kinds))
    return "\n".join(lines)


def cpu_seconds(pid: int | None) -> tuple[float, float]:
    """(its own CPU seconds, its reaped children's) from /proc: an agent's children are its tasks' launchers."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / TICK, (int(f[13]) + int(f[14])) / TICK
    except (OSError, ValueError, IndexError, TypeError):
        return 0.0, 0.0


def stack_cpu(stack: Stack) -> dict[str, float]:
    """CPU seconds so far of each kind of the stack's processes."""
    info, split = stack.info(), stack.info("split.json")
    out: dict[str, float] = {}

    def add(kind: str, x: float) -> None:
        out[kind] = out.get(kind, 0.0) + x
    own, _ = cpu_seconds(stack.proc.pid if stack.proc else None)
    add("gateway (up)" if split else "up: services + API", own)
    for name, s in split.items():
        add(f"service {name}", cpu_seconds(s.get("pid"))[0])
    add("nats-server", cpu_seconds(info.get("nats_pid"))[0])
    for pid in info.get("agent_pids", []):
        a, children = cpu_seconds(pid)
        add("agents", a)
        add("task launchers + tasks", children)  # a forker that ended (restarted), or a launcher started without one
        # the agent's task keeper, its account keepers and the tasks alive: each its own CPU and its reaped children's
        for p in descendants(pid):
            add("task launchers + tasks", sum(cpu_seconds(p)))
    return out


def children_of(pid: int) -> list[int]:
    try:
        return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except (OSError, ValueError):
        return []


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid``: summing each one's own CPU and its reaped children's counts each once."""
    out, todo = [], children_of(pid)
    while todo:
        out.append(p := todo.pop())
        todo += children_of(p)
    return out


async def gpuorch_run(row: Row, workload: str, jobs: int, root: Path, run_id: str, profile: bool,
                      show_timeline: bool = False) -> dict:
    prof = root / "up.prof" if profile and not row.split else None
    stack = ProfiledStack(root / "data", f"dgx-h100:{row.nodes}", split=row.split, profile=prof)
    stack.start()
    try:
        await stack.until_ready(240)
        c = api_client(stack)
        async with c:
            while len((await c.get("/v1/nodes")).json()) < row.nodes:
                await asyncio.sleep(0.2)
            # warm up: one job through every stage (imports, first spawn), not counted
            r = await c.post("/v1/jobs", json={"name": "warmup", "resources": {"gpus": 1}, "command": ["true"]})
            assert r.status_code == 201, r.text
            while (await c.get(f"/v1/jobs/{r.json()['id']}")).json()["state"] in ACTIVE:
                await asyncio.sleep(0.1)
            name = f"e2e-{run_id}"
            bodies = [{"name": name, "resources": {"gpus": g}, "command": ["true"]} for g in gpus_of(workload, jobs)]
            answers: dict[int | str, int] = {}

            async def post(body: object) -> None:
                for attempt in range(3):
                    try:
                        r = await c.post("/v1/jobs", json=body)
                    except httpx.HTTPError as e:  # not acknowledged: the POST may or may not have been recorded
                        answers[type(e).__name__] = answers.get(type(e).__name__, 0) + 1
                        raise
                    answers[r.status_code] = answers.get(r.status_code, 0) + 1
                    if r.status_code in (201, 503):  # 503: recorded, its fold over 2 s behind (do not resubmit)
                        return
                    raise RuntimeError(f"POST /v1/jobs answered {r.status_code}: {r.text[:300]}")

            shares = [bodies[i::SUBMITTERS] for i in range(SUBMITTERS)]

            async def submitter(share: list[dict]) -> None:
                if row.batch:
                    for i in range(0, len(share), 1000):
                        await post(share[i:i + 1000])
                else:
                    for body in share:
                        await post(body)

            cpu0, me0 = stack_cpu(stack), time.process_time()
            sampler = CpuSampler().start()
            t0 = time.time()
            await asyncio.gather(*(submitter(s) for s in shares if s))
            t_sub = time.time()
            polls = 0
            while True:  # until none of this run's jobs is queued, placed or running
                polls += 1
                # one state per request: `gpuorch up --split`'s gateway forwards only the last of repeated query
                # parameters (services/stack.py, params=request.query_params), so ?state=a&state=b is ?state=b there
                # limit=1: whether any is left, not which (listing them all four times a second took the stack's CPU)
                left = [j for st in ACTIVE for j in await first_page(c, {"name": name, "state": st, "limit": 1})]
                # a 503 answer means recorded but not folded yet: done only once every job is seen, and ended
                if not left:
                    seen = await pages(c, "/v1/jobs", {"name": name})
                    if len(seen) >= jobs and not any(v["state"] in ACTIVE for v in seen):
                        break
                if time.time() - t0 > 1800:
                    raise TimeoutError("jobs still active after 1800 s")
                await asyncio.sleep(0.25)
            t_poll = time.time()
            sampler.stop()
            cpu1 = {**stack_cpu(stack), "bench client (this process)": time.process_time() - me0}
            views = await pages(c, "/v1/jobs", {"name": name})
            events = await events_since(c, 0)  # a fresh stack: its whole job log
    finally:
        stack.stop()
    states = {}
    for v in views:
        states[v["state"]] = states.get(v["state"], 0) + 1
    ended = [v["ended_at"] for v in views if v["ended_at"]]
    placed = [v["placed_at"] - v["submitted_at"] for v in views if v["placed_at"]]
    started = [v["started_at"] - v["submitted_at"] for v in views if v["started_at"]]
    ids = {v["id"] for v in views}
    stages, per_job = stage_times(events, ids)
    types: dict[str, int] = {}
    for e in events:
        if e.get("subject", "").partition("/")[2] in ids:
            t = e["type"].removeprefix("io.gpuorch.").rsplit(".v", 1)[0]
            types[t] = types.get(t, 0) + 1
    unsucceeded: dict[str, int] = {}  # why, for each job that did not succeed (a `true` always should)
    for v in views:
        if v["state"] != "succeeded":
            why = f"{v['state']}: {v.get('reason') or '-'}"
            unsucceeded[why] = unsucceeded.get(why, 0) + 1
    out = {"jobs": len(views), "states": states, "not_succeeded": unsucceeded,
           "answers": {str(k): v for k, v in answers.items()},
           "submit_s": t_sub - t0, "submitted_per_s": jobs / (t_sub - t0),
           "finished_per_s": len(views) / (max(ended) - t0) if ended else float("nan"),
           "finished_per_s_polled": len(views) / (t_poll - t0), "polls": polls,
           "placed_p50_s": pct(placed, 0.5), "placed_p99_s": pct(placed, 0.99),
           "start_p50_s": pct(started, 0.5), "start_p99_s": pct(started, 0.99),
           "events_per_job": per_job, "event_types": {k: round(v / max(1, len(views)), 2) for k, v in types.items()},
           "cpu_s": {k: round(v - cpu0.get(k, 0.0), 2) for k, v in cpu1.items()}, "wall_s": t_poll - t0,
           "stages": {k: {"p50_ms": pct(v, 0.5) * 1000, "p99_ms": pct(v, 0.99) * 1000, "n": len(v)}
                      for k, v in stages.items()}}
    if prof is not None and prof.exists():
        out["profile"] = top_functions(prof)
    if show_timeline:
        print(f"\n=== timeline, {row.name} {workload} ===\n{timeline(events, ids, sampler.samples, t0)}", file=sys.stderr)
    return out


def top_functions(path: Path, n: int = 30) -> str:
    s = io.StringIO()
    st = pstats.Stats(str(path), stream=s)
    st.sort_stats("tottime").print_stats(n)
    st.sort_stats("cumulative").print_stats(n)
    return s.getvalue()


# --- Slurm --------------------------------------------------------------------------------------


SLURM_CONF = """\
ClusterName=anchor
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld}-{ctld_end}
SlurmdPort={slurmd}
AuthType=auth/munge
AuthInfo=socket={w}/munge/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={w}/state
SlurmdSpoolDir={w}/spool/%n
SlurmctldPidFile={w}/slurmctld.pid
SlurmdPidFile={w}/slurmd.pid
SlurmctldLogFile={w}/log/slurmctld.log
SlurmdLogFile={w}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,default_queue_depth=1000,max_rpc_cnt=64
GresTypes=gpu
MaxJobCount=100000
MinJobAge=3600
MessageTimeout=30
SlurmdParameters=config_overrides
NodeName=localhost NodeHostname={host} NodeAddr=127.0.0.1 CPUs=64 Gres=gpu:8 State=UNKNOWN
PartitionName=gpu Nodes=localhost Default=YES MaxTime=INFINITE State=UP
MailProg=/bin/true
Epilog=/bin/true
"""


def ports_free(ports: list[int]) -> bool:
    for p in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


def free_range() -> int:
    """A base port P with P..P+3 (slurmctld) and P+10 (slurmd) free."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base < 60000 and ports_free([base, base + 1, base + 2, base + 3, base + 10]):
            return base
    raise RuntimeError("no free port range for Slurm")


def ensure_slurm() -> None:
    """Debian's slurm-wlm and munge, installed with apt-get when missing (root only)."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "squeue", "munged")):
        return
    if os.geteuid() != 0:
        raise RuntimeError("Slurm is not installed and this is not root: apt-get install slurm-wlm munge")
    log("installing slurm-wlm and munge with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"], check=True, env=env,
                   stdout=subprocess.DEVNULL)


LOG_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)\] (.*)$")


def log_time(s: str) -> float:
    return datetime.fromisoformat(s).timestamp()  # local time, as time.time() reads it


class Slurm:
    """munged, slurmctld and slurmd on a scratch dir; stop() ends every process it started."""

    def __init__(self, w: Path) -> None:
        self.w = w
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(w / "slurm.conf")}

    def start(self) -> None:
        w = self.w
        for d in ("munge", "state", "spool/localhost", "log", "dev"):
            (w / d).mkdir(parents=True, exist_ok=True)
        (w / "munge").chmod(0o700)
        key = w / "munge" / "munge.key"
        if not key.exists():
            if shutil.which("mungekey"):
                subprocess.run(["mungekey", "-c", "-k", str(key)], check=True)
            else:
                key.write_bytes(os.urandom(1024))
            key.chmod(0o600)
        for i in range(8):
            dev = w / "dev" / f"gpu{i}"
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))  # character devices: GPU GRES need them
        host = socket.gethostname().split(".")[0]
        base = free_range()
        (w / "slurm.conf").write_text(SLURM_CONF.format(host=host, ctld=base, ctld_end=base + 3, slurmd=base + 10,
                                                        w=w))
        (w / "gres.conf").write_text(f"AutoDetect=off\nNodeName=localhost Name=gpu File={w}/dev/gpu[0-7]\n")
        self.spawn(["munged", "-F", "-f", f"--key-file={key}", f"--socket={w}/munge/munge.socket",
                    f"--pid-file={w}/munge/munged.pid", f"--log-file={w}/log/munged.log",
                    f"--seed-file={w}/munge/munged.seed"], "munged.out")
        deadline = time.monotonic() + 10
        while not (w / "munge" / "munge.socket").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self.tail('munged.out')}")
            time.sleep(0.05)
        self.spawn(["slurmctld", "-D", "-c", "-f", str(w / "slurm.conf")], "slurmctld.out")
        self.spawn(["slurmd", "-D", "-N", "localhost", "-f", str(w / "slurm.conf")], "slurmd.out")
        deadline = time.monotonic() + 60
        while True:
            r = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if r.stdout.strip() == "idle":
                return
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"Slurm not idle after 60 s ({r.stdout.strip()} {r.stderr.strip()}): "
                                   f"{self.tail('slurmctld.out')} {self.tail('slurmd.out')}")
            time.sleep(0.3)

    def tail(self, name: str) -> str:
        try:
            return (self.w / "log" / name).read_text()[-1500:]
        except OSError:
            return ""

    def spawn(self, cmd: list[str], out: str) -> None:
        self.procs.append(subprocess.Popen(cmd, env=self.env, cwd=self.w, start_new_session=True,
                                           stdout=open(self.w / "log" / out, "ab"), stderr=subprocess.STDOUT))

    def stepds(self) -> list[int]:
        """slurmstepd processes of this slurmd (they outlive it): those whose environment names our SLURM_CONF,
        or whose parent is one of ours."""
        ours, mine = {p.pid for p in self.procs}, []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if b"slurmstepd" not in (d / "cmdline").read_bytes():
                    continue
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                conf = str(self.w).encode() in (d / "environ").read_bytes()
            except (OSError, ValueError, IndexError):
                continue
            if ppid in ours or conf:
                mine.append(int(d.name))
        return mine

    def stop(self) -> None:
        for p in reversed(self.procs):  # slurmd, slurmctld, munged
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for pid in self.stepds():
            kill(pid)
        self.procs = []

    def idle(self) -> bool:
        r = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True)
        return r.returncode == 0 and not r.stdout.strip()

    def sbatch(self, gpus: int) -> int:
        for attempt in range(5):
            r = subprocess.run(["sbatch", "--parsable", "--wrap", "true", f"--gres=gpu:{gpus}", "-o", "/dev/null",
                                "-e", "/dev/null", "-D", str(self.w)], env=self.env, capture_output=True, text=True,
                               cwd=self.w)
            if r.returncode == 0:
                return int(r.stdout.strip().split(";")[0])
            time.sleep(0.2 * (attempt + 1))  # "Socket timed out", "Resource temporarily unavailable"
        raise RuntimeError(f"sbatch failed: {r.stderr.strip()}")

    def times(self) -> dict[int, dict[str, float]]:
        """Per job id: submit, allocate, launch (slurmd) and complete times from the daemons' logs."""
        at: dict[int, dict[str, float]] = {}
        pats = {"submit": re.compile(r"_slurm_rpc_submit_batch_job: JobId=(\d+)"),
                "allocate": re.compile(r"(?:sched: Allocate|_start_job: Started) JobId=(\d+)"),
                "complete": re.compile(r"_job_complete: JobId=(\d+) done")}
        launch = re.compile(r"Launching batch job (\d+)")
        for name, kinds in (("slurmctld.log", pats), ("slurmd.log", {"launch": launch})):
            try:
                text = (self.w / "log" / name).read_text(errors="replace")
            except OSError:
                continue
            for line in text.splitlines():
                m = LOG_LINE.match(line)
                if not m:
                    continue
                for kind, pat in kinds.items():
                    if (j := pat.search(m.group(2))) is not None:
                        at.setdefault(int(j.group(1)), {}).setdefault(kind, log_time(m.group(1)))
        return at


def slurm_run(workload: str, jobs: int, root: Path) -> dict:
    slurm = Slurm(root)
    try:
        slurm.start()
        slurm.sbatch(1)  # warm up, not counted
        while not slurm.idle():
            time.sleep(0.1)
        gpus = gpus_of(workload, jobs)
        ids: list[int] = []
        lock = threading.Lock()

        def submitter(share: list[int]) -> None:
            for g in share:
                jid = slurm.sbatch(g)
                with lock:
                    ids.append(jid)

        t0 = time.time()
        with ThreadPoolExecutor(SUBMITTERS) as pool:
            list(pool.map(submitter, [gpus[i::SUBMITTERS] for i in range(SUBMITTERS)]))
        t_sub = time.time()
        polls = 0
        while not slurm.idle():
            polls += 1
            if time.time() - t0 > 1800:
                raise TimeoutError("Slurm jobs still queued after 1800 s")
            time.sleep(0.25)
        t_poll = time.time()
        time.sleep(0.5)  # the last lines reach the logs
        at = slurm.times()
    finally:
        slurm.stop()
    mine = [at.get(j, {}) for j in ids]
    ended = [a["complete"] for a in mine if "complete" in a]
    placed = [a["allocate"] - a["submit"] for a in mine if "allocate" in a and "submit" in a]
    started = [a["launch"] - a["submit"] for a in mine if "launch" in a and "submit" in a]
    stages: dict[str, list[float]] = {"submit->allocate": [], "allocate->launch": [], "launch->complete": [],
                                      "submit->complete": []}
    for a in mine:
        for k in stages:
            x, y = k.split("->")
            if x in a and y in a:
                stages[k].append(a[y] - a[x])
    return {"jobs": len(ids), "logged": {k: sum(k in a for a in mine) for k in ("submit", "allocate", "launch",
                                                                                 "complete")},
            "submit_s": t_sub - t0, "submitted_per_s": jobs / (t_sub - t0),
            "finished_per_s": len(ids) / (max(ended) - t0) if len(ended) == len(ids) else len(ids) / (t_poll - t0),
            "finished_per_s_polled": len(ids) / (t_poll - t0), "polls": polls,
            "placed_p50_s": pct(placed, 0.5), "placed_p99_s": pct(placed, 0.99),
            "start_p50_s": pct(started, 0.5), "start_p99_s": pct(started, 0.99),
            "stages": {k: {"p50_ms": pct(v, 0.5) * 1000, "p99_ms": pct(v, 0.99) * 1000, "n": len(v)}
                       for k, v in stages.items()}}


# --- driver -------------------------------------------------------------------------------------

FIGURES = ("submitted_per_s", "finished_per_s", "placed_p50_s", "placed_p99_s", "start_p50_s", "start_p99_s")


def median_of(runs: list[dict]) -> dict:
    med = {k: statistics.median(r[k] for r in runs) for k in FIGURES}
    stages = {}
    for k in runs[0]["stages"]:
        stages[k] = {q: statistics.median(r["stages"][k][q] for r in runs) for q in ("p50_ms", "p99_ms")}
    med["stages"] = stages
    if "cpu_s" in runs[0]:
        med["cpu_s"] = {k: statistics.median(r["cpu_s"].get(k, 0.0) for r in runs) for k in runs[0]["cpu_s"]}
        med["wall_s"] = statistics.median(r["wall_s"] for r in runs)
    if "events_per_job" in runs[0]:
        med["events_per_job"] = statistics.median(r["events_per_job"] for r in runs)
    return med


def run_all(rows: list[Row], workloads: list[str], jobs: int, repeats: int, profile: bool,
            show_timeline: bool = False, partial: Path | None = None) -> dict:
    """Every run of every row; ``partial``: the runs so far written there as JSON after each run (a run that fails,
    a disk that fills, a Ctrl-C, loses only itself: an invocation takes 10-15 minutes)."""
    out: dict = {"cores": len(os.sched_getaffinity(0)), "jobs": jobs, "repeats": repeats, "submitters": SUBMITTERS,
                 "files_on": describe_fs(os.path.realpath(tempfile.gettempdir())),
                 "load_before": os.getloadavg(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "rows": {}}
    if any(r.system == "slurm" for r in rows):
        ensure_slurm()
    # repeats outermost, rows interleaved: a noisy minute on the shared machine hits every row alike. Every run's
    # files stay until the end: on ext4, files created within a minute (up to six) after many were removed cost
    # 6-25x the CPU (the inode allocator skips each recently freed inode), so removing a run's files would slow
    # the next run, whichever system it measures (docs/benchmarks/e2e.md, tenth round)
    with tempfile.TemporaryDirectory(prefix="e2e-") as root:
        for rep in range(repeats):
            for row in rows:
                for wl in workloads:
                    tmp = tempfile.mkdtemp(prefix=f"{row.name}-{rep}-{wl}-", dir=root)
                    t = time.monotonic()
                    if row.system == "slurm":
                        r = slurm_run(wl, jobs, Path(tmp))
                    else:
                        r = asyncio.run(gpuorch_run(row, wl, jobs, Path(tmp), f"{rep}-{wl}", profile, show_timeline))
                    r["load"] = os.getloadavg()[0]
                    prof = r.pop("profile", None)
                    if prof:
                        print(f"\n=== cProfile of `gpuorch up`, {row.name} {wl} run {rep + 1} ===\n{prof}",
                              file=sys.stderr)
                    log(f"{row.name} {wl} run {rep + 1}/{repeats}: {r['submitted_per_s']:.0f} submitted/s, "
                        f"{r['finished_per_s']:.1f} finished/s, start p50/p99 {r['start_p50_s']:.2f}/"
                        f"{r['start_p99_s']:.2f} s ({time.monotonic() - t:.0f} s, load {r['load']:.1f})")
                    out["rows"].setdefault(row.name, {"describe": row.describe(), "runs": {}})["runs"] \
                        .setdefault(wl, []).append(r)
                    if partial is not None:
                        partial.write_text(json.dumps({**out, "partial": True}, indent=2))
    for name, row in out["rows"].items():
        row["median"] = {wl: median_of(runs) for wl, runs in row["runs"].items()}
    out["load_after"] = os.getloadavg()
    out["targets"], out["anchor"] = TARGETS, ANCHOR
    return out


def show(out: dict) -> None:
    print(f"e2e: {out['jobs']} jobs per run, {out['submitters']} parallel submitters, medians of {out['repeats']} "
          f"runs, {out['cores']} cores (this process's CPU affinity), load {out['load_before'][0]:.1f} before / "
          f"{out['load_after'][0]:.1f} after; run files (TMPDIR) on {out.get('files_on', '?')}")
    print("| row | scheduler | workload | submitted/s | finished/s | submit->placed p50 / p99 s | "
          "submit->start p50 / p99 s |")
    print("|---|---|---|---|---|---|---|")
    for name, row in out["rows"].items():
        for wl, m in row["median"].items():
            print(f"| {name} | {row['describe']} | {wl} | {m['submitted_per_s']:.0f} | {m['finished_per_s']:.1f} | "
                  f"{m['placed_p50_s']:.2f} / {m['placed_p99_s']:.2f} | {m['start_p50_s']:.2f} / "
                  f"{m['start_p99_s']:.2f} |")
    print()
    failed = [(name, wl, i, why, n) for name, row in out["rows"].items() for wl, runs in row.get("runs", {}).items()
              for i, run in enumerate(runs) for why, n in run.get("not_succeeded", {}).items()]
    for name, wl, i, why, n in failed:
        print(f"NOT SUCCEEDED: {name} {wl} run {i + 1}: {n} job(s) {why}")
    print("every gpuorch job succeeded" if not failed else f"{sum(f[4] for f in failed)} gpuorch job(s) did not succeed")
    print()
    print("Stages, median over jobs (p50 / p99 ms), median of the runs:")
    for name, row in out["rows"].items():
        for wl, m in row["median"].items():
            cells = ", ".join(f"{k} {v['p50_ms']:.0f}/{v['p99_ms']:.0f}" for k, v in m["stages"].items())
            extra = f"; {m['events_per_job']:.1f} events per job" if "events_per_job" in m else ""
            print(f"  {name} {wl}: {cells}{extra}")
    print()
    print("CPU seconds of each kind of process from the first submission to the last job's end (median of the runs):")
    for name, row in out["rows"].items():
        for wl, m in row["median"].items():
            if "cpu_s" in m:
                cells = ", ".join(f"{k} {v:.1f}" for k, v in sorted(m["cpu_s"].items(), key=lambda kv: -kv[1]) if v)
                print(f"  {name} {wl} ({m['wall_s']:.0f} s wall): {cells}")
    g16 = [m["finished_per_s"] for n, r in out["rows"].items() if "16x8" in n for m in r["median"].values()]
    slurm = out["rows"].get("slurm-1x8", {}).get("median", {})
    if g16:
        best = max(g16)
        print(f"\ntarget: >= {TARGETS['finished_per_s_16_nodes']} finished/s on 16 nodes: best {best:.1f} -> "
              f"{'met' if best >= TARGETS['finished_per_s_16_nodes'] else 'NOT met'}")
    for wl, m in slurm.items():
        for name, row in out["rows"].items():
            if name != "slurm-1x8" and wl in row["median"]:
                g = row["median"][wl]["finished_per_s"]
                print(f"  {wl}: {name} finished/s {g:.1f} vs Slurm {m['finished_per_s']:.1f} = "
                      f"{g / m['finished_per_s']:.2f}x")


async def idle_cpu(nodes: int, seconds: float, settle: float = 10.0) -> dict[str, float]:
    """% of one core that each kind of process of an idle one-process stack of ``nodes`` nodes spends: what
    simulating the nodes on one machine costs the rows before any job (heartbeats, telemetry, XID watches)."""
    with tempfile.TemporaryDirectory(prefix="e2e-idle-") as tmp:
        stack = Stack(Path(tmp) / "data", f"dgx-h100:{nodes}", split=False)
        stack.start()
        try:
            await stack.until_ready(240)
            await asyncio.sleep(settle)
            before, t = stack_cpu(stack), time.monotonic()
            await asyncio.sleep(seconds)
            after, dt = stack_cpu(stack), time.monotonic() - t
        finally:
            stack.stop()
    return {k: 100 * (v - before.get(k, 0.0)) / dt for k, v in after.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=("gpuorch", "slurm"))
    ap.add_argument("--rows", help="comma-separated: " + ",".join(r.name for r in ROWS))
    ap.add_argument("--workloads", default="1gpu,mix")
    ap.add_argument("--profile", action="store_true", help="cProfile the one-process stacks (to stderr)")
    ap.add_argument("--timeline", action="store_true",
                    help="print (to stderr) CPU busy and jobs placed/started/exited/succeeded per quarter second")
    ap.add_argument("--json", nargs="?", const="-", help="print (or write to this file) the figures as JSON")
    ap.add_argument("--idle", type=float, metavar="SECONDS",
                    help="only: the CPU of an idle 16-node stack over SECONDS (after 10 s of settling)")
    args = ap.parse_args()
    if args.idle:
        cpu = asyncio.run(idle_cpu(16, args.idle))
        print(f"idle stack, dgx-h100:16, {args.idle:g} s: " + ", ".join(f"{k} {v:.1f} %" for k, v in cpu.items())
              + " of one core")
        return
    rows = [r for r in ROWS if (not args.only or r.system == args.only)
            and (not args.rows or r.name in args.rows.split(","))]
    if not rows:
        ap.error("no row selected")

    def interrupted(signum, frame):  # SIGTERM as Ctrl-C: unwind through every finally (stop the stacks)
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupted)
    partial = Path(args.json) if args.json and args.json != "-" else None
    out = run_all(rows, args.workloads.split(","), args.jobs, args.repeats, args.profile, args.timeline, partial)
    if args.json == "-":
        print(json.dumps(out, indent=2))
    else:
        show(out)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
