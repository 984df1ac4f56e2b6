"""The node agent: registers its GPUs, heartbeats, samples telemetry, and runs the tasks placed on it.

Each task runs in its own session as a child of the agent's task keeper (``launcher.py --serve``,
``forker``), in one directory per (job, attempt, task) holding its logs, the agent's record of it (its pid,
its reports acknowledged) and, at the end, its exit as the keeper recorded it (layout: ``taskdir``); the
agent, a child subreaper, records the exits of the
tasks of a keeper that died. The directory is the agent's memory across restarts: a task whose
directory holds a record is never started again; a restarted agent re-adopts a
live one and reports a vanished one as lost. A simulated node that powers off with
its agent (``--kill-tasks-on-exit``) records its tasks as interrupted before it
kills them: they are reported so, now or when it starts again, and their jobs go
back to the queue.

It reads its node's work (``work``: what inventory writes for it, one message per job
on its node), not the event log: its bus traffic grows with its own jobs, not the
cluster's. Reports go through an outbox (``outbox``): in order, retried until the bus
acknowledges them, whatever the outage; nothing waits on them.

A task gets its job's environment only, and a root agent runs it as its owner
(``runas``), in a ``work/`` directory of its own: it cannot touch its logs or the
agent's records. An owner with no account it may run as is refused: the task is
reported exited with code 126 and the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg
from pydantic import ValidationError

from services.inventory.discovery import poll_xid_events, register_xid_events, sample_telemetry
from services.inventory.forker import Forker
from services.inventory.launcher import REASON_MAX, become_subreaper, record_orphan
from services.inventory.outbox import Outbox, Report
from services.inventory.runas import RunAs, RunAsRefused, UserMap, agent_account, resolve
from services.inventory.taskdir import (RECORD, ExitRecord, LogNotFound, StateUnreadable, TaskRecord, append_record,
                                        has_record, make_task_dir, make_workspace, open_log, read_exit, read_record,
                                        read_state, read_task_log, untraversable, valid_job_id)
from services.inventory.taskenv import base_env, task_env
from services.inventory.work import NODE_NOTICE, STORED, NodeNotice, WorkOrder, node_work
from shared import events as ev
from shared.agentctl import LogRequest, XidRequest, answer
from shared.aio import wait_event
from shared.cluster import ClusterProjection
from shared.eventlog import HEARTBEAT_BUCKET, WORK_STREAM
from shared.events import Envelope
from shared.model import NodeInfo
from shared.natsauth import agent_inbox, agent_user, control_subject, report_subject, telemetry_subject
from shared.runtime import Metrics, Service
from shared.telemetry import current_traceparent, processing, span

log = logging.getLogger("gpuorch.agent")
STOP_GRACE_S = 10  # for what is left of an ended job (cancelled, failed, requeued: its word carries no grace)
REFUSED = 126  # the shell's "found but cannot run"
INTERRUPTED = "interrupted"  # a task directory's record: its node stopped under it (the file holds the reason)
XID_POLL_MS = 500
REAP_POLL_S = 0.1  # the reaper's round while some task's exit is not watched (no pidfd, or a report to retry)
REAP_IDLE_S = 1.0  # its round while every task's exit wakes it: a safety net (16 idle simulated agents polling at
# 0.1 s took 6 % of a core)
RECORD_POLL_S = 0.005  # the reaper's round while an ended task's keeper has yet to write its record
RECORD_WAIT_S = 2.0  # how long an ended task's record may lag its end before the task is reported lost
ENDED_KEPT = 10_000  # ended jobs' last words kept in memory (a redelivered older word must not start them again)


@dataclass
class Task:
    job_id: str
    attempt: int
    task: int
    dir: Path
    pid: int
    kill_at: float | None = None
    killed: bool = False
    reporting: bool = False  # its exit is in the outbox
    traceparent: str | None = None  # its start's span: its exit continues its job's trace
    watched: bool = False  # its exit wakes the reaper (a pidfd): no need to poll for it
    record_due: float = 0.0  # ended without an exit record yet: reported as lost if none by then (monotonic)

    @property
    def key(self) -> str:
        return f"{self.job_id}-{self.attempt}-{self.task}"

    def alive(self) -> bool:
        if self.pid <= 1:
            return False  # never started (refused), or its pid record was unreadable
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return _not_zombie(self.pid)


def notify_on_exit(pid: int, event: asyncio.Event) -> bool:
    """Set ``event`` when the process ``pid`` exits (a pidfd the running loop watches); False where there is no pidfd
    (not Linux 5.3+): whoever waits on ``event`` must also poll."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        event.set()  # gone already
        return True
    except (AttributeError, OSError):
        return False
    loop = asyncio.get_running_loop()

    def exited() -> None:
        loop.remove_reader(fd)
        os.close(fd)
        event.set()
    loop.add_reader(fd, exited)
    return True


