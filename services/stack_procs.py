"""The processes `gpuorch up` runs beside its services: the embedded nats-server and one agent per simulated node.

They run in sessions of their own, so that a Ctrl-C in the terminal reaches `gpuorch up` alone, which
stops them in order (agents, then services, then the nats-server), and so that they outlive a
`gpuorch up` killed with SIGKILL. The next `up` on the data dir adopts what still runs there:
``stack.json`` names the pids, and a pid counts only if its command line names this data dir (a
recycled pid is left alone). A nats-server that died is started again on the port it had, so agents
still running reconnect by themselves; an agent that lives is kept, only missing ones are started.
Running tasks are never touched by a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from shared.natsauth import Credentials, client_env
from shared.natsd import (NatsServer, command_line, free_port, option_value, port_open, process_alive, same_path,
                          stop_pids)
from shared.settings import Settings

log = logging.getLogger("gpuorch.stack")

STACK_FILE = "stack.json"
AGENT_STOP_S = 15.0  # an agent powering off kills its tasks and reports them (it gives up on the bus after 8 s)


# --- what the last `gpuorch up` left -----------------------------------------------------------


@dataclass(frozen=True)
class Previous:
    """What the data dir's stack.json (and the nats-server's pid file) say about the last `gpuorch up` there."""

    nats_url: str | None = None
    nats_pid: int | None = None
    agent_pids: tuple[int, ...] = ()
    services: dict[str, int] = field(default_factory=dict)  # --split: service -> pid

    @property
    def nats_port(self) -> int | None:
        return urlparse(self.nats_url).port if self.nats_url else None

    @classmethod
    def read(cls, data_dir: Path) -> "Previous":
        info = _read_json(data_dir / STACK_FILE)
        split = _read_json(data_dir / "split.json") if info.get("split") else {}
        nats_pid = info.get("nats_pid")
        if not nats_pid:  # killed before it wrote stack.json: the server's own record
            with contextlib.suppress(OSError, ValueError):
                nats_pid = int((data_dir / "nats" / "nats-server.pid").read_text().strip())
        agents = info.get("agents") or {}
        pids = {*agents.values(), *info.get("agent_pids", [])}
        return cls(info.get("nats_url"), nats_pid, tuple(sorted(p for p in pids if isinstance(p, int))),
                   {n: s["pid"] for n, s in split.items() if isinstance(s, dict) and isinstance(s.get("pid"), int)})


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def write_json(path: Path, doc: dict) -> None:
    """Replace ``path`` with ``doc`` at once: readers (``gpuorch`` commands, tests) never see half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(path)


class StackFile:
    """``<data-dir>/stack.json``: this stack's pid, API, NATS URL and the pids of its nats-server and agents."""

    def __init__(self, settings: Settings, nats_url: str, split: bool) -> None:
        self.path = settings.data_dir / STACK_FILE
        self.info: dict = {"pid": os.getpid(), "nats_url": nats_url, "nats_pid": None,
                           "api": f"http://{settings.host}:{settings.port}", "split": split}

    def write(self, **changes: object) -> None:
        self.info.update(changes)
        write_json(self.path, self.info)


# --- processes: ours, or adopted ------------------------------------------------------------


class Child:
    """A process of the stack: one this `up` started, or one that a killed `up` left running (adopted by pid)."""

    def __init__(self, pid: int, proc: subprocess.Popen | None = None) -> None:
        self.pid, self.proc = pid, proc

    def alive(self) -> bool:
        return self.proc.poll() is None if self.proc is not None else process_alive(self.pid)


