"""Helpers for tests that run services: poll with a deadline, run a service in the test's loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from services.inventory.taskdir import read_record
from shared.eventlog import EventLog
from shared.natsd import free_port
from shared.runtime import Service


class Clock:
    """A clock a test moves by hand: ``clock()`` reads it, ``clock.advance(s)`` moves it; nothing sleeps."""

    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


async def eventually(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(svc: Service, log: EventLog) -> AsyncIterator[Service]:
    task = asyncio.create_task(svc.run(log))
    try:
        await asyncio.wait_for(svc.ready.wait(), 10)
        yield svc
    finally:
        svc.stop()
        await asyncio.wait_for(task, 15)


def wait_until(cond: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def wait_http(url: str, timeout: float = 15.0) -> bool:
    """Poll an HTTP URL (a process just started) until it answers 200; False if the deadline passes first."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


@contextlib.asynccontextmanager
async def in_process_stack(log: EventLog, build: dict[str, Callable] | None = None,
                           **settings_kw) -> AsyncIterator[tuple[object, dict[str, Service]]]:
    """Every service in this event loop against a real nats-server, the API through ASGI. ``build``: services
    made otherwise, by name: ``{"health": lambda settings, metrics: Health(settings, metrics, ...).svc}``."""
    import httpx

    from services.stack import SERVICES, admin_token_path, api_auth, build_service
    from shared.api_events import events_router
    from shared.api_tokens import tokens_router
    from shared.runtime import Metrics, build_app, fold_once
    from shared.settings import Settings

    import tempfile

    defaults = {"cycle_interval_s": 0.3, "debounce_s": 0.01, "data_dir": Path(tempfile.mkdtemp(prefix="gpuorch-test-"))}
    settings = Settings(**{**defaults, **settings_kw})
    metrics = Metrics()
    services = {n: (build or {}).get(n, lambda s, m, n=n: build_service(n, s, m))(settings, metrics) for n in SERVICES}
    fold_once(list(services.values()))  # as `gpuorch up` does
    auth = await api_auth(settings, log, bootstrap=True)
    app = build_app(list(services.values()), [events_router(lambda: log), tokens_router(lambda: log)], auth=auth,
                    max_body_bytes=settings.max_body_bytes)
    admin = admin_token_path(settings.data_dir).read_text().strip()
    async with contextlib.AsyncExitStack() as stack:
        for svc in services.values():
            await stack.enter_async_context(running(svc, log))
        # on the way out, every service is told to stop at once: each then waits out its consumer's last fetch
        # (up to 0.5 s) together with the others, not one after another
        stack.callback(lambda: [svc.stop() for svc in services.values()])
        # the deciders record their terms first: a test comparing the log before and after sees only its own events
        deciders = {"/gpuorch/scheduler", "/gpuorch/autoscaler", "/gpuorch/health"}
        await eventually(lambda: deciders <= set(services["scheduler"].projection.terms), what="the leaders' elections")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gpuorch",
                                     headers={"authorization": f"Bearer {admin}"}) as client:
            client.app = app  # for tests that call it as another user: see ``as_user``
            yield client, services


async def as_user(client, user: str, groups: tuple[str, ...] = (), role: str = "user"):
    """An ASGI client on the same app as ``client`` that calls as a new token of this user."""
    import httpx

    token = (await client.post("/v1/tokens", json={"user": user, "groups": list(groups), "role": role})).json()["token"]
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=client.app), base_url="http://gpuorch",
                             headers={"authorization": f"Bearer {token}"})


class AgentProc:
    def __init__(self, nats_url: str, node_id: str, work: Path, profile: str = "t4-4x", cwd: Path | None = None,
                 args: tuple[str, ...] = (), env: dict[str, str] | None = None):
        """``cwd``: run the agent there, with its work dir relative to it (as `gpuorch up` on a relative data dir);
        ``args``: more `gpuorch agent` options; ``env``: more environment (its bus credentials)."""
        self.nats_url, self.node_id, self.work, self.profile, self.cwd = nats_url, node_id, work, profile, cwd
        self.args, self.env = args, env or {}
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "AgentProc":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "agent", "--backend", "simulated", "--profile", self.profile,
             "--node-id", self.node_id, "--nats", self.nats_url, "--port", str(self.port),
             "--work-dir", str(self.work.relative_to(self.cwd) if self.cwd else self.work), "--rack", "r1", *self.args],
            cwd=self.cwd, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **self.env},
            start_new_session=True, stdout=open(self.work.parent / f"{self.node_id}.log", "ab"), stderr=subprocess.STDOUT)
        return self

    def kill(self) -> None:
        """SIGKILL the agent alone (its tasks live on in their own sessions)."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def signal(self, sig: int) -> None:
        """The agent process alone: its tasks run in their own sessions."""
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def task_pids(self) -> list[int]:
        return [pid for d in self.work.glob("jobs/*/*/*") if (pid := read_record(d).pid) > 1]

    def keeper_pids(self) -> list[int]:
        """The agent's task keepers (``launcher.py --serve``, labelled with its work dir), the current and closed ones."""
        found = []
        for proc in Path("/proc").iterdir():
            try:
                cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--serve" in cmdline and any(a.endswith(f":{self.work.resolve()}".encode()) for a in cmdline):
                found.append(int(proc.name))
        return found

    def stop_everything(self) -> None:
        """The node powers off: the agent, its task keepers and the tasks die at once, and none records anything."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in self.keeper_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in self.task_pids():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


async def until(check, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def nodes_up(client, n: int) -> None:
    async def check():
        return len((await client.get("/v1/nodes")).json()) >= n
    await until(check, 30, f"{n} agents to register")
