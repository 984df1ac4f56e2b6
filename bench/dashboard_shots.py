"""The dashboard at 1,000 simulated nodes (8,000 GPUs): screenshots of each page, and each page's first paint.

    .venv/bin/python -m bench.dashboard_shots [--nodes 1000] [--jobs 2500] [--out docs/screenshots]

The log is written first, as an hour of a busy cluster would have written it: the nodes register (their
``node.registered`` events, as their agents send them; no agent process runs), the queue tree is defined, and
users' jobs (gangs, whole GPUs, fractions, MIG slices) are submitted, placed first-fit and started one after
another, a fifth of them ending since. Then every service starts in this process and replays it, with the API
and the dashboard on a free port; a job waits at its queue's limit and a 48-GPU gang waits for room, four GPUs
report XID 79, two nodes are cordoned, and every node publishes a telemetry sample every 10 s. Debian's
chromium (driven by Playwright) logs in and opens each page a few times: the screenshots go to ``--out``, and
the median first-contentful-paint of each page (the browser's own figure) and the time until the whole page
was parsed are printed, with the machine's load average (the stack shares the machine with the browser).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from shared import events as ev
from shared.cluster import agent_source
from shared.eventlog import EventLog
from shared.events import Envelope
from shared.natsd import NatsServer, free_port
from shared.model import JobSpec, QueueSpec
from shared.profiles import build as build_node
from datetime import UTC, datetime
from shared.events import GpuShare, TaskPlacement

KINDS = (("dgx-h100", 0.55), ("hgx-a100-40gb", 0.25), ("l4-8x", 0.2))
ROUNDS = 3


T0 = time.monotonic()


def say(what: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s] {what}", file=sys.stderr, flush=True)


def cluster(n: int, seed: int = 7) -> list:
    """``n`` nodes of 8 GPUs, 16 to a rack, 8 racks to a zone; every 10th A100 box has MIG on two GPUs."""
    rng = random.Random(seed)
    nodes = []
    for i in range(n):
        profile = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
        mig = {0: ("3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"), 1: ("1g.5gb",) * 7} \
            if profile == "hgx-a100-40gb" and i % 10 == 0 else None
        nodes.append(build_node(profile, f"n{i:04d}", rack=f"r{i // 16:02d}", zone=f"z{i // 128}", mig=mig))
    return nodes


SHAPES = (  # (what a job asks, how often)
    ({"tasks": 2, "resources": {"gpus": 4}, "topology": "node"}, 0.08),
    ({"tasks": 4, "resources": {"gpus": 8}, "topology": "rack", "gpu": {"models": ["H100-80GB"]}}, 0.04),
    ({"resources": {"gpus": 8}}, 0.18),
    ({"resources": {"gpus": 4}}, 0.16),
    ({"resources": {"gpus": 2}}, 0.14),
    ({"resources": {"gpus": 1}}, 0.2),
    ({"resources": {"gpus": 0.5}}, 0.1),
    ({"resources": {"gpus": 0.25}}, 0.05),
    ({"resources": {"gpus": 1}, "gpu": {"mig": "1g.5gb"}}, 0.05),
)
QUEUES = {
    "research": {"guaranteed": {"gpus": 3000}, "weight": 2},
    "research.nlp": {"guaranteed": {"gpus": 2000}, "groups": ["nlp"]},
    "research.vision": {"guaranteed": {"gpus": 1000}, "groups": ["vision"]},
    "prod": {"guaranteed": {"gpus": 4000}, "limit": {"gpus": 6000}},
    "prod.inference": {"guaranteed": {"gpus": 3000}},
    "prod.batch": {"guaranteed": {"gpus": 1000}},
    "scratch": {"limit": {"gpus": 8}},
}
OWNERS = {"research.nlp": ("alice", "carol"), "research.vision": ("bob", "carol"), "prod.inference": ("svc-infer",),
          "prod.batch": ("svc-batch", "dave")}


class Allocator:
    """First fit over the nodes in a random order: whole GPUs, shares of one GPU, MIG slices, gangs on one node
    or one rack. What a scheduler could have placed; the real one places what is submitted later."""

    def __init__(self, nodes: list, rng: random.Random) -> None:
        self.nodes, self.rng = nodes, rng
        self.free = {n.node_id: {g.uuid: 1000 for g in n.gpus if not g.mig_slices} for n in nodes}
        self.slices = {n.node_id: [m for g in n.gpus for m in g.mig_slices] for n in nodes}
        self.model = {n.node_id: n.gpus[0].model for n in nodes}

    def whole(self, node_id: str, k: int, model: str | None) -> list[str] | None:
        if model and self.model[node_id] != model:
            return None
        free = [u for u, m in self.free[node_id].items() if m == 1000]
        return free[:k] if len(free) >= k else None

    def take(self, node_id: str, uuids: list[str], milli: int = 1000) -> tuple[GpuShare, ...]:
        for u in uuids:
            self.free[node_id][u] -= milli
        return tuple(GpuShare(uuid=u, milli=milli) for u in uuids)

    def place(self, spec: JobSpec) -> tuple[TaskPlacement, ...] | None:
        order = self.rng.sample(self.nodes, len(self.nodes))
        gpus, model = spec.resources.gpus, (spec.gpu.models or (None,))[0]
        if spec.gpu.mig:
            for n in order:
                free = [m for m in self.slices[n.node_id] if m.profile == spec.gpu.mig]
                if free:
                    self.slices[n.node_id].remove(free[0])
                    return (TaskPlacement(task=0, node_id=n.node_id,
                                          gpus=(GpuShare(uuid=free[0].uuid, mig_profile=free[0].profile),)),)
            return None
        if gpus < 1:
            milli = int(gpus * 1000)
            for partial in (True, False):  # fill a shared GPU first
                for n in order:
                    for u, m in self.free[n.node_id].items():
                        if m >= milli and (m < 1000) == partial:
                            return (TaskPlacement(task=0, node_id=n.node_id, gpus=self.take(n.node_id, [u], milli)),)
            return None
        k = int(gpus)
        if spec.topology == "node":
            for n in order:
                if got := self.whole(n.node_id, k * spec.tasks, model):
                    return tuple(TaskPlacement(task=t, node_id=n.node_id, gpus=self.take(n.node_id, got[t * k:(t + 1) * k]))
                                 for t in range(spec.tasks))
            return None
        if spec.topology == "rack":
            racks: dict[str, list] = {}
            for n in order:
                if self.whole(n.node_id, k, model):
                    racks.setdefault(n.rack, []).append(n)
            rack = next((r for r in racks.values() if len(r) >= spec.tasks), None)
            if rack is None:
                return None
            return tuple(TaskPlacement(task=t, node_id=n.node_id, gpus=self.take(n.node_id, self.whole(n.node_id, k, model)))
                         for t, n in enumerate(rack[:spec.tasks]))
        for n in order:
            if got := self.whole(n.node_id, k, model):
                return (TaskPlacement(task=0, node_id=n.node_id, gpus=self.take(n.node_id, got)),)
        return None


def history(nodes: list, n_jobs: int, now: float, seed: int = 5) -> list[Envelope]:
    """The log of the last hour: the nodes register, the queues are defined, jobs are submitted, placed and
    started one after another (a fifth of them have ended since); in time order, as it would have been written."""
    rng = random.Random(seed)
    t0 = now - 3600
    at: list[tuple[float, Envelope]] = []

    def put(t: float, data: ev.Event, id: str, source: str = "/gpuorch/bench") -> None:
        at.append((t, Envelope(data, id=id, source=source, time=datetime.fromtimestamp(t, UTC))))

    for n in nodes:
        put(t0 - 120, ev.NodeRegistered(node_id=n.node_id, node=n), f"reg-{n.node_id}", agent_source(n.node_id))
    for path, body in QUEUES.items():
        put(t0 - 60, ev.QueueDefined(path=path, spec=QueueSpec.model_validate(body)), f"queue-{path}")
    alloc = Allocator(nodes, rng)
    for i in range(n_jobs):
        shape = rng.choices([s for s, _ in SHAPES], [w for _, w in SHAPES])[0]
        queue = rng.choice([q for q in OWNERS if q != "scratch"])
        spec = JobSpec.model_validate({"name": f"{rng.choice(['llama', 'vit', 'bert', 'sdxl', 'whisper'])}-{i}",
                                       "queue": queue, "command": ["sleep", "3600"],
                                       "time_limit_s": rng.choice([14400, 28800, 86400]), **shape})
        placements = alloc.place(spec)
        if placements is None:
            continue
        job = f"j-bench-{i:05d}"
        t = t0 + 3300 * i / n_jobs + rng.random()
        put(t, ev.JobSubmitted(job_id=job, spec=spec, owner=rng.choice(OWNERS[queue]), submitted_at=t), f"{job}-s")
        put(t + 0.1, ev.JobQueued(job_id=job), f"{job}-q")
        put(t + 1, ev.JobPlaced(job_id=job, placements=placements, policy="bench"), f"{job}-p")
        for p in placements:
            put(t + 2, ev.JobTaskStarted(job_id=job, task=p.task, node_id=p.node_id), f"{job}-st{p.task}",
                agent_source(p.node_id))
        end = t + rng.uniform(600, 2400)
        if rng.random() < 0.2 and end < now - 30:
            for p in placements:
                put(end, ev.JobTaskExited(job_id=job, task=p.task, node_id=p.node_id, code=0), f"{job}-x{p.task}",
                    agent_source(p.node_id))
            put(end + 0.1, ev.JobSucceeded(job_id=job), f"{job}-ok")
    return [env for _, env in sorted(at, key=lambda te: te[0])]


async def submit(api: httpx.AsyncClient, body: dict) -> str:
    """The new job's id; a busy stack may answer 503 once the job is recorded (it says which)."""
    r = await api.post("/v1/jobs", json=body)
    if r.status_code == 503 and (m := re.search(r"job (j-[a-z0-9-]+) is recorded", r.text)):
        return m.group(1)
    assert r.status_code == 201, r.text[:300]
    return r.json()["id"]