def _not_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


class Agent:
    def __init__(self, node: NodeInfo, work_dir: Path, nvml: Any = None, *, heartbeat_s: float = 1.0,
                 telemetry_s: float = 1.0, metrics: Metrics | None = None, user_map: UserMap | None = None,
                 allow_root_tasks: bool = False) -> None:
        self.node, self.nvml = node, nvml
        self.user_map, self.allow_root_tasks = user_map, allow_root_tasks
        self.switch_user = os.geteuid() == 0
        self.work_dir = Path(work_dir).resolve()  # tasks run in their own directories: every path we hand them is absolute
        self.heartbeat_s, self.telemetry_s = heartbeat_s, telemetry_s
        self.tasks: dict[str, Task] = {}
        self.outbox = Outbox(node.node_id)
        self.forker = Forker(f"{node.node_id}:{self.work_dir}")
        self.exited = asyncio.Event()  # a task has exited, or a stop or a refusal is to be seen: the reaper runs now
        self.orders: dict[str, WorkOrder] = {}  # job id -> its latest word for this node
        self.ended: dict[str, None] = {}  # the ids of the jobs whose word says ended, the earliest ended first
        self.work_loaded = asyncio.Event()  # every word there was when the agent started has been read
        self.svc = Service(
            f"agent-{node.node_id}",
            ClusterProjection(),  # unused: an agent reads its node's work, not the log
            timers=[self.register_and_adopt, self.follow_work, self.heartbeat, self.telemetry, self.watch_xids,
                    self.reap, self.serve_control, self.deliver_reports],
            metrics=metrics,
            exclusive=False,  # one agent per node id; its credentials reach no bucket but its heartbeat
            follows_log=False,
        )

    def report(self, event: ev.Event, event_id: str | None = None, on_acked: Callable[[], None] | None = None) -> None:
        """Report to inventory, which appends it to the log (an agent may not): registration and task reports.
        Queued in the outbox, sent in order until acknowledged; ``on_acked`` runs then. It carries the current trace
        context (sent later, from the outbox's timer)."""
        env = Envelope(event, source=f"/gpuorch/agent/{self.node.node_id}", traceparent=current_traceparent(),
                       **({"id": event_id} if event_id else {}))
        self.outbox.put(Report(env, report_subject(self.node.node_id, event.TYPE.split(".", 1)[1]), on_acked))

    async def deliver_reports(self, svc: Service) -> None:
        assert svc.log is not None
        await self.outbox.deliver(svc.log)

    # --- registration, heartbeat, telemetry -------------------------------------------------

    async def register_and_adopt(self, svc: Service) -> None:
        self.forker.ready()  # the task keeper starts now, not when the first task waits for it
        self.report(ev.NodeRegistered(node_id=self.node.node_id, node=self.node))
        log.info("event=registered node=%s gpus=%d", self.node.node_id, len(self.node.gpus))
        if self.switch_user and (closed := untraversable(self.work_dir)):
            log.warning("event=work_dir_closed node=%s dir=%s: tasks run as their owners and cannot reach their "
                        "HOME by its path (they start in it)", self.node.node_id, closed)
        await self.work_loaded.wait()  # what each task's job is now decides what becomes of it
        await self.adopt()

    async def follow_work(self, svc: Service) -> None:
        """Read this node's work from each job's latest word on, then follow it (a consumer of this start: after a
        restart the agent reads its node's current work again)."""
        assert svc.log is not None
        subject = node_work(self.node.node_id)
        while not self.work_loaded.is_set():  # nothing there to read: loaded already
            try:
                info = await svc.log.js.stream_info(WORK_STREAM, subjects_filter=subject)
                if not info.state.subjects:
                    self.work_loaded.set()
                break
            except Exception as e:  # noqa: BLE001 - the bus is away: the consumer below waits for it too
                log.debug("event=work_info_failed error=%r", e)
                await asyncio.sleep(0.5)
        name = f"{agent_user(self.node.node_id)}-{os.urandom(6).hex()}".replace(":", "_")
        await svc.log.consume(name, self.on_work, stop=svc.stop_event, stream=WORK_STREAM, subject=subject,
                              last_per_subject=True, inactive_s=600, max_deliver=-1)

    async def on_work(self, _: object, msg: Msg) -> None:
        try:
            await self.take(msg.subject, msg.data)
        except (ValidationError, ValueError) as e:  # only the control plane writes here: logged, never retried
            log.error("event=work_unreadable subject=%s error=%r", msg.subject, str(e)[:300])
        except Exception as e:  # noqa: BLE001 - a full disk, say: read again later
            log.exception("event=work_failed subject=%s", msg.subject)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1)
            return
        await msg.ack()
        if msg.metadata.num_pending == 0:
            self.work_loaded.set()

    async def take(self, subject: str, body: bytes) -> None:
        """One word about this node's work: a job's tasks to run, to stop, or an ended job; or the node's notice."""
        name = subject.rsplit(".", 1)[-1]
        if name == NODE_NOTICE:
            notice = NodeNotice.model_validate_json(body)
            if notice.lost:
                self.report(ev.NodeRegistered(node_id=self.node.node_id, node=self.node), f"{notice.event_id}-reregistered")
                log.info("event=reregistered node=%s after=%r", self.node.node_id, notice.lost)
            return
        word = WorkOrder.model_validate_json(body, context=STORED)
        if word.job_id.replace(".", ":") != name:
            raise ValueError(f"a word about job {word.job_id} on {subject}")
        before = self.orders.get(word.job_id)
        if before is not None and before.seq >= word.seq:
            return  # read already (a redelivery)
        if word.ended:
            self.orders[word.job_id] = word
            self.ended.pop(word.job_id, None)
            self.ended[word.job_id] = None
            self.stop(word.job_id, STOP_GRACE_S)
            self._forget_ended()
        elif word.stop_grace_s is not None:
            kept = before if before is not None and not before.ended else word
            self.orders[word.job_id] = kept.model_copy(update={"seq": word.seq, "stop_grace_s": word.stop_grace_s})
            self.stop(word.job_id, word.stop_grace_s)
        else:
            self.orders[word.job_id] = word
            with processing(subject, word.traceparent, self.svc.name):
                for task in word.tasks_on(self.node.node_id):
                    with span("agent.task.start", attributes={"gpuorch.job.id": word.job_id, "gpuorch.task": task,
                                                              "gpuorch.attempt": word.attempt,
                                                              "gpuorch.node.id": self.node.node_id}):
                        try:
                            await self.start(word, task)
                        except Exception as exc:  # noqa: BLE001 - a task that cannot start fails its job, never its agent
                            self.cannot_start(word.job_id, word.attempt, task, f"the agent could not start it: {exc}")

    def _forget_ended(self) -> None:
        """Past ENDED_KEPT ended jobs, forget the earliest ended (one that was placed here again since is kept).
        Not a scan of every word: that took 0.43 ms an ended job once an agent had seen 10,000."""
        while len(self.ended) > ENDED_KEPT:
            job_id = next(iter(self.ended))
            del self.ended[job_id]
            if (order := self.orders.get(job_id)) is not None and order.ended:
                del self.orders[job_id]

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
        subject = telemetry_subject(self.node.node_id)
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
        subject = telemetry_subject(self.node.node_id, xid=True)
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

    def task_dir(self, job_id: str, attempt: int, task: int) -> Path:
        if not valid_job_id(job_id):
            raise ValueError(f"not a job id: {job_id!r}")
        return self.work_dir / "jobs" / job_id / str(attempt) / str(task)

    def run_as(self, owner: str) -> RunAs:
        """The account a task of ``owner`` runs as: resolved when the agent is root, else the agent's own."""
        if not self.switch_user:
            return agent_account()
        return resolve(owner, self.node.node_id, self.user_map, self.allow_root_tasks)

    async def start(self, order: WorkOrder, task: int) -> None:
        attempt = order.attempt
        if not valid_job_id(order.job_id):
            log.warning("event=task_refused job=%r task=%d reason=invalid_job_id", order.job_id[:100], task)
            return
        d = self.task_dir(order.job_id, attempt, task)
        if order.spec is None or has_record(d):
            return  # never start a task twice: a redelivery or an agent restart lands here
        spec = order.spec
        make_task_dir(self.work_dir, order.job_id, attempt, task)
        try:
            user = self.run_as(order.owner)
        except RunAsRefused as e:
            self.refuse(Task(order.job_id, attempt, task, d, 0), str(e))
            return
        home = make_workspace(d, (user.uid, user.gid) if self.switch_user else None)
        base = base_env(home, user.name, os.path.dirname(sys.executable))
        env = task_env(order.job_id, attempt, order.placements, task, order.addresses,
                       {**spec.env, **spec.secret_env}, base, spec=spec)
        args = ["--cwd", str(home)]
        if self.switch_user:
            args += ["--uid", str(user.uid), "--gid", str(user.gid), "--groups", ",".join(map(str, user.groups))]
        command = list(spec.command) or ["true"]
        out, err = open_log(d, "stdout"), open_log(d, "stderr")
        try:
            pid = await self.forker.launch_async([*args, str(d / RECORD), "--", *command], d, out, err, env)
        finally:
            os.close(out)
            os.close(err)
        append_record(d, "started", pid=pid, at=time.time())  # pid 0: it could not start (its exit record says why)
        t = Task(order.job_id, attempt, task, d, pid, traceparent=current_traceparent())
        self.tasks[t.key] = t
        if pid:
            t.watched = notify_on_exit(pid, self.exited)  # the reaper reports it at once, not at its next round
        else:
            self.exited.set()  # it could not start: its record says why
        log.info("event=task_started job=%s task=%d attempt=%d pid=%d user=%s uid=%d", order.job_id, task, attempt,
                 pid, user.name, user.uid)
        self.report_started(t)

    def report_started(self, t: Task) -> None:
        started = ev.JobTaskStarted(job_id=t.job_id, task=t.task, node_id=self.node.node_id, pid=t.pid, attempt=t.attempt)

        def acked() -> None:
            if t.reporting or t.key not in self.tasks:
                return  # it ended already: adoption re-reports the start of live tasks only
            with contextlib.suppress(OSError):
                append_record(t.dir, "start_reported")
        self.report(started, f"{t.key}-{self.node.node_id}-started", acked)

    def cannot_start(self, job_id: str, attempt: int, task: int, reason: str) -> None:
        """Report the task ended with REFUSED: through its directory if it has one (as ``refuse``), else at once."""
        log.exception("event=task_start_failed job=%s task=%d attempt=%d", job_id, task, attempt)
        d = self.task_dir(job_id, attempt, task)
        try:
            if not has_record(d):
                self.refuse(Task(job_id, attempt, task, d, 0), reason)
        except OSError:  # no directory to keep it in: a redelivery may try again, the report's id is the same
            self.report(ev.JobTaskExited(job_id=job_id, task=task, node_id=self.node.node_id, code=REFUSED, reason=reason,
                                         attempt=attempt), f"{job_id}-{attempt}-{task}-{self.node.node_id}-exited")

    def refuse(self, t: Task, reason: str) -> None:
        """Record the task as ended with REFUSED without starting it: the reaper reports it, once, as any exit."""
        append_record(t.dir, "exited", code=REFUSED, reason=reason[:REASON_MAX])
        append_record(t.dir, "started", pid=0, at=time.time())
        self.tasks[t.key] = t
        self.exited.set()
        log.warning("event=task_refused job=%s task=%d attempt=%d reason=%r", t.job_id, t.task, t.attempt, reason)

    async def power_off(self, timeout: float = 8.0) -> None:
        """A simulated node powering off with its agent: every task is killed and reported interrupted (its job
        goes back to the queue). The record is written before the kill, so that an agent that dies here reports
        the same when it starts again; so does one whose reports cannot reach the bus within ``timeout``."""
        why = f"node {self.node.node_id} stopped"
        for t in self.tasks.values():
            if t.alive():
                with contextlib.suppress(OSError):
                    (t.dir / INTERRUPTED).write_text(why)
                _signal_group(t.pid, signal.SIGKILL)
                log.info("event=task_interrupted job=%s task=%d attempt=%d", t.job_id, t.task, t.attempt)
        deadline = time.monotonic() + 2
        while any(t.alive() for t in self.tasks.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for t in list(self.tasks.values()):
            if not t.alive() and not t.reporting:
                self.report_exit(t)
        if self.svc.log is not None and not await self.outbox.flush(self.svc.log, timeout):
            log.warning("event=reports_left node=%s pending=%d: sent when the agent starts again", self.node.node_id,
                        len(self.outbox.pending))

    def stop(self, job_id: str, grace_s: int) -> None:
        """SIGTERM now, SIGKILL when the grace ends (the reaper enforces it)."""
        for t in self.tasks.values():
            if t.job_id == job_id and t.kill_at is None:
                t.kill_at = time.monotonic() + grace_s
                _signal_group(t.pid, signal.SIGTERM)
                self.exited.set()  # the reaper's next round is due when the grace ends
                log.info("event=task_stopping job=%s task=%d grace_s=%d", job_id, t.task, grace_s)

    async def adopt(self) -> None:
        """After a restart: tasks still running are watched again; vanished ones are reported (never restarted)."""
        for d in sorted((self.work_dir / "jobs").glob("*/*/*")):
            job_id, attempt, task = d.parent.parent.name, d.parent.name, d.name
            if not (valid_job_id(job_id) and _number(attempt) and _number(task)) or d.is_symlink():
                continue
            try:
                record = read_record(d)
            except StateUnreadable:
                record = TaskRecord(started=True)  # no pid to trust: its task counts as gone, reported lost
            if not record.started or record.reported:
                continue
            t = Task(job_id, int(attempt), int(task), d, record.pid)
            self.tasks[t.key] = t
            log.info("event=task_adopted job=%s task=%d alive=%s", job_id, t.task, t.alive())
            order = self.orders.get(job_id)
            if not t.alive():
                continue
            t.watched = notify_on_exit(t.pid, self.exited)
            if order is None or order.ended:
                self.stop(job_id, STOP_GRACE_S)  # it ended while we were away
            elif order.stop_grace_s is not None:
                self.stop(job_id, order.stop_grace_s)  # asked to stop while we were away
            elif order.attempt == t.attempt and not record.start_reported:
                self.report_started(t)  # its start report died with the agent that started it
        self.exited.set()  # the vanished ones are reported now

    async def reap(self, svc: Service) -> None:
        """Every round (at once when a task exits, a stop or a refusal comes, or a grace ends; else every
        REAP_POLL_S while some exit wakes nothing, REAP_IDLE_S otherwise): enforce grace periods, and queue the exit
        report of each task that ended (once; the task is forgotten when the report is acknowledged)."""
        try:
            await self._reap_rounds()
        finally:
            self.forker.close()

    async def _reap_rounds(self) -> None:
        while True:
            self.exited.clear()
            await wait_event(self.exited, self.reap_round())

    def reap_round(self) -> float:
        """One round; -> seconds until the next: REAP_POLL_S while some task must be polled (its exit wakes nothing,
        or its report failed), else until the next grace ends, REAP_IDLE_S at most."""
        now = time.monotonic()
        wait = REAP_IDLE_S
        for t in list(self.tasks.values()):
            if t.alive():
                if t.kill_at is not None and not t.killed:
                    if now >= t.kill_at:
                        _signal_group(t.pid, signal.SIGKILL)
                        t.killed = True
                        log.info("event=task_killed job=%s task=%d reason=grace_expired", t.job_id, t.task)
                    else:
                        wait = min(wait, t.kill_at - now)
                if not t.watched:
                    wait = min(wait, REAP_POLL_S)
                continue
            if t.reporting:
                continue
            try:
                if not self.report_exit(t, now):
                    wait = min(wait, RECORD_POLL_S)
            except Exception:  # noqa: BLE001 - a full disk: the next round tries again
                log.exception("event=task_report_failed job=%s task=%d", t.job_id, t.task)
                wait = REAP_POLL_S
        return wait

    def superseded(self, t: Task) -> bool:
        """The job was requeued and holds another place here now: an exit of this attempt would end the new one."""
        order = self.orders.get(t.job_id)
        return order is not None and not order.ended and bool(order.attempt) and (
            order.attempt != t.attempt or t.task not in order.tasks_on(self.node.node_id))

    def report_exit(self, t: Task, now: float | None = None) -> bool:
        """Queue the report of an ended task; False while its keeper has yet to write its exit record."""
        if self.superseded(t):
            append_record(t.dir, "reported", superseded=True)
            self.tasks.pop(t.key, None)
            log.info("event=task_exit_superseded job=%s task=%d attempt=%d", t.job_id, t.task, t.attempt)
            return True
        try:
            result = read_exit(t.dir) or self.record_orphan(t)
        except StateUnreadable as e:
            result = ExitRecord(None, None, f"lost: its exit record is unreadable ({e})")
        try:
            interrupted = read_state(t.dir, INTERRUPTED)
        except StateUnreadable:
            interrupted = None
        if result is None and interrupted is None and not t.killed:
            # the task's keeper writes its record when it reaps it, a moment after the pidfd woke us
            now = time.monotonic() if now is None else now
            t.record_due = t.record_due or now + RECORD_WAIT_S
            if now < t.record_due:
                return False
        if interrupted is not None and (result is None or result.code is None):
            result = ExitRecord(None, signal.SIGKILL, interrupted.strip()[:200] or "its node stopped")
        elif result is None and t.killed:
            result = ExitRecord(None, signal.SIGKILL, "killed when its grace period ended")
        elif result is None:
            result = ExitRecord(None, None, "lost: it ended with no exit record (its keeper was gone)")
        code, sig, reason = result.code, result.signal, result.reason
        was_interrupted = interrupted is not None and code is None

        def acked() -> None:
            self.tasks.pop(t.key, None)
            append_record(t.dir, "reported", code=code, signal=sig)
            log.info("event=task_exited job=%s task=%d attempt=%d code=%s signal=%s interrupted=%s", t.job_id, t.task,
                     t.attempt, code, sig, was_interrupted)

        t.reporting = True
        exited = ev.JobTaskExited(job_id=t.job_id, task=t.task, node_id=self.node.node_id, code=code, signal=sig,
                                  reason=reason, attempt=t.attempt, interrupted=was_interrupted)
        with span("agent.task.exit", t.traceparent, attributes={
                "gpuorch.job.id": t.job_id, "gpuorch.task": t.task, "gpuorch.attempt": t.attempt,
                "gpuorch.node.id": self.node.node_id, "process.exit.code": -1 if code is None else code}):
            self.report(exited, f"{t.key}-{self.node.node_id}-exited", acked)
        return True

    def record_orphan(self, t: Task) -> ExitRecord | None:
        """A task whose keeper died is this agent's child (a subreaper's orphan): reap it and record its exit."""
        record = record_orphan(t.pid, str(t.dir / RECORD)) if t.pid > 1 else None
        if record is None:
            return None  # its keeper's (which writes the record), or it ended before this agent started
        log.warning("event=task_orphan_reaped job=%s task=%d attempt=%d: its keeper had died", t.job_id, t.task,
                    t.attempt)
        return ExitRecord(record.get("code"), record.get("signal"), "")

    # --- the control plane's requests --------------------------------------------------------

    async def serve_control(self, svc: Service) -> None:
        """Answer ``gpuorch.agentctl.<node>.<verb>``: only control-plane credentials may ask (shared.agentctl)."""
        assert svc.log is not None
        handlers = {"logs": self.answer_logs, "inject-xid": self.answer_inject_xid}

        async def on_request(msg: Msg) -> None:
            handler = handlers.get(msg.subject.rsplit(".", 1)[-1])
            try:
                reply = await handler(msg.data) if handler else answer(status=404, error=f"no such request {msg.subject}")
            except ValidationError as e:
                reply = answer(status=422, error=f"bad request: {e.errors()[0].get('msg')} at {e.errors()[0].get('loc')}")
            except Exception as e:  # noqa: BLE001 - one bad request never takes the agent down
                log.exception("event=control_request_failed subject=%s", msg.subject)
                reply = answer(status=500, error=f"{type(e).__name__} on {self.node.node_id}")
            if msg.reply:
                await msg.respond(reply)

        sub = await svc.log.nc.subscribe(control_subject(self.node.node_id, "*"), cb=on_request)
        try:
            await svc.stop_event.wait()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def answer_logs(self, body: bytes) -> bytes:
        req = LogRequest.model_validate_json(body)
        try:
            chunk = await asyncio.to_thread(read_task_log, self.work_dir, req.job_id, req.attempt, req.task, req.stream,
                                            req.offset, req.limit, req.tail)
        except LogNotFound as e:
            return answer(status=404, error=f"{e} on {self.node.node_id}")
        return answer({"node": self.node.node_id, **chunk})

    async def answer_inject_xid(self, body: bytes) -> bytes:
        """Simulated backend only: the GPU reports this XID as the driver would."""
        req = XidRequest.model_validate_json(body)
        inject = getattr(self.nvml, "inject_xid", None)
        if inject is None:
            return answer(status=404, error=f"node {self.node.node_id} reads XIDs from its driver (nvml backend): "
                                            "injection needs --backend simulated")
        gpu = next((g for g in self.node.gpus if g.index == req.gpu_index), None)
        if gpu is None:
            return answer(status=404, error=f"node {self.node.node_id} has no GPU {req.gpu_index} "
                                            f"(it has {len(self.node.gpus)}, from 0)")
        inject(req.gpu_index, req.xid)
        return answer({"node": self.node.node_id, "gpu_index": req.gpu_index, "gpu_uuid": gpu.uuid, "xid": req.xid})


async def wait_for_log(evlog: Any, node_id: str) -> None:
    """The control plane creates the streams; an agent started first waits for them."""
    from nats.js.errors import NotFoundError

    from shared.eventlog import STREAM

    waited = False
    while True:
        try:
            await evlog.js.stream_info(STREAM)
            return
        except NotFoundError:
            if not waited:
                log.warning("event=waiting_for_event_log node=%s: start the control plane (gpuorch up)", node_id)
                waited = True
            await asyncio.sleep(1)


def _number(name: str) -> bool:
    return name.isascii() and name.isdigit()


def _signal_group(pid: int, sig: int) -> None:
    if pid <= 1:
        return  # 0 would be the agent's own group
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def run_agent(
    node: NodeInfo, nats_url: str, host: str, port: int, work_dir: Path, nvml: Any = None, *,
    kill_tasks_on_exit: bool = False, heartbeat_s: float = 1.0, telemetry_s: float = 1.0,
    user_map: UserMap | None = None, allow_root_tasks: bool = False, user: str | None = None, password: str | None = None,
    replicas: int = 1,
) -> None:
    """`gpuorch agent`: serve the agent's HTTP on host:port and run it until SIGINT/SIGTERM (``replicas``: of its
    durable consumer, as the event log's streams)."""
    from shared.eventlog import EventLog
    from shared.runtime import StopSignals, run_process

    signals = StopSignals()
    if not become_subreaper():  # the tasks of a keeper that dies come to this process: their exits stay known
        log.warning("event=no_subreaper node=%s: a task whose keeper dies is reported lost", node.node_id)
    agent = Agent(node, work_dir, nvml, heartbeat_s=heartbeat_s, telemetry_s=telemetry_s, user_map=user_map,
                  allow_root_tasks=allow_root_tasks)
    evlog = await EventLog.connect(nats_url, name=f"gpuorch-agent-{node.node_id}", ensure=False, user=user,
                                   password=password, inbox_prefix=agent_inbox(node.node_id), replicas=replicas)
    evlog.delete_temporary = False  # an agent may not delete consumers: its replays' lapse by themselves
    try:
        await wait_for_log(evlog, node.node_id)
        await run_process([agent.svc], evlog, host, port, signals=signals)
    finally:
        if kill_tasks_on_exit:
            await agent.power_off()
        await evlog.close()
