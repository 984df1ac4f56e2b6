"""Running work survives every restart: Ctrl-C and SIGKILL of `gpuorch up`, a dead nats-server, a long bus
outage, exits redelivered after a restart, and agents that run on their own while the control plane restarts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.cli import verify_log
from services.inventory.outbox import SEND_TIMEOUT_S
from services.inventory.taskdir import StateUnreadable, read_record
from services.stack import restart_delay
from services.scheduler.projection import SchedulerProjection
from shared import events as ev
from shared.cluster import agent_source
from shared.eventlog import EventLog, Undecodable
from shared.events import Envelope, GpuShare, TaskPlacement
from shared.natsauth import Credentials
from shared.natsd import NatsServer, free_port
from shared.runtime import Projection, Service, build_app
from shared.settings import Settings
from tests.builders import gpu_uuid, job, node, reported
from tests.support import AgentProc, in_process_stack, nodes_up, running, until, wait_until
from tests.test_stack import ENV, Stack, alive, gpuorch

TERMINAL = ("succeeded", "failed", "cancelled")


def runs(pid: int | None) -> bool:
    """Alive and not a zombie: an adopted process's parent died, and pid 1 may never reap it."""
    try:
        return alive(pid) and Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError, TypeError):
        return False


# --- helpers --------------------------------------------------------------------------------------


def submit(stack: Stack, name: str, command: list[str], **spec: object) -> str:
    r = stack.api.post("/v1/jobs", json={"name": name, "resources": {"gpus": 1}, "command": command, **spec})
    assert r.status_code in (200, 201, 202), r.text
    return r.json()["id"]


def job_state(stack: Stack, job_id: str) -> str:
    try:
        return stack.api.get(f"/v1/jobs/{job_id}").json()["state"]
    except (httpx.HTTPError, ValueError, KeyError):
        return ""


def wait_state(stack: Stack, job_id: str, states: tuple[str, ...], timeout: float) -> dict:
    wait_until(lambda: job_state(stack, job_id) in states, timeout, f"job {job_id} to be {'/'.join(states)}")
    return stack.api.get(f"/v1/jobs/{job_id}").json()


def history(stack: Stack, job_id: str) -> list[dict]:
    return stack.api.get(f"/v1/jobs/{job_id}/events").json()


def kinds(events: list[dict]) -> list[str]:
    """io.gpuorch.job.succeeded.v1 -> job.succeeded"""
    return [".".join(e["type"].split(".")[2:4]) for e in events]


def nodes_registered(stack: Stack, n: int) -> bool:
    try:
        return len(stack.api.get("/v1/nodes").json()) >= n
    except (httpx.HTTPError, ValueError):
        return False


async def _with_log(stack: Stack, fn):
    log = await stack.log()
    try:
        return await fn(log)
    finally:
        await log.close()


def real_invalid(stack: Stack) -> list[str]:
    """`gpuorch events verify`: the invalid transitions the log holds (none expected)."""
    results = asyncio.run(_with_log(stack, verify_log))
    out = []
    for r in results:
        if r["invalid_transitions"]:
            out += [f"{r['service']}: {line}" for line in r.get("details", {}).get("invalid", r.get("invalid", []))]
    return out


def folded(stack: Stack) -> SchedulerProjection:
    async def fold(log: EventLog) -> SchedulerProjection:
        proj = SchedulerProjection()
        async for rec in log.replay(1):
            if isinstance(rec, Undecodable):
                proj.skip(rec.seq)
            else:
                proj.apply(rec)
        return proj
    return asyncio.run(_with_log(stack, fold))


def task_exited(work: Path, job_id: str) -> bool:
    """Its keeper appended its exit to its record."""
    return any('"step": "exited"' in r.read_text() for r in work.glob(f"jobs/{job_id}/*/*/record"))