async def serve(nats_url: str, data_dir: Path, port: int, n_nodes: int, n_jobs: int, ready: asyncio.Event,
                stop: asyncio.Event) -> dict:
    from services.dashboard import dashboard_router
    from services.stack import SERVICES, admin_token_path, api_auth, build_service
    from shared.api_events import events_router
    from shared.api_tokens import tokens_router
    from shared.runtime import Metrics, build_app, http_server
    from shared.settings import Settings

    evlog = await EventLog.connect(nats_url)
    nodes = cluster(n_nodes)
    say("writing the last hour's log")
    log_ = history(nodes, n_jobs, time.time())
    for k in range(0, len(log_), 500):
        await evlog.append_many(log_[k:k + 500])
    say(f"{len(log_)} events written")

    async def telemetry() -> None:
        """One sample per node every 10 s, as the agents would publish them (they do every second)."""
        rng = random.Random(11)
        while True:
            for n in nodes:
                hot = n.node_id in ("n0042", "n0666")
                sample = {"node_id": n.node_id, "t": time.time(), "gpus": [
                    {"uuid": g.uuid, "index": g.index, "gpu_util_pct": rng.randint(20, 100),
                     "temperature_c": rng.randint(86, 91) if hot else rng.randint(38, 80)} for g in n.gpus]}
                await evlog.nc.publish(f"gpuorch.telemetry.{n.node_id}", json.dumps(sample).encode())
            await asyncio.sleep(10)

    sampler = asyncio.create_task(telemetry())
    settings = Settings(data_dir=data_dir, heartbeat_timeout_s=1e9)
    metrics = Metrics()
    services = [build_service(name, settings, metrics) for name in SERVICES]
    auth = await api_auth(settings, evlog, bootstrap=True)
    app = build_app(services, [events_router(lambda: evlog), tokens_router(lambda: evlog),
                               dashboard_router(lambda: evlog)], auth=auth)
    tasks = [asyncio.create_task(s.run(evlog)) for s in services]
    server = http_server(app, "127.0.0.1", port)
    web = asyncio.create_task(server.serve())
    admin = admin_token_path(data_dir).read_text().strip()
    base = f"http://127.0.0.1:{port}"
    try:
        await asyncio.wait_for(asyncio.gather(*(s.ready.wait() for s in services)), 120)
        say("services ready")
        async with httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {admin}"}, timeout=120) as api:
            while (await api.get("/readyz")).status_code != 200:
                await asyncio.sleep(0.2)
            for name in ("scratch-first", "scratch-second"):  # the second waits for the queue's limit
                waiting = await submit(api, {"name": name, "resources": {"gpus": 8}, "queue": "scratch",
                                             "command": ["sleep", "3600"]})
            big = await submit(api, {"name": "h100-x48", "tasks": 6, "resources": {"gpus": 8}, "topology": "rack",
                                     "gpu": {"models": ["H100-80GB"]}, "queue": "prod.batch",
                                     "command": ["sleep", "3600"]})
            inventory = next(s for s in services if s.name == "inventory")
            sick = [nodes[i] for i in (3, 170, 421, 777)]
            await evlog.append_many([Envelope(ev.GpuUnhealthy(node_id=n.node_id, gpu_uuid=n.gpus[2].uuid, kind="xid",
                                                              xid=79, detail="GPU has fallen off the bus"),
                                              source="/gpuorch/health") for n in sick])
            for n in (nodes[5], nodes[300]):
                await api.post(f"/v1/nodes/{n.node_id}/cordon", json={"reason": "maintenance"})
            placed, t0 = -1, time.monotonic()
            while time.monotonic() - t0 < 120:  # until the scheduler stops placing
                await asyncio.sleep(3)
                now = sum(len(n.gpu_alloc) for n in inventory.projection.nodes.values())
                if now == placed:
                    break
                placed = now
            states = {j: (await api.get(f"/v1/jobs/{j}")).json()["state"] for j in (waiting, big)}
            waiting = next((j for j, st in states.items() if st == "queued"), waiting)
            info = {"base": base, "admin": admin, "waiting": waiting, "gpus": sum(len(n.gpus) for n in nodes),
                    "nodes": len(nodes), "busy_gpus": placed}
            await api.get("/")  # a stack that has served the dashboard before: its telemetry read is warm
            await asyncio.sleep(2)
        say(f"settled: {placed} GPUs held")
        ready.info = info  # type: ignore[attr-defined]
        ready.set()
        await stop.wait()
        return info
    finally:
        sampler.cancel()
        server.should_exit = True
        await asyncio.gather(web, sampler, return_exceptions=True)
        for s in services:
            s.stop()
        await asyncio.wait(tasks, timeout=20)
        await evlog.close()


