"""Compose the services: all in one process (default), one process each (--split), or one alone.

The one-process stack mounts every router on one FastAPI app. The split stack runs
each service as ``python -m services.<name>`` on its own port and a gateway on the
main port that serves the history API and forwards every other path to its owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import typer
from fastapi import Request, Response  # module level: the gateway's handlers are annotated with them

from shared.api_events import events_router
from shared.eventlog import EventLog
from shared.natsd import NatsServer, free_port, port_open
from shared.runtime import Metrics, Service, StopSignals, build_app, http_server, run_process, serve_until_signal
from shared.settings import Settings
from shared.telemetry import setup_logging, setup_tracing

log = logging.getLogger("gpuorch.stack")

SERVICES = ("inventory", "scheduler", "quota", "autoscaler", "health")

# path prefix -> owning service, for the split gateway (longest prefix first)
ROUTES: list[tuple[str, str]] = [
    ("/v1/jobs", "scheduler"),
    ("/v1/queues", "quota"),
    ("/v1/usage", "quota"),
    ("/v1/pools", "autoscaler"),
    ("/v1/deployments", "autoscaler"),
    ("/v1/nodes", "inventory"),
]
NODE_ACTIONS = ("/cordon", "/drain", "/resume")


def owner(path: str) -> str | None:
    if path.startswith("/v1/nodes/") and path.endswith(NODE_ACTIONS):
        return "health"
    for prefix, name in ROUTES:
        if path == prefix or path.startswith(prefix + "/"):
            return name
    return None


def build_service(name: str, settings: Settings, metrics: Metrics | None = None) -> Service:
    if name not in SERVICES:
        raise typer.BadParameter(f"unknown service {name!r}; one of {', '.join(SERVICES)}")
    module = importlib.import_module(f"services.{name}.service")
    return module.build(settings, metrics)


@contextlib.contextmanager
def data_dir_lock(data_dir: Path) -> Iterator[None]:
    """One stack per data dir: a second `gpuorch up` on it gets a clear error, not a corrupted store."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fh = open(data_dir / "stack.lock", "w")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(f"error: another gpuorch stack is running on {data_dir} (see {data_dir / 'stack.json'})") from None
    try:
        yield
    finally:
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()


@contextlib.contextmanager
def embedded_nats(settings: Settings) -> Iterator[NatsServer | None]:
    """The embedded nats-server on the data dir, or None when a NATS URL is configured."""
    if settings.nats_url:
        yield None
        return
    server = NatsServer(settings.data_dir / "nats", sync_always=settings.sync_always).start()
    try:
        yield server
    finally:
        server.stop()


def write_stack_file(settings: Settings, nats_url: str, split: bool, nats_pid: int | None) -> None:
    info = {"pid": os.getpid(), "nats_url": nats_url, "nats_pid": nats_pid,
            "api": f"http://{settings.host}:{settings.port}", "split": split}
    (settings.data_dir / "stack.json").write_text(json.dumps(info, indent=2))


async def _serve_one_process(settings: Settings, nats_url: str, names: tuple[str, ...]) -> None:
    signals = StopSignals()  # a Ctrl-C while starting is kept, not lost
    evlog = await EventLog.connect(nats_url, replicas=settings.replicas, name="gpuorch-stack")
    metrics = Metrics()
    services = [build_service(n, settings, metrics) for n in names]

    def started() -> None:
        log.info("event=stack_up api=http://%s:%d nats=%s services=%s", settings.host, settings.port, nats_url, ",".join(names))

    try:
        await run_process(services, evlog, settings.host, settings.port, [events_router(lambda: evlog)], started, signals)
    finally:
        await evlog.close()


def up(settings: Settings, split: bool = False) -> None:
    """`gpuorch up`: the whole stack until Ctrl-C; a second run on the same data dir resumes its state."""
    setup_logging(settings.log_level)
    setup_tracing("gpuorch")
    if port_open(settings.port, settings.host):
        raise SystemExit(f"error: port {settings.port} is in use; pick another with --port")
    with data_dir_lock(settings.data_dir):
        stop_stale_nats(settings.data_dir)
        _up_locked(settings, split)