def stop_children(children: Iterable[Child], timeout: float, force: Callable[[], bool] = lambda: False) -> None:
    """SIGTERM them all at once, wait for all together; SIGKILL what is left at the deadline or when ``force()``."""
    children = [c for c in children if c.alive()]
    for c in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(c.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while children and time.monotonic() < deadline and not force():
        time.sleep(0.05)
        children = [c for c in children if c.alive()]
    for c in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(c.pid, signal.SIGKILL)
        if c.proc is not None:
            c.proc.wait()


# --- the nats-server ------------------------------------------------------------------------


def start_or_adopt_nats(settings: Settings, creds: Credentials, previous: Previous) -> NatsServer:
    """The data dir's nats-server: the one still running there (a killed `up` left it), else a new one on the
    port it had (so that agents still running reconnect by themselves), else on a free port."""
    store, kw = settings.data_dir / "nats", {"sync_always": settings.sync_always, "credentials": creds}
    port = previous.nats_port
    if port and previous.nats_pid:
        server = NatsServer.adopt(store, port, previous.nats_pid, **kw)
        if server is not None:
            log.info("event=nats_adopted pid=%d url=%s", previous.nats_pid, server.url)
            return server
        if process_alive(previous.nats_pid) and NatsServer(store, port, **kw).runs_here(previous.nats_pid):
            log.info("event=nats_restart pid=%d reason='its configuration changed'", previous.nats_pid)
            stop_pids([previous.nats_pid])
    if port and port_open(port):
        log.warning("event=nats_port_taken port=%d: a new port (agents of the last stack are started again)", port)
        port = None
    return NatsServer(store, port, **kw).start()


def surviving_nats(data_dir: Path) -> str | None:
    """The URL of the nats-server a killed `gpuorch up` left running on this data dir's store, if any: a second
    server must never be started on the same store."""
    previous = Previous.read(data_dir)
    if previous.nats_url and process_alive(previous.nats_pid) and \
            NatsServer(data_dir / "nats", previous.nats_port).runs_here(previous.nats_pid or 0):
        return previous.nats_url
    return None


async def supervise_nats(server: NatsServer, restarted: Callable[[NatsServer], None]) -> None:
    """Start the nats-server again, on its port and store, whenever it dies; every client reconnects by itself."""
    while True:
        await asyncio.sleep(0.5)
        if server.alive():
            continue
        log.warning("event=nats_died pid=%s port=%d action=restart", server.pid, server.port)
        try:
            await asyncio.to_thread(server.start)
        except Exception as e:  # noqa: BLE001 - the port may still be held for a moment: try again
            log.error("event=nats_restart_failed port=%d error=%r", server.port, e)
            await asyncio.sleep(2)
            continue
        log.info("event=nats_restarted pid=%s url=%s", server.pid, server.url)
        restarted(server)


# --- simulated nodes ----------------------------------------------------------------------


def parse_nodes(spec: str) -> list[tuple[str, int]]:
    """`dgx-h100:2,l4-8x:1,dgx-h100+mig:1` -> [("dgx-h100", 2), ("l4-8x", 1), ("dgx-h100+mig", 1)]; raises
    SystemExit with the reason. ``+mig``: the profile with its last GPU split into seven MIG slices."""
    from shared.profiles import MIG_SUFFIX, PROFILES, default_mig

    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        profile, _, count = item.partition(":")
        if profile.removesuffix(MIG_SUFFIX) not in PROFILES:
            raise SystemExit(f"error: unknown node profile {profile!r} in --nodes; known: {', '.join(PROFILES)} "
                             f"(with MIG: dgx-h100{MIG_SUFFIX}, ...)")
        if profile.endswith(MIG_SUFFIX):
            try:
                default_mig(profile.removesuffix(MIG_SUFFIX))
            except ValueError as e:
                raise SystemExit(f"error: --nodes {item}: {e}") from None
        if count and not count.isdigit():
            raise SystemExit(f"error: --nodes takes profile:count, got {item!r}")
        out.append((profile, int(count or 1)))
    return out


def node_id_of(profile: str, k: int) -> str:
    return f"{profile.replace('+', '-')}-{k}"  # dgx-h100+mig -> dgx-h100-mig-0: node ids take no '+'


def node_ids(nodes: list[tuple[str, int]]) -> list[str]:
    return [node_id_of(profile, k) for profile, count in nodes for k in range(count)]


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without its own bus credentials, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUORCH_NATS_")}
    return {**env, **extra}


def agent_work_dir(settings: Settings, node_id: str) -> Path:
    return settings.data_dir / "agents" / node_id


def spawn_agent(settings: Settings, nats_url: str, profile: str, node_id: str, index: int,
                creds: Credentials | None) -> Child:
    """`gpuorch agent --backend simulated`: real processes run the tasks; with ``creds``, the node's own bus
    credentials (in its environment, not its command line)."""
    logs = settings.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = child_env(client_env(creds.agent(node_id)) if creds else {})
    from shared.profiles import MIG_SUFFIX, default_mig

    base = profile.removesuffix(MIG_SUFFIX)
    mig = [f"{gpu}={','.join(names)}" for gpu, names in default_mig(base).items()] if base != profile else []
    cmd = [sys.executable, "-m", "services.cli", "agent", "--backend", "simulated", "--profile", base,
           "--node-id", node_id, "--nats", nats_url, "--port", str(free_port()), "--host", settings.host,
           "--work-dir", str(agent_work_dir(settings, node_id)), "--rack", f"r{index // 4}", "--zone", "z0",
           "--kill-tasks-on-exit", "--replicas", str(settings.replicas), *(a for m in mig for a in ("--mig", m))]
    with open(logs / f"agent-{node_id}.log", "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    return Child(proc.pid, proc)


def agent_node(pid: int, settings: Settings) -> str | None:
    """The node of a live agent process of this data dir (its work dir is ours), else None."""
    if not process_alive(pid):
        return None
    args = command_line(pid)
    node, work = option_value(args, "--node-id"), option_value(args, "--work-dir")
    if "agent" not in args or not node or not work or not same_path(pid, work, agent_work_dir(settings, node)):
        return None
    return node


def wanted_agents(nodes: list[tuple[str, int]]) -> dict[str, tuple[str, int]]:
    """node -> (profile, index: its rack is r<index // 4>)."""
    pairs = [(profile, node_id_of(profile, k)) for profile, count in nodes for k in range(count)]
    return {node_id: (profile, i) for i, (profile, node_id) in enumerate(pairs)}


def adopt_or_spawn_agents(settings: Settings, nats_url: str, nodes: list[tuple[str, int]], creds: Credentials | None,
                          previous: Previous) -> dict[str, Child]:
    """One agent per simulated node: the live one of the last stack if it talks to this NATS URL, else a new
    one. Agents of this data dir that are not wanted any more (or talk to another URL) are stopped first."""
    wanted = wanted_agents(nodes)
    agents: dict[str, Child] = {}
    stale = []
    for pid in previous.agent_pids:
        node = agent_node(pid, settings)
        if node is None:
            continue
        if node in wanted and node not in agents and option_value(command_line(pid), "--nats") == nats_url:
            agents[node] = Child(pid)
        else:
            stale.append(Child(pid))
    if stale:
        log.info("event=stale_agents_stopped pids=%s", [c.pid for c in stale])
        stop_children(stale, AGENT_STOP_S)
    adopted = len(agents)
    for node_id, (profile, i) in wanted.items():
        if node_id not in agents:
            agents[node_id] = spawn_agent(settings, nats_url, profile, node_id, i, creds)
    if agents:
        log.info("event=agents_started nodes=%d adopted=%d started=%d", len(agents), adopted, len(agents) - adopted)
    return agents


# --- services of a killed `up --split` ----------------------------------------------------------


def stop_stale_services(previous: Previous) -> None:
    """Service processes a killed `up --split` left (their own sessions): they hold its consumers and instance
    names, so they are stopped (they snapshot on the way out); the new stack starts its own."""
    stale = []
    for name, pid in previous.services.items():
        args = command_line(pid) if process_alive(pid) else []
        if f"services.{name}" in args and previous.nats_url and option_value(args, "--nats") == previous.nats_url:
            stale.append(pid)
    if stale:
        log.info("event=stale_services_stopped pids=%s", stale)
        stop_pids(stale)


def durable_of(service: str, settings: Settings) -> str:
    """The durable consumer of a service of this stack (shared.runtime.Service names it after its instance)."""
    instance = settings.instance if settings.instance is not None else socket.gethostname()
    return f"svc-{service}-{re.sub(r'[^A-Za-z0-9_-]', '_', instance)}"