def shoot(info: dict, out: Path, chromium: str) -> dict[str, tuple[float, float]]:
    from playwright.sync_api import sync_playwright

    base = info["base"]
    paints: dict[str, tuple[float, float]] = {}
    done = "() => performance.getEntriesByType('navigation')[0].domContentLoadedEventEnd"
    fcp = ("() => new Promise(done => { const e = performance.getEntriesByName('first-contentful-paint')[0];"
           " if (e) return done(e.startTime); new PerformanceObserver(l => done(l.getEntries()[0].startTime))"
           ".observe({type: 'paint', buffered: true}); setTimeout(() => done(-1), 5000); })")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-dev-shm-usage"])
        context = browser.new_context(viewport={"width": 1600, "height": 1000}, device_scale_factor=1)
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(f"{base}/ui/login")
        page.fill("input[name=token]", info["admin"])
        page.click("button:has-text('Log in')")
        page.wait_for_load_state("load")
        first_job = page.evaluate("() => 0")
        urls = {"cluster": "/", "cluster-filtered": "/?model=A100-SXM4-40GB&state=mig", "queues": "/ui/queues",
                "jobs": "/ui/jobs", "job": f"/ui/jobs/{info['waiting']}", "events": "/ui/events"}
        for name, path in urls.items():
            runs = []
            for _ in range(ROUNDS):  # the median of a few: the stack shares this machine with the browser
                page.goto(f"{base}{path}", wait_until="load")
                runs.append((page.evaluate(fcp), page.evaluate(done)))
            paints[name] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
            if name == "jobs":
                first_job = page.locator("table.jobs tbody tr.st-running a").first.get_attribute("href")
            page.wait_for_timeout(300)
            page.screenshot(path=str(out / f"{name}.png"))
        if first_job:
            page.goto(f"{base}{first_job}", wait_until="load")
            paints["job-running"] = (page.evaluate(fcp), page.evaluate(done))
            page.screenshot(path=str(out / "job-running.png"))
        page.goto(f"{base}/?state=unhealthy", wait_until="load")
        page.locator("i.s-unhealthy").first.hover()
        page.wait_for_timeout(1200)  # the native tooltip is not in a screenshot; the row is
        page.screenshot(path=str(out / "cluster-unhealthy.png"))
        browser.close()
    return paints