def kill_leftovers(data_dir: Path) -> None:
    """Whatever a stack on ``data_dir`` may have left (a SIGKILL leaves its nats-server, agents, split services and
    tasks): SIGKILL every process whose command line names the data dir or the stack's NATS URL, and the process
    group of each task."""
    try:
        nats_url = json.loads((data_dir / "stack.json").read_text()).get("nats_url") or None
    except (OSError, ValueError):
        nats_url = None
    marks = {str(data_dir), str(data_dir.resolve())} | ({f"{nats_url}\0"} if nats_url else set())
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if any(m in cmdline for m in marks):
            with contextlib.suppress(OSError):
                if "launcher.py" in cmdline:
                    os.killpg(int(proc.name), signal.SIGKILL)  # a task's own launcher: its command is in its group
                os.kill(int(proc.name), signal.SIGKILL)
    for task_dir in data_dir.glob("agents/*/jobs/*/*/*"):  # tasks of a keeper lead their own groups
        with contextlib.suppress(OSError, StateUnreadable):
            pid = read_record(task_dir).pid
            if pid > 1 and os.readlink(f"/proc/{pid}/cwd").startswith(str(data_dir.resolve())):  # not a reused pid
                os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def leftovers() -> Iterator[list[Path]]:
    """Data dirs whose processes are killed at the end of the test, whatever happened."""
    dirs: list[Path] = []
    yield dirs
    for d in dirs:
        kill_leftovers(d)


def one_node_running_a_job(data: Path, split: bool, seconds: int) -> tuple[Stack, str]:
    """A stack of one t4-4x node, and the id of its job of `sleep SECONDS`, running."""
    stack = Stack(data, split=split, nodes="t4-4x:1").start(timeout=60)
    wait_until(lambda: nodes_registered(stack, 1), 60, "the node to register")
    job_id = submit(stack, "through", ["sleep", str(seconds)])
    wait_until(lambda: job_state(stack, job_id) == "running", 60, "the job to run")
    return stack, job_id


def sigkill(stack: Stack) -> dict:
    """SIGKILL `gpuorch up` and its process group, as a crash or the OOM killer would; returns its stack.json."""
    assert stack.proc is not None
    info = stack.info()
    os.killpg(stack.proc.pid, signal.SIGKILL)
    stack.proc.wait()
    return info


def agents_by_node(info: dict) -> dict[str, int]:
    """node -> pid of the stack's live agents, from their command lines (--node-id)."""
    out = {}
    for pid in info.get("agent_pids", []):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "--node-id" in args and runs(pid):
            out[args[args.index("--node-id") + 1]] = pid
    return out


def time_to_ready(stack: Stack, timeout: float = 60) -> float:
    """Start `gpuorch up` and time it until its /readyz answers 200 (every service caught up, the log reachable)."""
    t0 = time.monotonic()
    stack.launch()
    deadline = t0 + timeout
    while True:
        try:
            if httpx.get(f"{stack.url}/readyz", timeout=1).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        assert stack.proc is not None and stack.proc.poll() is None, (stack.data_dir / "up.out").read_text()[-3000:]
        assert time.monotonic() < deadline, "the stack was not ready in time"
        time.sleep(0.02)


# --- Ctrl-C: the simulated nodes stop with the stack; their jobs wait in the queue --------------


def test_ctrl_c_requeues_the_running_jobs_without_a_retry_and_the_next_up_runs_them(tmp_path: Path,
                                                                                     leftovers: list[Path]):
    data = tmp_path / "d"
    leftovers.append(data)
    first = Stack(data, nodes="t4-4x:1").start()
    wait_until(lambda: nodes_registered(first, 1), 60, "the node to register")
    job_id = submit(first, "long", ["sh", "-c", "sleep 4"], max_retries=0)
    wait_until(lambda: job_state(first, job_id) == "running", 60, "the job to run")
    assert first.stop() == 0

    second = Stack(data, nodes="t4-4x:1").start()
    done = wait_state(second, job_id, TERMINAL, 90)
    events = history(second, job_id)
    assert done["state"] == "succeeded", (done, kinds(events))
    requeued = [e for e in events if e["type"].endswith("job.requeued.v1")]
    assert len(requeued) == 1 and requeued[0]["data"]["interrupted"], kinds(events)
    assert kinds(events).count("job.task_started") == 2 and kinds(events).count("job.succeeded") == 1
    assert "job.failed" not in kinds(events)
    assert folded(second).jobs[job_id].retries == 0, "a node that stopped costs the job no retry"
    assert real_invalid(second) == []
    assert second.stop() == 0


