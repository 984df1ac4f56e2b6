"""Compose the services: all in one process (default), one process each (--split), or one alone.

The one-process stack mounts every router on one FastAPI app. The split stack runs
each service as ``python -m services.<name>`` on its own port and a gateway on the
main port that serves the history API and forwards every other path to its owner.

`gpuorch up` stops in order on SIGINT/SIGTERM, caught from its first line: the
simulated nodes first (their tasks are killed and reported interrupted, so their jobs
go back to the queue while the services still run), then the services, then the
nats-server. Its nats-server and agents outlive a SIGKILL; the next `up` adopts them
(``services.stack_procs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer
from fastapi import Request, Response  # module level: the gateway's handlers are annotated with them
from prometheus_client import CONTENT_TYPE_LATEST

from services.dashboard import dashboard_router
from services.stack_procs import (AGENT_STOP_S, Child, Previous, StackFile, adopt_or_spawn_agents, agent_node,
                                  child_env, durable_of, node_ids, parse_nodes, spawn_agent, start_or_adopt_nats,
                                  stop_children, stop_stale_services, supervise_nats, wanted_agents, write_json)
from shared import aio
from shared.api_events import events_router
from shared.api_tokens import tokens_router
from shared.auth import Authenticator, authenticator_from_settings, ensure_admin_token
from shared.eventlog import AGENT_STREAM, STREAM, EventLog
from shared.metrics import merge_expositions
from shared.natsauth import Credentials
from shared.natsd import NatsServer, free_port
from shared.runtime import (STARTING, Metrics, Service, StopSignals, build_app, fold_once, http_server, listen,
                            run_process, serve_until_signal)
from shared.settings import Settings
from shared.telemetry import current_traceparent, setup_logging, setup_tracing

log = logging.getLogger("gpuorch.stack")

SERVICES = ("inventory", "scheduler", "quota", "autoscaler", "health")

# path prefix -> owning service, for the split gateway (longest prefix first)
ROUTES: list[tuple[str, str]] = [
    ("/v1/jobs:cancel", "scheduler"),
    ("/v1/jobs", "scheduler"),
    ("/v1/queues", "quota"),
    ("/v1/usage", "quota"),
    ("/v1/pools", "autoscaler"),
    ("/v1/deployments", "autoscaler"),
    ("/v1/nodes", "inventory"),
]
NODE_ACTIONS = ("/cordon", "/drain", "/resume")
FORWARDED_REQUEST_HEADERS = ("content-type", "accept", "traceparent", "authorization", "idempotency-key")
FORWARDED_RESPONSE_HEADERS = ("www-authenticate", "retry-after", "x-next-cursor", "link",  # the last two: job pages
                              "idempotent-replayed")


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


def admin_token_path(data_dir: Path) -> Path:
    return data_dir / "auth" / "admin.token"


async def api_auth(settings: Settings, evlog: EventLog, bootstrap: bool = False) -> Authenticator:
    """Who may call this process's API. ``bootstrap``: `gpuorch up` keeps an admin token in its data dir
    (created on first start); GPUORCH_ADMIN_TOKEN registers a given one (compose)."""
    auth = authenticator_from_settings(settings, evlog)
    if bootstrap or settings.admin_token:
        await ensure_admin_token(auth.tokens, admin_token_path(settings.data_dir), settings.admin_token)
    return auth


class ProcessSignals:
    """SIGINT and SIGTERM for the whole life of `gpuorch up`, from its first line and across its phases (nats-server,
    the log's streams, the agents, serving): a signal at any moment is an orderly stop, never a KeyboardInterrupt.
    Each asyncio phase gets ``for_loop()``; the second signal forces the stop."""

    def __init__(self) -> None:
        self.count = 0
        self._listeners: list[Callable[[], None]] = []

    def install(self) -> "ProcessSignals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: object) -> None:
        self.count += 1  # no logging here: a handler may run while the logging module holds its lock
        for listener in list(self._listeners):
            listener()

    @property
    def requested(self) -> bool:
        return self.count > 0

    @property
    def forced(self) -> bool:
        return self.count > 1

    def for_loop(self) -> StopSignals:
        return _LoopSignals(self)


class _LoopSignals(StopSignals):
    """ProcessSignals as the running event loop sees them (shared.runtime.serve_until_signal's interface)."""

    def __init__(self, process: ProcessSignals) -> None:  # no super().__init__(): the process's handlers stay
        self.requested = asyncio.Event()
        self.server = None
        self.loop = asyncio.get_running_loop()
        self.process = process
        process._listeners.append(self._wake)
        if process.requested:
            self.requested.set()

    def _wake(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closing
            self.loop.call_soon_threadsafe(self.on_signal)

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            self.process._listeners.remove(self._wake)


@dataclass
class Run:
    """One `gpuorch up`: what its phases share."""

    settings: Settings
    nats_url: str
    signals: ProcessSignals
    stack_file: StackFile
    server: NatsServer | None = None
    agents: dict[str, Child] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)
    nodes: list[tuple[str, int]] = field(default_factory=list)  # --nodes: what supervise_agents starts again
    creds: Credentials | None = None  # the agents' bus credentials (the embedded server's)
    stopping: bool = False  # the agents are being stopped: none is started again
    api_socket: socket.socket | None = None  # the API's port, bound before anything else started

    def nats_restarted(self, server: NatsServer) -> None:
        self.stack_file.write(nats_pid=server.pid)

    def record_agents(self) -> None:
        self.stack_file.write(agents={n: a.pid for n, a in self.agents.items()},
                              agent_pids=[a.pid for a in self.agents.values()])

    async def supervise_agents(self) -> None:
        """Start a simulated node's agent again when it dies (a crash, an OOM kill, a SIGKILL), as systemd would a
        real node's: the new agent adopts the tasks still running in its work dir and reports those that ended
        meanwhile, before the node's heartbeat times out (health would then fail its jobs: node lost). One that
        keeps dying is started again ever more slowly (``restart_delay``)."""
        wanted, restarted, backoff, due = wanted_agents(self.nodes), {}, {}, {}
        while not self.stopping:
            await asyncio.sleep(AGENT_POLL_S)
            now = time.monotonic()
            for node_id, child in list(self.agents.items()):
                if self.stopping or child.alive():
                    continue
                if node_id not in due:
                    backoff[node_id] = restart_delay(backoff.get(node_id, 0.0), now - restarted.get(node_id, -math.inf))
                    due[node_id] = now + backoff[node_id]
                    log.warning("event=agent_died node=%s pid=%d code=%s action=restart after_s=%.1f", node_id,
                                child.pid, child.proc.returncode if child.proc else None, backoff[node_id])
                if now < due[node_id]:
                    continue
                del due[node_id]
                profile, index = wanted[node_id]
                # not in a thread: a cancellation while it spawned would leave an agent that no one stops
                self.agents[node_id] = spawn_agent(self.settings, self.nats_url, profile, node_id, index, self.creds)
                restarted[node_id] = time.monotonic()
                self.record_agents()
                log.info("event=agent_restarted node=%s pid=%d", node_id, self.agents[node_id].pid)

    async def stop_agents(self, evlog: EventLog, scheduler_durable: str) -> None:
        """Ctrl-C, first step: the simulated nodes stop while the services run, so each agent's interrupted tasks
        are reported, relayed and requeued now (what is not, is on the next start)."""
        self.stopping = True
        live = [a for a in self.agents.values() if a.alive()]
        if not live:
            return
        t0 = time.monotonic()
        await asyncio.to_thread(stop_children, live, AGENT_STOP_S, lambda: self.signals.forced)
        settled = await settle(evlog, [(AGENT_STREAM, "inventory-relay"), (STREAM, scheduler_durable)], SETTLE_S)
        log.info("event=agents_stopped nodes=%d seconds=%.1f reports_settled=%s", len(live), time.monotonic() - t0,
                 settled)


SETTLE_S = 5.0
AGENT_POLL_S = 0.5  # how often `up` looks for dead agents
AGENT_STABLE_S = 60.0  # an agent that lived this long after a restart is started again at once when it dies
AGENT_BACKOFF_MAX_S = 30.0


def restart_delay(last_s: float, lived_s: float) -> float:
    """How long `up` waits to start a dead agent again: not at all if it lived a minute since `up` last started
    it (or `up` never did), else twice the last wait, from 0.5 s up to 30 s."""
    return 0.0 if lived_s >= AGENT_STABLE_S else min(AGENT_BACKOFF_MAX_S, max(AGENT_POLL_S, 2 * last_s))


METRICS_TIMEOUT_S = 2.0  # the most the gateway's /metrics waits for one service's
# a service that refuses connections is being started again (its supervisor polls every 0.5 s, a start takes
# seconds): the gateway tries again this long before it answers 503
CONNECT_RETRY_S = 15.0
CONNECT_RETRY_EVERY_S = 0.1
IDEMPOTENT = ("GET", "HEAD", "PUT", "DELETE")  # RFC 9110 9.2.2: sent twice, the same as once


def may_send_again(method: str, error: Exception, safe_post: bool = False) -> bool:
    """Whether the gateway may send a request again after this failure to reach its service. Refused: nothing
    was sent, so any request. Cut off (a kept-alive connection to a service that died; the failed connection
    leaves the pool): a POST may have been acted on, so only an idempotent method, or a POST that ``resendable``
    found safe (``safe_post``: a submission with its Idempotency-Key, recorded once however often it is sent, or a
    POST idempotent by design). Timed out: never."""
    import httpx

    if isinstance(error, httpx.ConnectError):
        return True
    cut_off = isinstance(error, (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError))
    return cut_off and (method in IDEMPOTENT or safe_post)


# POSTs that are idempotent by design: a node cordoned or resumed again "changes nothing" (health's API), and a
# deployment's metrics are a gauge, the last value wins. Not drain (a second one starts its grace again), not a
# token, not an injected XID.
IDEMPOTENT_POSTS = re.compile(r"^/v1/nodes/[^/]+/(cordon|resume)$|^/v1/deployments/[^/]+/metrics$")


def resendable(method: str, path: str, headers: dict[str, str]) -> bool:
    """Whether a POST may be sent again after a cut-off: a submission (POST /v1/jobs), given an Idempotency-Key
    of its own if it has none, so that a copy is recorded once; or a POST that is idempotent by design
    (IDEMPOTENT_POSTS). Only the job API honours the key (a dry run ignores it: it records nothing)."""
    if method != "POST":
        return False
    if path.rstrip("/") != "/v1/jobs":
        return IDEMPOTENT_POSTS.match(path) is not None
    headers.setdefault("idempotency-key", f"gateway-{uuid.uuid4().hex}")
    return True


async def settle(evlog: EventLog, durables: list[tuple[str, str]], timeout: float) -> bool:
    """Until these durable consumers have nothing pending nor unacknowledged, twice in a row (the agents' last
    reports relayed, and the scheduler's reactions to them appended); False at the deadline."""
    deadline = time.monotonic() + timeout
    quiet = 0
    while time.monotonic() < deadline:
        busy = False
        for stream, durable in durables:
            try:
                info = await evlog.js.consumer_info(stream, durable)
            except Exception:  # noqa: BLE001 - none yet (nothing to settle), or NATS away (nothing to wait for)
                continue
            busy = busy or bool(info.num_pending or info.num_ack_pending)
        quiet = 0 if busy else quiet + 1
        if quiet >= 2:
            return True
        await asyncio.sleep(0.1)
    return False


async def _serve_one_process(run: Run, names: tuple[str, ...]) -> None:
    settings, nats_url = run.settings, run.nats_url
    signals = run.signals.for_loop()  # a Ctrl-C while starting is kept, not lost
    evlog = await EventLog.connect(nats_url, replicas=settings.replicas, name="gpuorch-stack",
                                   user=settings.nats_user, password=settings.nats_password)
    metrics = Metrics()
    services = [build_service(n, settings, metrics) for n in names]
    fold_once(services)
    background = [asyncio.create_task(run.supervise_agents())]
    background += [asyncio.create_task(supervise_nats(run.server, run.nats_restarted))] if run.server else []

    async def ready() -> None:
        await asyncio.gather(*(s.ready.wait() for s in services))
        log.info("event=stack_ready seconds=%.2f nodes=%d", time.monotonic() - run.t0, len(run.agents))

    def started() -> None:
        background.append(asyncio.create_task(ready()))
        log.info("event=stack_up api=http://%s:%d nats=%s services=%s token=%s", settings.host, settings.port, nats_url,
                 ",".join(names), admin_token_path(settings.data_dir))

    async def before_stop() -> None:
        await run.stop_agents(evlog, durable_of("scheduler", settings))

    try:
        auth = await api_auth(settings, evlog, bootstrap=True)
        await run_process(services, evlog, settings.host, settings.port,
                          [events_router(lambda: evlog), tokens_router(lambda: evlog), dashboard_router(lambda: evlog)],
                          started, signals, auth=auth, before_stop=before_stop, sock=run.api_socket)
    finally:
        for t in background:
            t.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        try:
            await asyncio.wait_for(evlog.close(), 10)
        except TimeoutError:  # the server stops next anyway: a close that hangs must not keep the stack up
            log.warning("event=bus_close_timeout seconds=10")


def up(settings: Settings, split: bool = False) -> None:
    """`gpuorch up`: the whole stack until Ctrl-C; a second run on the same data dir resumes its state, and adopts
    the nats-server and agents a killed one left running."""
    signals = ProcessSignals().install()  # first of all: a Ctrl-C from here on stops the stack in order
    setup_logging(settings.log_level)
    setup_tracing("gpuorch-gateway" if split else "gpuorch")
    try:
        sock = listen(settings.host, settings.port)  # now: what the stack connects to while it starts can't take it
    except OSError as e:
        raise SystemExit(f"error: port {settings.port} is in use; pick another with --port ({e.strerror})") from None
    with sock, data_dir_lock(settings.data_dir):
        _up_locked(settings.model_copy(update={"port": sock.getsockname()[1]}), split, signals, sock)


def _up_locked(settings: Settings, split: bool, signals: ProcessSignals, sock: socket.socket) -> None:
    t0 = time.monotonic()
    nodes = parse_nodes(settings.nodes)
    creds = Credentials.of_data_dir(settings.data_dir)
    previous = Previous.read(settings.data_dir)
    stop_stale_services(previous)
    if not settings.nats_url:  # the embedded server admits only these users: the control plane and our agents
        control = creds.control()
        settings = settings.model_copy(update={"nats_user": control.name, "nats_password": control.password})
        for node_id in node_ids(nodes):
            creds.agent(node_id)
    server = None if settings.nats_url else start_or_adopt_nats(settings, creds, previous)
    nats_url = server.url if server else settings.nats_url or ""
    run = Run(settings, nats_url, signals, StackFile(settings, nats_url, split), server, t0=t0, nodes=nodes,
              creds=creds if server else None, api_socket=sock)
    try:
        run.stack_file.write(nats_pid=server.pid if server else None)
        if not signals.requested:
            asyncio.run(_prepare_log(settings, nats_url))
        if not signals.requested:
            run.agents = adopt_or_spawn_agents(settings, nats_url, nodes, run.creds, previous)
            run.record_agents()
        if not signals.requested:
            if split:
                _run_split(run)
            else:
                aio.run(_serve_one_process(run, SERVICES))
    finally:
        agents = list(run.agents.values())  # those still running: a crash, or a Ctrl-C before serving
        if not agents and signals.requested:  # a Ctrl-C before the last stack's agents were adopted: they stop too
            agents = [Child(pid) for pid in previous.agent_pids if agent_node(pid, settings) is not None]
        stop_children(agents, AGENT_STOP_S, lambda: signals.forced)
        if server is not None:
            server.stop()
    log.info("event=stack_stopped data_dir=%s", settings.data_dir)


async def _prepare_log(settings: Settings, nats_url: str) -> None:
    """Streams and buckets exist before any agent connects: agents may use them but not create them."""
    evlog = await EventLog.connect(nats_url, replicas=settings.replicas, name="gpuorch-stack-setup",
                                   user=settings.nats_user, password=settings.nats_password)
    await evlog.close()


# --- split mode ---------------------------------------------------------------------


def spawn_service(name: str, nats_url: str, port: int, settings: Settings, log_dir: Path) -> subprocess.Popen:
    log_dir.mkdir(parents=True, exist_ok=True)
    out = open(log_dir / f"{name}.log", "ab")
    bus = {"GPUORCH_NATS_USER": settings.nats_user, "GPUORCH_NATS_PASSWORD": settings.nats_password} \
        if settings.nats_user and settings.nats_password else {}
    return subprocess.Popen(
        [sys.executable, "-m", f"services.{name}", "--nats", nats_url, "--port", str(port), "--host", settings.host,
         "--snapshot-every", str(settings.snapshot_every), "--replicas", str(settings.replicas)],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=child_env({**bus, "GPUORCH_DATA_DIR": str(settings.data_dir)}),
    )


def _run_split(run: Run) -> None:
    settings, nats_url = run.settings, run.nats_url
    ports = {name: free_port() for name in SERVICES}
    procs = {name: spawn_service(name, nats_url, ports[name], settings, settings.data_dir / "logs") for name in SERVICES}
    _write_split(settings, ports, procs)
    try:
        upstreams = {name: f"http://{settings.host}:{port}" for name, port in ports.items()}
        aio.run(serve_gateway(settings, nats_url, upstreams, _supervise(run, ports, procs), run.signals,
                              lambda evlog: run.stop_agents(evlog, durable_of("scheduler", settings)), run.api_socket))
    finally:
        stop_processes(procs.values())


def _write_split(settings: Settings, ports: dict[str, int], procs: dict[str, subprocess.Popen]) -> None:
    """``<data-dir>/split.json``: each service's port and pid, replaced at once (a restart rewrote it in place, and a
    reader could find it empty)."""
    write_json(settings.data_dir / "split.json", {n: {"port": ports[n], "pid": p.pid} for n, p in procs.items()})


async def _supervise(run: Run, ports: dict[str, int], procs: dict[str, subprocess.Popen]) -> None:
    """Restart a service process that died (crash, OOM kill, SIGKILL): it rebuilds its state from the log; and the
    embedded nats-server, and the simulated nodes' agents."""
    settings, nats_url = run.settings, run.nats_url
    agents = asyncio.create_task(run.supervise_agents())
    nats = asyncio.create_task(supervise_nats(run.server, run.nats_restarted)) if run.server else None
    try:
        while True:
            await asyncio.sleep(0.5)
            for name, proc in list(procs.items()):
                if proc.poll() is not None:
                    log.warning("event=service_died service=%s pid=%d code=%s action=restart", name, proc.pid,
                                proc.returncode)
                    procs[name] = spawn_service(name, nats_url, ports[name], settings, settings.data_dir / "logs")
                    _write_split(settings, ports, procs)
    finally:
        agents.cancel()
        if nats is not None:
            nats.cancel()


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
    settings: Settings, nats_url: str, upstreams: dict[str, str], background: Coroutine[Any, Any, None] | None = None,
    process_signals: ProcessSignals | None = None, before_stop: Callable[[EventLog], Awaitable[None]] | None = None,
    sock: socket.socket | None = None,
) -> None:
    """The API on one port: the history API served here, every other path forwarded to its service.
    ``before_stop``: awaited once the API has stopped, while ``background`` (`up --split`: the supervisor) runs."""
    import httpx

    signals = process_signals.for_loop() if process_signals is not None else StopSignals()
    evlog = await EventLog.connect(nats_url, replicas=settings.replicas, name="gpuorch-gateway",
                                   user=settings.nats_user, password=settings.nats_password)
    auth = await api_auth(settings, evlog, bootstrap=background is not None)  # `up --split` keeps the admin token
    app = build_app([], [events_router(lambda: evlog), tokens_router(lambda: evlog), dashboard_router(lambda: evlog)],
                    auth=auth)
    client = httpx.AsyncClient(timeout=30)

    async def upstream_status() -> list[dict[str, Any]]:
        out = []
        for name, base in upstreams.items():
            try:
                resp = await client.get(f"{base}/readyz")
                out.append({"service": name, "ready": resp.status_code == 200})
            except httpx.HTTPError as e:
                out.append({"service": name, "ready": False, "error": repr(e)})
        return out

    @app.get("/v1/services", tags=["ops"])
    async def services_status(request: Request) -> list[dict[str, Any]]:
        out = []
        auth_header = {"authorization": request.headers.get("authorization", "")}
        for name, base in upstreams.items():
            try:
                out.extend((await client.get(f"{base}/v1/services", headers=auth_header)).json())
            except (httpx.HTTPError, ValueError) as e:
                out.append({"service": name, "ready": False, "error": repr(e)})
        return out

    @app.get("/readyz", tags=["ops"])
    async def readyz(response: Response) -> dict[str, Any]:
        status = {s["service"]: bool(s.get("ready")) for s in await upstream_status()}
        response.status_code = 200 if all(status.values()) else 503
        return {"ready": all(status.values()), "services": status}

    @app.get("/metrics", tags=["ops"], response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics(request: Request) -> Response:
        """Every service process's series, fetched at once (each within METRICS_TIMEOUT_S) and merged, with
        gpuorch_gateway_upstream_up telling which answered."""
        auth_header = {"authorization": request.headers.get("authorization", "")}

        async def scrape(name: str, base: str) -> str:
            try:
                resp = await client.get(f"{base}/metrics", headers=auth_header, timeout=METRICS_TIMEOUT_S)
                resp.raise_for_status()
                return resp.text
            except httpx.HTTPError as e:
                log.warning("event=metrics_scrape_failed service=%s error=%r", name, e)
                return ""

        bodies = await asyncio.gather(*(scrape(n, b) for n, b in upstreams.items()))
        up = ["# HELP gpuorch_gateway_upstream_up 1 if the service's /metrics answered this scrape",
              "# TYPE gpuorch_gateway_upstream_up gauge"]
        up += [f'gpuorch_gateway_upstream_up{{service="{n}"}} {1 if b else 0}' for n, b in zip(upstreams, bodies)]
        return Response(merge_expositions([*bodies, "\n".join(up)]), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/v1/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False)
    async def forward(rest: str, request: Request) -> Response:
        name = owner(request.url.path)
        if name is None:
            return Response(json.dumps({"detail": f"no route for {request.url.path}"}), 404, media_type="application/json")
        url = f"{upstreams[name]}{request.url.path}"
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_REQUEST_HEADERS}
        if traceparent := current_traceparent():  # traced: the service's span is a child of this request's
            headers["traceparent"] = traceparent
        safe_post = resendable(request.method, request.url.path, headers)
        body, deadline, told = await request.body(), time.monotonic() + CONNECT_RETRY_S, False
        while True:
            try:
                # every value of a repeated parameter (?state=queued&state=running), not only the last
                resp = await client.request(request.method, url, params=request.query_params.multi_items(),
                                            content=body, headers=headers)
                if not (STARTING in resp.headers and time.monotonic() < deadline):
                    break
                await asyncio.sleep(CONNECT_RETRY_EVERY_S)  # started again, replaying: nothing was done, ask again
                continue
            except httpx.HTTPError as e:
                if time.monotonic() >= deadline or not may_send_again(request.method, e, safe_post):
                    return unavailable(name, e)
                if not told:
                    log.info("event=forward_again service=%s method=%s path=%s error=%r safe_post=%s", name,
                             request.method, request.url.path, e, safe_post)
                    told = True
                await asyncio.sleep(CONNECT_RETRY_EVERY_S)  # the service is being started again (_supervise)
        return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"),
                        headers={k: v for k, v in resp.headers.items() if k.lower() in FORWARDED_RESPONSE_HEADERS})

    def unavailable(name: str, e: Exception) -> Response:
        log.warning("event=forward_failed service=%s error=%r cause=%r", name, e, e.__cause__)
        return Response(json.dumps({"detail": f"service {name} unavailable: {e!r}"}), 503, media_type="application/json")

    server = http_server(app, settings.host, settings.port, sock)
    log.info("event=gateway_up api=http://%s:%d services=%s", settings.host, settings.port, upstreams)
    task = asyncio.create_task(background) if background is not None else None
    try:
        await serve_until_signal(server, signals)
        if before_stop is not None:
            await before_stop(evlog)
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
        replicas: int = typer.Option(1, envvar="GPUORCH_REPLICAS", help="stream replicas (3 in a JetStream cluster)"),
        instance: str | None = typer.Option(None, envvar="GPUORCH_INSTANCE",
                                            help="this replica's name (default: the host name); one process per name"),
    ) -> None:
        settings = Settings(nats_url=nats, port=port, host=host, snapshot_every=snapshot_every, replicas=replicas,
                            instance=instance)
        setup_logging(settings.log_level)
        setup_tracing(f"gpuorch-{name}", settings.instance)
        aio.run(_serve_alone(name, settings))

    app()


async def _serve_alone(name: str, settings: Settings) -> None:
    signals = StopSignals()
    evlog = await EventLog.connect(settings.nats_url or "", replicas=settings.replicas, name=f"gpuorch-{name}",
                                   user=settings.nats_user, password=settings.nats_password)
    try:
        auth = await api_auth(settings, evlog)
        await run_process([build_service(name, settings)], evlog, settings.host, settings.port, signals=signals, auth=auth)
    finally:
        await evlog.close()