def measure(n_nodes: int, n_jobs: int, out: Path, chromium: str) -> tuple[dict, dict[str, tuple[float, float]]]:
    """Build the cluster on a nats-server of its own, take the screenshots into ``out``; the cluster's figures and
    each page's (first paint, whole page parsed) in ms."""
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpuorch-shots-"))
    nats = NatsServer(work / "nats").start()
    try:
        async def run() -> tuple[dict, dict[str, tuple[float, float]]]:
            ready, stop = asyncio.Event(), asyncio.Event()
            stack = asyncio.create_task(serve(nats.url, work / "data", free_port(), n_nodes, n_jobs, ready, stop))
            waiter = asyncio.create_task(ready.wait())
            await asyncio.wait([stack, waiter], return_when=asyncio.FIRST_COMPLETED)
            if stack.done():
                stack.result()
            info = ready.info  # type: ignore[attr-defined]
            try:
                paints = await asyncio.to_thread(shoot, info, out, chromium)
            finally:
                stop.set()
                with contextlib.suppress(Exception):
                    await stack
            return info, paints

        return asyncio.run(run())
    finally:
        nats.stop()
        shutil.rmtree(work, ignore_errors=True)


def report(info: dict, paints: dict[str, tuple[float, float]]) -> str:
    lines = [f"{info['nodes']} nodes, {info['gpus']} GPUs, {info['busy_gpus']} GPUs held",
             f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; median of {ROUNDS} visits each",
             "page                first paint   whole page parsed   (ms from navigation)"]
    lines += [f"  {name:18s} {fcp:9.0f} {dcl:17.0f}" for name, (fcp, dcl) in paints.items()]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=2500, help="jobs tried in the last hour's log (those that fit run)")
    ap.add_argument("--out", type=Path, default=Path("docs/screenshots"))
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("error: needs Debian's chromium (apt-get install chromium)")
    info, paints = measure(args.nodes, args.jobs, args.out, chromium)
    print(report(info, paints))
    print(f"screenshots in {args.out}/")


if __name__ == "__main__":
    main()