@pytest.mark.parametrize("when", ["nats/nats-server.pid", "stack.json"], ids=["nats-starting", "log-preparing"])
def test_ctrl_c_before_the_services_serve_stops_everything_in_order(tmp_path: Path, leftovers: list[Path], when: str):
    """A Ctrl-C during `up`'s first phases (the nats-server starting, the log being prepared) is an orderly stop,
    not a KeyboardInterrupt: exit 0, no traceback, nothing left running."""
    data = tmp_path / "d"
    data.mkdir()
    leftovers.append(data)
    out = data / "up.out"
    with open(out, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", str(free_port()), "--data-dir",
                                 str(data), "--nodes", "t4-4x:1"], env=ENV, start_new_session=True, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not (data / when).exists():  # the moment it appears: no polling interval for the phase to end in
            assert time.monotonic() < deadline and proc.poll() is None, out.read_text()
            time.sleep(0.001)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    info = json.loads((data / "stack.json").read_text())
    assert code == 0, out.read_text()
    assert "Traceback" not in out.read_text()
    wait_until(lambda: not any(runs(p) for p in [info["nats_pid"], *info.get("agent_pids", [])]), 15,
               "the nats-server and the agents to stop")


# --- SIGKILL: the next `up` adopts what survived ---------------------------------------------


@pytest.mark.slow
def test_a_stack_killed_with_sigkill_is_adopted_by_the_next_up_and_its_running_jobs_succeed(tmp_path: Path,
                                                                                           leftovers: list[Path]):
    data = tmp_path / "d"
    leftovers.append(data)
    nodes = "t4-4x:8,l4-8x:4"  # twelve nodes
    first = Stack(data, nodes=nodes).start(timeout=90)
    wait_until(lambda: nodes_registered(first, 12), 120, "twelve nodes to register")
    ids = [submit(first, "gang", ["sh", "-c", "sleep 6"], tasks=2), submit(first, "single", ["sleep", "6"])]
    for job_id in ids:
        wait_until(lambda: job_state(first, job_id) == "running", 60, "the jobs to run")
    before = sigkill(first)
    assert runs(before["nats_pid"]) and all(runs(p) for p in before["agent_pids"]), "they have their own sessions"

    second = Stack(data, nodes=nodes)
    ready_s = time_to_ready(second)
    print(f"\ntime to ready after a SIGKILL of `gpuorch up` with 12 nodes: {ready_s:.2f} s")
    after = second.info()
    assert after["nats_pid"] == before["nats_pid"], "the nats-server is adopted, not restarted"
    assert sorted(after["agent_pids"]) == sorted(before["agent_pids"]), "live agents are adopted, not respawned"
    for job_id in ids:
        done = wait_state(second, job_id, TERMINAL, 90)
        events = kinds(history(second, job_id))
        assert done["state"] == "succeeded", (done, events)
        assert events.count("job.succeeded") == 1 and "job.failed" not in events
        assert events.count("job.task_started") == (2 if done["tasks"] == 2 else 1), "no task started twice"
    assert real_invalid(second) == []
    assert second.stop() == 0
    assert not runs(after["nats_pid"]) and not any(runs(p) for p in after["agent_pids"])


def test_an_agent_of_the_killed_stack_that_died_too_is_started_again(tmp_path: Path, leftovers: list[Path]):
    data = tmp_path / "d"
    leftovers.append(data)
    first = Stack(data, nodes="t4-4x:2").start()
    wait_until(lambda: nodes_registered(first, 2), 60, "two nodes to register")
    before = agents_by_node(sigkill(first))
    dead, kept = before["t4-4x-0"], before["t4-4x-1"]
    os.kill(dead, signal.SIGKILL)
    conf = (data / "nats" / "nats-server.conf").read_text()
    out = gpuorch(tmp_path, "events", "verify", "--data-dir", str(data))
    assert out.returncode == 0, out.stdout + out.stderr
    assert (data / "nats" / "nats-server.conf").read_text() == conf, "read through the surviving server: never a second"
    second = Stack(data, nodes="t4-4x:2").start()
    after = agents_by_node(second.info())
    assert after["t4-4x-1"] == kept, "the live agent is kept"
    assert after["t4-4x-0"] != dead and runs(after["t4-4x-0"]), "the dead one is started again"
    job_id = submit(second, "after", ["sh", "-c", "exit 0"], tasks=2)
    assert wait_state(second, job_id, TERMINAL, 60)["state"] == "succeeded"
    assert second.stop() == 0


