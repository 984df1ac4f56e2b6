"""The node agent: registers its GPUs, heartbeats, samples telemetry, and runs the tasks placed on it.

Each task runs under ``launcher.py`` in its own session, in one directory per
(job, attempt, task) holding its logs, its pid and, at the end, its exit. The
directory is the agent's memory across restarts: a task whose directory says
"started" is never started again; a restarted agent re-adopts a live one and
reports a vanished one as lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, ConfigDict, Field

from services.inventory.discovery import poll_xid_events, register_xid_events, sample_telemetry
from services.inventory.taskenv import task_env
from shared import events as ev
from shared.cluster import ACTIVE, ClusterProjection
from shared.eventlog import HEARTBEAT_BUCKET
from shared.events import Envelope
from shared.model import NodeInfo
from shared.runtime import Metrics, Service

log = logging.getLogger("gpuorch.agent")
LAUNCHER = str(Path(__file__).with_name("launcher.py"))
STOP_GRACE_S = 10  # for cancel/fail, where the job event carries no grace
XID_POLL_MS = 500


class XidInjection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gpu_index: int = Field(ge=0)
    xid: int = Field(ge=1, le=65535)


class AgentProjection(ClusterProjection):
    name = "agent"


@dataclass
class Task:
    job_id: str
    attempt: int
    task: int
    dir: Path
    pid: int
    proc: subprocess.Popen | None = None  # None when re-adopted after an agent restart
    kill_at: float | None = None
    killed: bool = False

    @property
    def key(self) -> str:
        return f"{self.job_id}-{self.attempt}-{self.task}"

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return _not_zombie(self.pid)


def _not_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


class Agent:
    def __init__(self, node: NodeInfo, work_dir: Path, nvml: Any = None, *, heartbeat_s: float = 1.0,
                 telemetry_s: float = 1.0, metrics: Metrics | None = None) -> None:
        self.node, self.nvml = node, nvml
        self.work_dir = Path(work_dir).resolve()  # tasks run in their own directories: every path we hand them is absolute
        self.heartbeat_s, self.telemetry_s = heartbeat_s, telemetry_s
        self.tasks: dict[str, Task] = {}
        self.svc = Service(
            f"agent-{node.node_id}",
            AgentProjection(),
            reaction=self.react,
            timers=[self.register_and_adopt, self.heartbeat, self.telemetry, self.watch_xids, self.reap],
            router=self.router,
            metrics=metrics,
        )

    @property
    def proj(self) -> AgentProjection:
        return self.svc.projection  # type: ignore[return-value]

    async def emit(self, event: ev.Event, event_id: str | None = None) -> None:
        assert self.svc.log is not None
        env = Envelope(event, source=f"/gpuorch/agent/{self.node.node_id}", **({"id": event_id} if event_id else {}))
        await self.svc.log.append(env)

    # --- registration, heartbeat, telemetry -------------------------------------------------

    async def register_and_adopt(self, svc: Service) -> None:
        await self.emit(ev.NodeRegistered(node_id=self.node.node_id, node=self.node))
        log.info("event=registered node=%s gpus=%d", self.node.node_id, len(self.node.gpus))
        await self.adopt()

    async def heartbeat(self, svc: Service) -> None:
        assert svc.log is not None
        kv = await svc.log.kv(HEARTBEAT_BUCKET, ttl=60)
        while True:
            try:
                await kv.put(self.node.node_id, json.dumps({"t": time.time(), "tasks": len(self.tasks)}).encode())
            except Exception as e:  # noqa: BLE001 - NATS away: the next beat retries
                log.debug("heartbeat failed error=%r", e)
            await asyncio.sleep(self.heartbeat_s)

    async def telemetry(self, svc: Service) -> None:
        if self.nvml is None:
            return
        assert svc.log is not None
        subject = f"gpuorch.telemetry.{self.node.node_id}"
        while True:
            try:
                samples = sample_telemetry(self.nvml, self.node)
                body = json.dumps({"node_id": self.node.node_id, "t": time.time(),
                                   "gpus": [s.__dict__ for s in samples]}).encode()
                await svc.log.nc.publish(subject, body)
            except Exception as e:  # noqa: BLE001 - one failed sample is skipped
                log.debug("telemetry failed error=%r", e)
            await asyncio.sleep(self.telemetry_s)

    async def watch_xids(self, svc: Service) -> None:
        """XID errors from NVML, each published on gpuorch.telemetry.<node>.xid for health to classify."""
        if self.nvml is None:
            return
        assert svc.log is not None
        subject = f"gpuorch.telemetry.{self.node.node_id}.xid"
        try:
            event_set = register_xid_events(self.nvml, self.node)
        except Exception as e:  # noqa: BLE001 - no XID watch on this node; everything else works
            log.warning("event=xid_watch_unavailable node=%s error=%r", self.node.node_id, e)
            return
        try:
            while not svc.stop_event.is_set():
                started = time.monotonic()
                try:
                    xids = await asyncio.to_thread(poll_xid_events, self.nvml, event_set, XID_POLL_MS)
                except Exception as e:  # noqa: BLE001 - one failed wait is retried
                    log.warning("event=xid_poll_failed node=%s error=%r", self.node.node_id, e)
                    xids = []
                for x in xids:
                    body = {"node_id": self.node.node_id, "gpu_uuid": x.gpu_uuid, "xid": x.xid, "t": time.time(),
                            "recovery_action": self.recovery_action(x.gpu_uuid)}
                    await svc.log.nc.publish(subject, json.dumps(body).encode())
                    log.info("event=xid node=%s gpu=%s xid=%d", self.node.node_id, x.gpu_uuid, x.xid)
                # the simulated backend answers at once: pace it like a driver that blocks for the timeout
                await asyncio.sleep(max(0.0, XID_POLL_MS / 1000 - (time.monotonic() - started)))
        finally:
            with contextlib.suppress(Exception):
                self.nvml.nvmlEventSetFree(event_set)

    def recovery_action(self, gpu_uuid: str) -> int | None:
        """NVML's advice for the GPU (drivers r550+); None where the driver or the backend cannot say."""
        try:
            handle = self.nvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
            value = self.nvml.nvmlDeviceGetFieldValues(handle, [self.nvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])[0]
        except Exception:  # noqa: BLE001 - the simulated backend and older drivers have no such field
            return None
        return int(value.value.uiVal) if value.nvmlReturn == 0 else None

    # --- tasks ------------------------------------------------------------------------------

    async def react(self, env: Envelope) -> None:
        e = env.data
        if isinstance(e, ev.JobPlaced):
            mine = [p for p in e.placements if p.node_id == self.node.node_id]
            for p in mine:
                await self.start(e, env.seq, p.task)
        elif isinstance(e, (ev.JobPreempting, ev.JobTimedOut)):
            self.stop(e.job_id, e.grace_s)
        elif isinstance(e, (ev.JobCancelled, ev.JobFailed, ev.JobRequeued)):
            self.stop(e.job_id, STOP_GRACE_S)
        elif isinstance(e, ev.NodeLost) and e.node_id == self.node.node_id:
            await self.emit(ev.NodeRegistered(node_id=self.node.node_id, node=self.node), f"{env.id}-reregistered")
            log.info("event=reregistered node=%s after=%r", self.node.node_id, e.reason)

    def task_dir(self, job_id: str, attempt: int, task: int) -> Path:
        return self.work_dir / "jobs" / job_id / str(attempt) / str(task)

    async def start(self, placed: ev.JobPlaced, attempt: int, task: int) -> None:
        job = self.proj.jobs.get(placed.job_id)
        d = self.task_dir(placed.job_id, attempt, task)
        if job is None or (d / "started").exists():
            return  # never start a task twice: a redelivery or an agent restart lands here
        if job.state not in ("placed", "running"):
            return  # cancelled or preempted before it could start
        d.mkdir(parents=True, exist_ok=True)
        addresses = {n: s.info.address or s.info.hostname for n, s in self.proj.nodes.items()}
        env = {**os.environ, **task_env(placed.job_id, attempt, placed.placements, task, addresses, job.spec.env)}
        command = list(job.spec.command) or ["true"]
        with open(d / "stdout.log", "ab") as out, open(d / "stderr.log", "ab") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", LAUNCHER, str(d / "exit.json"), "--", *command],
                cwd=d, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        (d / "pid").write_text(str(proc.pid))
        (d / "started").write_text(str(time.time()))
        t = Task(placed.job_id, attempt, task, d, proc.pid, proc)
        self.tasks[t.key] = t
        log.info("event=task_started job=%s task=%d attempt=%d pid=%d", placed.job_id, task, attempt, proc.pid)
        await self.emit(ev.JobTaskStarted(job_id=placed.job_id, task=task, node_id=self.node.node_id, pid=proc.pid),
                        f"{t.key}-{self.node.node_id}-started")

    def stop_all(self) -> None:
        """A simulated node powering off: every task gets SIGKILL."""
        for t in self.tasks.values():
            _signal_group(t.pid, signal.SIGKILL)

    def stop(self, job_id: str, grace_s: int) -> None:
        """SIGTERM now, SIGKILL when the grace ends (the reaper enforces it)."""
        for t in self.tasks.values():
            if t.job_id == job_id and t.kill_at is None:
                t.kill_at = time.monotonic() + grace_s
                _signal_group(t.pid, signal.SIGTERM)
                log.info("event=task_stopping job=%s task=%d grace_s=%d", job_id, t.task, grace_s)

    async def adopt(self) -> None:
        """After a restart: tasks still running are watched again; vanished ones are reported (never restarted)."""
        for d in sorted((self.work_dir / "jobs").glob("*/*/*")):
            if not (d / "started").exists() or (d / "reported").exists():
                continue
            job_id, attempt, task = d.parent.parent.name, int(d.parent.name), int(d.name)
            t = Task(job_id, attempt, task, d, int((d / "pid").read_text() or 0))
            self.tasks[t.key] = t
            log.info("event=task_adopted job=%s task=%d alive=%s", job_id, task, t.alive())
            job = self.proj.jobs.get(job_id)
            if t.alive() and (job is None or job.state not in ("placed", "running", "preempting")):
                self.stop(job_id, STOP_GRACE_S)  # it ended while we were away

    async def reap(self, svc: Service) -> None:
        while True:
            now = time.monotonic()
            for key, t in list(self.tasks.items()):
                if t.alive():
                    if t.kill_at is not None and now >= t.kill_at and not t.killed:
                        _signal_group(t.pid, signal.SIGKILL)
                        t.killed = True
                        log.info("event=task_killed job=%s task=%d reason=grace_expired", t.job_id, t.task)
                    continue
                await self.report_exit(t)
                del self.tasks[key]
            await asyncio.sleep(0.1)

    def superseded(self, t: Task) -> bool:
        """The job was requeued and holds another place now: an exit of this attempt would end the new one."""
        job = self.proj.jobs.get(t.job_id)
        return job is not None and job.state in ACTIVE and not any(
            p.node_id == self.node.node_id and p.task == t.task for p in job.placements)

    async def report_exit(self, t: Task) -> None:
        if self.superseded(t):
            (t.dir / "reported").write_text(json.dumps({"superseded": True}))
            log.info("event=task_exit_superseded job=%s task=%d attempt=%d", t.job_id, t.task, t.attempt)
            return
        exit_file = t.dir / "exit.json"
        if exit_file.exists():
            result = json.loads(exit_file.read_text())
            code, sig, reason = result.get("code"), result.get("signal"), result.get("reason", "")
        elif t.killed:
            code, sig, reason = None, signal.SIGKILL, "killed when its grace period ended"
        else:
            code, sig, reason = None, None, "lost: the task vanished while its agent was down"
        await self.emit(
            ev.JobTaskExited(job_id=t.job_id, task=t.task, node_id=self.node.node_id, code=code, signal=sig, reason=reason),
            f"{t.key}-{self.node.node_id}-exited",
        )
        (t.dir / "reported").write_text(json.dumps({"code": code, "signal": sig}))
        log.info("event=task_exited job=%s task=%d code=%s signal=%s", t.job_id, t.task, code, sig)

    # --- HTTP: logs -------------------------------------------------------------------------

    def router(self, svc: Service) -> APIRouter:
        r = APIRouter(tags=["agent"])

        @r.get("/v1/agent/logs/{job_id}")
        def logs(
            job_id: str,
            task: int = Query(0, ge=0),
            attempt: int | None = None,
            stream: str = Query("stdout", pattern="^(stdout|stderr)$"),
            offset: int = Query(0, ge=0),
            limit: int = Query(1 << 20, ge=1, le=16 << 20),
        ) -> dict[str, Any]:
            base = self.work_dir / "jobs" / job_id
            attempts = sorted((int(p.name) for p in base.glob("*") if p.name.isdigit()), reverse=True)
            if not attempts:
                raise HTTPException(404, f"no task of job {job_id} ran on {self.node.node_id}")
            a = attempt if attempt is not None else attempts[0]
            path = base / str(a) / str(task) / f"{stream}.log"
            if not path.exists():
                raise HTTPException(404, f"no {stream} for task {task} of job {job_id} (attempt {a}) on {self.node.node_id}")
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(limit)
            return {"node": self.node.node_id, "task": task, "attempt": a, "stream": stream,
                    "offset": offset, "next_offset": offset + len(data), "data": data.decode(errors="replace")}

        @r.post("/v1/agent/inject-xid")
        def inject_xid(body: XidInjection) -> dict[str, Any]:
            """Simulated backend only: the GPU reports this XID as the driver would."""
            inject = getattr(self.nvml, "inject_xid", None)
            if inject is None:
                raise HTTPException(404, f"node {self.node.node_id} reads XIDs from its driver (nvml backend): "
                                         "injection needs --backend simulated")
            gpu = next((g for g in self.node.gpus if g.index == body.gpu_index), None)
            if gpu is None:
                raise HTTPException(404, f"node {self.node.node_id} has no GPU {body.gpu_index} "
                                         f"(it has {len(self.node.gpus)}, from 0)")
            inject(body.gpu_index, body.xid)
            return {"node": self.node.node_id, "gpu_index": body.gpu_index, "gpu_uuid": gpu.uuid, "xid": body.xid}

        return r


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def run_agent(
    node: NodeInfo, nats_url: str, host: str, port: int, work_dir: Path, nvml: Any = None, *,
    kill_tasks_on_exit: bool = False, heartbeat_s: float = 1.0, telemetry_s: float = 1.0,
) -> None:
    """`gpuorch agent`: serve the agent's HTTP on host:port and run it until SIGINT/SIGTERM."""
    from shared.eventlog import EventLog
    from shared.runtime import StopSignals, run_process

    signals = StopSignals()
    agent = Agent(node, work_dir, nvml, heartbeat_s=heartbeat_s, telemetry_s=telemetry_s)
    evlog = await EventLog.connect(nats_url, name=f"gpuorch-agent-{node.node_id}")
    try:
        await run_process([agent.svc], evlog, host, port, signals=signals)
    finally:
        if kill_tasks_on_exit:
            agent.stop_all()
        await evlog.close()
