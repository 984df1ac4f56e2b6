"""The dashboard at 1,000 simulated nodes (8,000 GPUs): screenshots of each page, and each page's first paint.

    .venv/bin/python -m bench.dashboard_shots [--nodes 1000] [--out docs/screenshots] [--jobs 1500]

Every service runs in this process against its own nats-server; the nodes register through the log (their
``node.registered`` events, as their agents would send them) and report one telemetry sample each, so no agent
process runs. Users submit a mix of jobs (gangs, whole GPUs, fractions, MIG slices, some too large to fit
now) to a queue tree; a few GPUs report an XID and two nodes are cordoned. Then Debian's chromium (driven by
Playwright) logs in and opens each page: the screenshots go to ``--out``, the first-contentful-paint of each
page (the browser's own figure, cold: no cache) is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
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
from shared.profiles import build as build_node

KINDS = (("dgx-h100", 0.55), ("hgx-a100-40gb", 0.25), ("l4-8x", 0.2))
PAGES = ("cluster", "cluster-filtered", "queues", "jobs", "job", "events")


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


def workload(rng: random.Random, n: int) -> list[dict]:
    """Job requests, most of which fit: gangs on one node, whole GPUs, fractions, MIG slices; a few never fit now."""
    queues = ("research.nlp", "research.vision", "prod.inference", "prod.batch")
    shapes = (
        ({"tasks": 2, "resources": {"gpus": 4}, "topology": "node"}, 0.1),
        ({"tasks": 4, "resources": {"gpus": 8}, "topology": "rack", "gpu": {"models": ["H100-80GB"]}}, 0.06),
        ({"resources": {"gpus": 8}}, 0.2),
        ({"resources": {"gpus": 4}}, 0.16),
        ({"resources": {"gpus": 2}}, 0.13),
        ({"resources": {"gpus": 1}}, 0.15),
        ({"resources": {"gpus": 0.5}}, 0.1),
        ({"resources": {"gpus": 0.25}}, 0.05),
        ({"resources": {"gpus": 1}, "gpu": {"mig": "1g.5gb"}}, 0.05),
    )
    out = []
    for i in range(n):
        shape = rng.choices([s for s, _ in shapes], [w for _, w in shapes])[0]
        out.append({"name": f"{rng.choice(['llama', 'vit', 'bert', 'sdxl', 'whisper'])}-{i}", "queue": rng.choice(queues),
                    "command": ["sleep", "3600"], "time_limit_s": rng.choice([3600, 7200, 14400]), **shape})
    return out


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
    say("registering nodes")
    for k in range(0, len(nodes), 200):
        await evlog.append_many([Envelope(ev.NodeRegistered(node_id=n.node_id, node=n), source=agent_source(n.node_id),
                                          id=f"reg-{n.node_id}") for n in nodes[k:k + 200]])
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
            for path, body in (("research", {"guaranteed": {"gpus": 3000}, "weight": 2}),
                               ("research.nlp", {"guaranteed": {"gpus": 2000}, "groups": ["nlp"]}),
                               ("research.vision", {"guaranteed": {"gpus": 1000}, "groups": ["vision"]}),
                               ("prod", {"guaranteed": {"gpus": 4000}, "limit": {"gpus": 6000}}),
                               ("prod.inference", {"guaranteed": {"gpus": 3000}}),
                               ("prod.batch", {"guaranteed": {"gpus": 1000}})):
                assert (await api.put(f"/v1/queues/{path}", json=body)).status_code == 200
            users = {}
            for user, groups in (("alice", ["nlp"]), ("bob", ["vision"]), ("carol", ["nlp", "vision"])):
                users[user] = (await api.post("/v1/tokens", json={"user": user, "groups": groups})).json()["token"]
            jobs = workload(random.Random(5), n_jobs)
            for k in range(0, len(jobs), 250):  # as the users, in batches; prod's jobs as the admin
                batch = jobs[k:k + 250]
                for user, token in users.items():
                    mine = [j for j in batch if j["queue"].startswith("research")
                            and (user == "carol" or j["queue"].endswith("nlp" if user == "alice" else "vision"))]
                    mine = mine[::3] if user == "carol" else mine
                    if mine:
                        r = await api.post("/v1/jobs", json=mine, headers={"authorization": f"Bearer {token}"})
                        assert r.status_code in (201, 429), r.text[:300]
                prod = [j for j in batch if j["queue"].startswith("prod")]
                r = await api.post("/v1/jobs", json=prod)
                assert r.status_code == 201, r.text[:300]
                say(f"batch {k // 250 + 1} submitted")
            say(f"submitted {len(jobs)} jobs")
            assert (await api.put("/v1/queues/scratch", json={"limit": {"gpus": 8}})).status_code == 200
            for name in ("scratch-first", "scratch-second"):  # the second waits for the queue's limit
                r = await api.post("/v1/jobs", json={"name": name, "resources": {"gpus": 8}, "queue": "scratch",
                                                     "command": ["sleep", "3600"]})
                assert r.status_code == 201, r.text[:300]
            waiting = r.json()["id"]
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
            info = {"base": base, "admin": admin, "waiting": waiting, "gpus": sum(len(n.gpus) for n in nodes),
                    "nodes": len(nodes), "busy_gpus": placed}
        say(f"settled: {placed} GPUs held")
            await api.get("/")  # a stack that has served the dashboard before: its telemetry read is warm
            await asyncio.sleep(2)
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
        urls = {"cluster": "/", "cluster-filtered": "/?model=A100-SXM4-40GB&rack=r00", "queues": "/ui/queues",
                "jobs": "/ui/jobs", "job": f"/ui/jobs/{info['waiting']}", "events": "/ui/events"}
        for name, path in urls.items():
            page.goto(f"{base}{path}", wait_until="load")
            paints[name] = (page.evaluate(fcp), page.evaluate(done))
            if name == "jobs":
                first_job = page.locator("table.jobs tbody tr a").first.get_attribute("href")
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=900)
    ap.add_argument("--out", type=Path, default=Path("docs/screenshots"))
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("error: needs Debian's chromium (apt-get install chromium)")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpuorch-shots-"))
    nats = NatsServer(work / "nats").start()
    try:
        async def run() -> tuple[dict, dict[str, float]]:
            ready, stop = asyncio.Event(), asyncio.Event()
            stack = asyncio.create_task(serve(nats.url, work / "data", free_port(), args.nodes, args.jobs, ready, stop))
            waiter = asyncio.create_task(ready.wait())
            await asyncio.wait([stack, waiter], return_when=asyncio.FIRST_COMPLETED)
            if stack.done():
                stack.result()
            info = ready.info  # type: ignore[attr-defined]
            try:
                paints = await asyncio.to_thread(shoot, info, args.out, chromium)
            finally:
                stop.set()
                with contextlib.suppress(Exception):
                    await stack
            return info, paints

        info, paints = asyncio.run(run())
    finally:
        nats.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{info['nodes']} nodes, {info['gpus']} GPUs, {info['busy_gpus']} GPUs held; screenshots in {args.out}/")
    print("page                first paint   whole page parsed   (ms from navigation; browser cold, stack warm)")
    for name, (fcp, dcl) in paints.items():
        print(f"  {name:18s} {fcp:9.0f} {dcl:17.0f}")


if __name__ == "__main__":
    main()