def test_an_agent_that_keeps_dying_is_started_again_ever_more_slowly():
    assert restart_delay(0.0, math.inf) == 0.0, "never restarted by this `up`: at once"
    assert restart_delay(30.0, 61.0) == 0.0, "it ran a minute since its last start: at once again"
    waits, last = [], 0.0
    for _ in range(8):  # dies 2 s after every start
        last = restart_delay(last, 2.0)
        waits.append(last)
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


@pytest.mark.parametrize("split", [False, True], ids=["one-process", "split"])
def test_an_agent_killed_while_its_task_runs_is_started_again_and_the_job_succeeds(tmp_path: Path,
                                                                                   leftovers: list[Path], split: bool):
    """`up` supervises its simulated nodes' agents as systemd would a real node's: a SIGKILLed agent is started
    again before its heartbeat times out, adopts the task that ran on, and reports its exit once."""
    data = tmp_path / "d"
    leftovers.append(data)
    stack, job_id = one_node_running_a_job(data, split, 4)
    dead = agents_by_node(stack.info())["t4-4x-0"]
    os.kill(dead, signal.SIGKILL)
    wait_until(lambda: agents_by_node(stack.info()).get("t4-4x-0", dead) != dead, 30, "the agent to be started again")
    done = wait_state(stack, job_id, TERMINAL, 60)
    events = kinds(history(stack, job_id))
    assert done["state"] == "succeeded", (done, events)
    assert events.count("job.succeeded") == 1 and events.count("job.task_started") == 1, events
    assert real_invalid(stack) == []
    info = stack.info()
    assert stack.stop() == 0
    assert not any(runs(p) for p in info["agent_pids"]), "the new agent stops with the stack"


def test_the_services_of_a_killed_split_stack_are_replaced_and_its_running_job_succeeds(tmp_path: Path,
                                                                                      leftovers: list[Path]):
    data = tmp_path / "d"
    leftovers.append(data)
    first, job_id = one_node_running_a_job(data, True, 5)
    services = [s["pid"] for s in first.info("split.json").values()]
    before = sigkill(first)
    assert all(runs(pid) for pid in services), "they have their own sessions"
    second = Stack(data, split=True, nodes="t4-4x:1").start(timeout=60)
    assert not any(runs(pid) for pid in services), "they held the old stack's consumers: stopped"
    assert second.info()["nats_pid"] == before["nats_pid"]
    done = wait_state(second, job_id, TERMINAL, 60)
    events = kinds(history(second, job_id))
    assert done["state"] == "succeeded" and events.count("job.succeeded") == 1, (done, events)
    assert real_invalid(second) == []
    assert second.stop() == 0


# --- the nats-server: supervised, and readiness says when the log is away ---------------------------


@pytest.mark.parametrize("split", [False, True], ids=["one-process", "split"])
def test_a_dead_nats_server_is_started_again_on_its_port_and_store(tmp_path: Path, leftovers: list[Path], split: bool):
    data = tmp_path / "d"
    leftovers.append(data)
    stack = Stack(data, split=split, nodes="t4-4x:1").start()
    wait_until(lambda: nodes_registered(stack, 1), 60, "the node to register")
    before = stack.info()
    os.kill(before["nats_pid"], signal.SIGKILL)
    wait_until(lambda: stack.info()["nats_pid"] != before["nats_pid"] and runs(stack.info()["nats_pid"]), 30,
               "the nats-server to be started again")
    assert stack.info()["nats_url"] == before["nats_url"]
    wait_until(stack.all_ready, 30, "every service to be ready again")
    job_id = submit(stack, "after", ["sh", "-c", "exit 0"])  # the agent reconnected by itself: same URL
    assert wait_state(stack, job_id, TERMINAL, 60)["state"] == "succeeded"
    assert stack.stop() == 0


async def test_readyz_answers_503_while_the_log_is_unreachable(nats_server: NatsServer):
    log = await EventLog.connect(nats_server.url)
    svc = Service("probe", Projection(), instance="t")
    app = build_app([svc], auth=None)
    try:
        async with running(svc, log), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                         base_url="http://gpuorch") as client:
            async def status(code: int) -> bool:
                return (await client.get("/readyz")).status_code == code

            assert await status(200)
            nats_server.stop()
            await until(lambda: status(503), 10, "/readyz to say 503 while the log is away")
            nats_server.start()
            await until(lambda: status(200), 20, "/readyz to say 200 again")
    finally:
        await log.close()