def stop_stale_nats(data_dir: Path) -> None:
    """A stack killed with SIGKILL leaves its nats-server and simulated agents (their own sessions)
    behind, the server holding the store: stop them before starting again."""
    try:
        info = json.loads((data_dir / "stack.json").read_text())
    except (OSError, ValueError):
        return
    for pid in [info.get("nats_pid"), *info.get("agent_pids", [])]:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace") if pid else ""
        except OSError:
            continue
        if str(data_dir) in cmdline or str(data_dir.resolve()) in cmdline:
            log.warning("event=stale_process_stopped pid=%s data_dir=%s", pid, data_dir)
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                if not Path(f"/proc/{pid}").exists():
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)


def _up_locked(settings: Settings, split: bool) -> None:
    with embedded_nats(settings) as server:
        nats_url = server.url if server else settings.nats_url or ""
        write_stack_file(settings, nats_url, split, server.proc.pid if server and server.proc else None)
        agents = spawn_agents(settings, nats_url, parse_nodes(settings.nodes))
        info = json.loads((settings.data_dir / "stack.json").read_text())
        (settings.data_dir / "stack.json").write_text(json.dumps({**info, "agent_pids": [a.pid for a in agents]}, indent=2))
        try:
            if split:
                _run_split(settings, nats_url)
            else:
                asyncio.run(_serve_one_process(settings, nats_url, SERVICES))
        finally:
            stop_processes(agents)
        log.info("event=stack_stopped data_dir=%s", settings.data_dir)


# --- simulated nodes ----------------------------------------------------------------


def parse_nodes(spec: str) -> list[tuple[str, int]]:
    """`dgx-h100:2,l4-8x:1` -> [("dgx-h100", 2), ("l4-8x", 1)]; raises SystemExit with the reason."""
    from shared.profiles import PROFILES

    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        profile, _, count = item.partition(":")
        if profile not in PROFILES:
            raise SystemExit(f"error: unknown node profile {profile!r} in --nodes; known: {', '.join(PROFILES)}")
        if count and not count.isdigit():
            raise SystemExit(f"error: --nodes takes profile:count, got {item!r}")
        out.append((profile, int(count or 1)))
    return out


def spawn_agents(settings: Settings, nats_url: str, nodes: list[tuple[str, int]]) -> list[subprocess.Popen]:
    """One `gpuorch agent --backend simulated` process per simulated node: real processes run the tasks."""
    procs, i = [], 0
    logs = settings.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for profile, count in nodes:
        for k in range(count):
            node_id = f"{profile}-{k}"
            port = free_port()
            cmd = [sys.executable, "-m", "services.cli", "agent", "--backend", "simulated", "--profile", profile,
                   "--node-id", node_id, "--nats", nats_url, "--port", str(port), "--host", settings.host,
                   "--work-dir", str(settings.data_dir / "agents" / node_id), "--rack", f"r{i // 4}", "--zone", "z0",
                   "--kill-tasks-on-exit"]
            procs.append(subprocess.Popen(cmd, stdout=open(logs / f"agent-{node_id}.log", "ab"), stderr=subprocess.STDOUT,
                                          start_new_session=True))
            i += 1
    if procs:
        log.info("event=agents_started nodes=%d", len(procs))
    return procs


# --- split mode ---------------------------------------------------------------------


def spawn_service(name: str, nats_url: str, port: int, settings: Settings, log_dir: Path) -> subprocess.Popen:
    log_dir.mkdir(parents=True, exist_ok=True)
    out = open(log_dir / f"{name}.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", f"services.{name}", "--nats", nats_url, "--port", str(port), "--host", settings.host,
         "--snapshot-every", str(settings.snapshot_every)],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _run_split(settings: Settings, nats_url: str) -> None:
    ports = {name: free_port() for name in SERVICES}
    procs = {name: spawn_service(name, nats_url, ports[name], settings, settings.data_dir / "logs") for name in SERVICES}
    (settings.data_dir / "split.json").write_text(
        json.dumps({n: {"port": ports[n], "pid": p.pid} for n, p in procs.items()}, indent=2)
    )
    try:
        upstreams = {name: f"http://{settings.host}:{port}" for name, port in ports.items()}
        asyncio.run(serve_gateway(settings, nats_url, upstreams, _supervise(settings, nats_url, ports, procs)))
    finally:
        stop_processes(procs.values())