# --- a long bus outage: reports wait, nothing else does ----------------------------------------------


def _task_dir(work: Path, job_id: str, exit_code: int | None = None) -> Path:
    d = work / "jobs" / job_id / "1" / "0"
    d.mkdir(parents=True)
    (d / "started").write_text("0")
    if exit_code is not None:
        (d / "exit.json").write_text(json.dumps({"code": exit_code}))
    return d


async def test_the_reaper_enforces_a_grace_while_the_bus_is_away_and_the_exit_report_waits(tmp_path: Path,
                                                                                          nats_server: NatsServer):
    from services.inventory.agent import Agent, Task
    from shared.profiles import build

    agent = Agent(build("t4-4x", "n1"), tmp_path / "work")
    agent.svc.log = await EventLog.connect(nats_server.url)
    nats_server.stop()
    ended = Task("j-ended", 1, 0, _task_dir(agent.work_dir, "j-ended", 0), 0)
    stubborn = subprocess.Popen(["sleep", "60"], start_new_session=True)
    overdue = Task("j-overdue", 1, 0, _task_dir(agent.work_dir, "j-overdue"), stubborn.pid,
                   kill_at=time.monotonic())
    agent.tasks = {ended.key: ended, overdue.key: overdue}  # the ended one first: its report cannot be sent
    reaper = asyncio.create_task(agent.reap(agent.svc))
    try:
        async def killed() -> bool:
            return stubborn.poll() is not None
        await until(killed, 5, "the overdue task to get its SIGKILL although the bus is away")
        assert "j-ended" in [r.env.data.job_id for r in agent.outbox.pending.values()]
        assert not read_record(ended.dir).reported, "recorded as reported only once acknowledged"
    finally:
        reaper.cancel()
        stubborn.kill()
        stubborn.wait()
        nats_server.start()
        for _ in range(200):
            if agent.svc.log.nc.is_connected:
                break
            await asyncio.sleep(0.05)
        await agent.svc.log.close()


def test_a_task_found_gone_after_its_node_stopped_is_reported_interrupted(tmp_path: Path):
    from services.inventory.agent import Agent, Task
    from shared.profiles import build

    agent = Agent(build("t4-4x", "n1"), tmp_path / "work")
    d = _task_dir(agent.work_dir, "j-stopped")
    (d / "interrupted").write_text("node n1 stopped")
    agent.report_exit(Task("j-stopped", 1, 0, d, 0))
    [report] = agent.outbox.pending.values()
    exited = report.env.data
    assert isinstance(exited, ev.JobTaskExited)
    assert (exited.interrupted, exited.attempt, exited.code) == (True, 1, None)


@pytest.mark.slow
async def test_a_task_that_ends_during_a_long_bus_outage_is_recorded_once_when_the_bus_is_back(
        tmp_path: Path, nats_server: NatsServer):
    log = await EventLog.connect(nats_server.url)
    work = tmp_path / "agents" / "a"
    work.mkdir(parents=True)
    agent = AgentProc(nats_server.url, "a", work).start()
    try:
        async with in_process_stack(log) as (client, _):
            await nodes_up(client, 1)
            spec = job("outage").gpus(1).build().model_copy(update={"command": ("sleep", "3")})
            job_id = (await client.post("/v1/jobs", json=spec.model_dump(mode="json"))).json()["id"]

            async def state() -> str:
                return (await client.get(f"/v1/jobs/{job_id}")).json()["state"]

            await until(lambda: _is(state, "running"), 30, "the job to run")
            nats_server.stop()

            async def exit_waiting() -> bool:  # the task ended, and its report found no bus
                return task_exited(work, job_id) and "event=reports_waiting" in (work.parent / "a.log").read_text()

            await until(exit_waiting, 30, "the task to end and its report to wait for the bus")
            failed_at = time.monotonic()

            async def outlasted() -> bool:  # the outage outlasts any single append's wait: the report is retried
                return time.monotonic() - failed_at > SEND_TIMEOUT_S + 1

            await until(outlasted, 30, "the outage to outlast one append")
            nats_server.start()
            await until(lambda: _is(state, "succeeded"), 60, "the exit to be recorded")
            events = kinds((await client.get(f"/v1/jobs/{job_id}/events")).json())
            assert events.count("job.task_exited") == 1 and events.count("job.succeeded") == 1, events
    finally:
        agent.stop_everything()
        await log.close()
    text = (work.parent / "a.log").read_text()
    assert text.count("event=reports_waiting") == 1, "the outage is logged once"
    assert text.count("event=reports_delivered") == 1, "and so is the recovery"