async def _supervise(settings: Settings, nats_url: str, ports: dict[str, int], procs: dict[str, subprocess.Popen]) -> None:
    """Restart a service process that died (crash, OOM kill, SIGKILL): it rebuilds its state from the log."""
    while True:
        await asyncio.sleep(0.5)
        for name, proc in list(procs.items()):
            if proc.poll() is not None:
                log.warning("event=service_died service=%s pid=%d code=%s action=restart", name, proc.pid, proc.returncode)
                procs[name] = spawn_service(name, nats_url, ports[name], settings, settings.data_dir / "logs")
                (settings.data_dir / "split.json").write_text(
                    json.dumps({n: {"port": ports[n], "pid": p.pid} for n, p in procs.items()}, indent=2)
                )


def stop_processes(procs: Any, timeout: float = 10.0) -> None:
    procs = [p for p in procs if p.poll() is None]
    for p in procs:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def serve_gateway(
    settings: Settings, nats_url: str, upstreams: dict[str, str], background: Coroutine[Any, Any, None] | None = None
) -> None:
    """The API on one port: the history API served here, every other path forwarded to its service."""
    import httpx

    signals = StopSignals()
    evlog = await EventLog.connect(nats_url, replicas=settings.replicas, name="gpuorch-gateway")
    app = build_app([], [events_router(lambda: evlog)])
    client = httpx.AsyncClient(timeout=30)

    @app.get("/v1/services", tags=["ops"])
    async def services_status() -> list[dict[str, Any]]:
        out = []
        for name, base in upstreams.items():
            try:
                out.extend((await client.get(f"{base}/v1/services")).json())
            except (httpx.HTTPError, ValueError) as e:
                out.append({"service": name, "ready": False, "error": repr(e)})
        return out

    @app.get("/readyz", tags=["ops"])
    async def readyz(response: Response) -> dict[str, Any]:
        status = {s["service"]: bool(s.get("ready")) for s in await services_status()}
        response.status_code = 200 if all(status.values()) else 503
        return {"ready": all(status.values()), "services": status}

    @app.api_route("/v1/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False)
    async def forward(rest: str, request: Request) -> Response:
        name = owner(request.url.path)
        if name is None:
            return Response(json.dumps({"detail": f"no route for {request.url.path}"}), 404, media_type="application/json")
        url = f"{upstreams[name]}{request.url.path}"
        try:
            resp = await client.request(
                request.method, url, params=request.query_params, content=await request.body(),
                headers={k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept", "traceparent")},
            )
        except httpx.HTTPError as e:
            return Response(json.dumps({"detail": f"service {name} unavailable: {e!r}"}), 503, media_type="application/json")
        return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))

    server = http_server(app, settings.host, settings.port)
    log.info("event=gateway_up api=http://%s:%d services=%s", settings.host, settings.port, upstreams)
    task = asyncio.create_task(background) if background is not None else None
    try:
        await serve_until_signal(server, signals)
    finally:
        if task is not None:
            task.cancel()
        await client.aclose()
        await evlog.close()


# --- one service alone ----------------------------------------------------------------


def main_one(name: str) -> None:
    """Entry point of `python -m services.<name>`."""
    app = typer.Typer(add_completion=False)

    @app.command()
    def run(
        nats: str = typer.Option(os.environ.get("GPUORCH_NATS_URL", "nats://127.0.0.1:4222"), help="NATS URL"),
        port: int = typer.Option(8080, help="HTTP port of this service"),
        host: str = typer.Option("127.0.0.1"),
        snapshot_every: int = typer.Option(10_000, help="snapshot the projection every N events"),
        replicas: int = typer.Option(1, help="stream replicas (3 in a JetStream cluster)"),
    ) -> None:
        settings = Settings(nats_url=nats, port=port, host=host, snapshot_every=snapshot_every, replicas=replicas)
        setup_logging(settings.log_level)
        setup_tracing(f"gpuorch-{name}")
        asyncio.run(_serve_alone(name, settings))

    app()


async def _serve_alone(name: str, settings: Settings) -> None:
    signals = StopSignals()
    evlog = await EventLog.connect(settings.nats_url or "", replicas=settings.replicas, name=f"gpuorch-{name}")
    try:
        await run_process([build_service(name, settings)], evlog, settings.host, settings.port, signals=signals)
    finally:
        await evlog.close()


def wait_http(url: str, timeout: float = 15.0, ok: Callable[[int], bool] = lambda c: c == 200) -> bool:
    """Poll an HTTP URL until it answers as wanted or the deadline passes."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ok(httpx.get(url, timeout=1).status_code):
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False