async def _is(state, want: str) -> bool:
    return await state() == want


# --- decisions are made once per (job, attempt, kind) --------------------------------------------------


async def test_both_exits_of_a_gang_redelivered_after_a_restart_end_the_job_once(eventlog: EventLog, tmp_path: Path):
    from services.stack import build_service

    job_id = "j-gang"
    placed = ev.JobPlaced(job_id=job_id, placements=tuple(
        TaskPlacement(task=t, node_id="n1", gpus=(GpuShare(uuid=gpu_uuid("n1", t)),)) for t in (0, 1)))
    await eventlog.append_many([
        Envelope(ev.NodeRegistered(node_id="n1", node=node("n1").gpus(4).build()), source=agent_source("n1")),
        Envelope(ev.JobSubmitted(job_id=job_id, spec=job("gang").gpus(1).tasks(2).build())),
        Envelope(ev.JobQueued(job_id=job_id)),
        Envelope(placed),
        *(reported(ev.JobTaskStarted(job_id=job_id, task=t, node_id="n1")) for t in (0, 1)),
        *(reported(ev.JobTaskExited(job_id=job_id, task=t, node_id="n1", code=0)) for t in (0, 1)),
    ])
    history = await eventlog.read(0, limit=1000)
    for replica in ("a", "b"):  # a restarted scheduler, and a standby replica, each see both exits again
        svc = build_service("scheduler", Settings(data_dir=tmp_path / replica, instance=replica))
        svc.log = eventlog
        exits = []
        for rec in history:  # the restart's replay folds both exits ...
            if svc._fold(rec) is not None and isinstance(rec.data, ev.JobTaskExited):
                exits.append(rec)
        for rec in exits:  # ... then the consumer redelivers both, each reacted to before any decision is folded
            await svc.reaction(rec)
    stored = await eventlog.read(0, [f"gpuorch.events.job.{job_id}"], 100)
    assert [r.type for r in stored if not isinstance(r, Undecodable)].count("io.gpuorch.job.succeeded.v1") == 1
    assert not any(r["invalid_transitions"] for r in await verify_log(eventlog))


# --- agents on their own ride through any control-plane restart -----------------------------------------


@pytest.mark.parametrize("what", ["services", "services and nats-server"])
def test_an_agent_on_its_own_reports_a_task_exit_that_happened_while_the_control_plane_was_down_once(
        tmp_path: Path, leftovers: list[Path], what: str):
    data = tmp_path / "d"
    leftovers.append(data)
    stack = Stack(data, nodes="").start()
    creds = Credentials.of_data_dir(data).agent("ext-0")  # a node of its own, with its own bus user
    work = tmp_path / "ext" / "ext-0"
    work.mkdir(parents=True)
    agent = AgentProc(stack.info()["nats_url"], "ext-0", work,
                      env={"GPUORCH_NATS_USER": creds.name, "GPUORCH_NATS_PASSWORD": creds.password}).start()
    try:
        wait_until(lambda: nodes_registered(stack, 1), 60, "the agent to register")
        job_id = submit(stack, "through", ["sleep", "4"])
        wait_until(lambda: job_state(stack, job_id) == "running", 60, "the job to run")
        info = sigkill(stack)
        if what == "services and nats-server":
            os.kill(info["nats_pid"], signal.SIGKILL)
        wait_until(lambda: task_exited(work, job_id), 30, "the task to end while the control plane is down")
        time.sleep(1)
        assert agent.proc is not None and agent.proc.poll() is None, "the agent rides through"

        again = Stack(data, nodes="").start()
        assert again.info()["nats_url"] == info["nats_url"]
        done = wait_state(again, job_id, TERMINAL, 60)
        events = kinds(history(again, job_id))
        assert done["state"] == "succeeded", (done, events)
        assert events.count("job.task_started") == 1 and events.count("job.task_exited") == 1, events
        assert events.count("job.succeeded") == 1 and "job.failed" not in events
        assert real_invalid(again) == []
        assert again.stop() == 0
    finally:
        agent.stop_everything()
