"""The reaper hears of a task's exit when it happens, not at its next 0.1 s round (bench.e2e: `true` took 0.2-0.5 s
from its start to its exit report), and rests while every exit would wake it."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from pathlib import Path

import pytest

from services.inventory.agent import RECORD_WAIT_S, REAP_IDLE_S, Agent, Task, notify_on_exit
from shared import events as ev
from shared.aio import wait_event
from shared.profiles import build


async def test_a_child_that_exits_sets_the_reapers_event() -> None:
    exited = asyncio.Event()
    proc = subprocess.Popen(["sleep", "0.2"])
    try:
        assert notify_on_exit(proc.pid, exited), "this kernel has pidfd_open (Linux 5.3+)"
        assert not exited.is_set()
        assert await wait_event(exited, 10), "the exit woke the waiter"
        assert proc.poll() is not None
    finally:
        proc.kill()
        proc.wait()


def _agent(tmp_path: Path) -> Agent:
    return Agent(build("dgx-h100", "n0"), tmp_path / "agent")


def _task(tmp_path: Path, proc: subprocess.Popen, watched: bool) -> Task:
    d = tmp_path / "task"
    d.mkdir(exist_ok=True)
    return Task("j1", 1, 0, d, proc.pid, watched=watched)


async def _rounds(agent: Agent, seconds: float) -> int:
    """How many times the reaper looked at its tasks in ``seconds``."""
    looked = 0
    alive = Task.alive

    def counting(t: Task) -> bool:
        nonlocal looked
        looked += 1
        return alive(t)
    Task.alive = counting  # type: ignore[method-assign]
    reaper = asyncio.create_task(agent._reap_rounds())
    try:
        await asyncio.sleep(seconds)
    finally:
        reaper.cancel()
        Task.alive = alive  # type: ignore[method-assign]
        with contextlib.suppress(asyncio.CancelledError):
            await reaper
    return looked


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


async def test_the_reaper_rests_while_every_running_tasks_exit_is_watched(tmp_path: Path, sleeper) -> None:
    """An idle simulated agent's 0.1 s reaper rounds cost 16 agents 6 % of a core: a task whose exit wakes the
    reaper (a pidfd) is not polled; one whose exit wakes nothing is."""
    agent = _agent(tmp_path)
    t = _task(tmp_path, sleeper, watched=True)
    agent.tasks[t.key] = t
    assert await _rounds(agent, 0.6) == 1, "one round, then a rest of REAP_IDLE_S"
    t.watched = False
    assert await _rounds(agent, 0.6) >= 4, "an unwatched task is polled every REAP_POLL_S"


async def test_a_rested_reaper_still_reports_an_exit_kills_at_the_end_of_a_grace_and_reports_a_refusal(
        tmp_path: Path, sleeper) -> None:
    agent = _agent(tmp_path)
    t = _task(tmp_path, sleeper, watched=False)
    agent.tasks[t.key] = t
    t.watched = notify_on_exit(sleeper.pid, agent.exited)
    reaper = asyncio.create_task(agent._reap_rounds())
    try:
        await asyncio.sleep(0.1)  # resting now
        agent.stop("j1", 0)  # no grace: SIGTERM now (sleep dies of it), the reaper reports it at once
        deadline = time.monotonic() + REAP_IDLE_S / 2
        while not t.reporting and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert t.reporting, "the exit was reported before the reaper's idle round was over"
        assert any(r.env.data.TYPE == ev.JobTaskExited.TYPE for r in agent.outbox.pending.values())

        late = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 30"], start_new_session=True)
        try:
            t2 = Task("j2", 1, 0, tmp_path / "task", late.pid, watched=notify_on_exit(late.pid, agent.exited))
            agent.tasks[t2.key] = t2
            await asyncio.sleep(0.1)
            agent.stop("j2", 0.2)  # type: ignore[arg-type] - a grace shorter than the idle round
            await asyncio.sleep(0.1)
            assert late.poll() is None, "it ignores SIGTERM: alive until the grace ends"
            deadline = time.monotonic() + REAP_IDLE_S / 2
            while late.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert late.poll() is not None and t2.killed, "SIGKILL when the grace ended, not at the next idle round"
        finally:
            late.kill()
            late.wait()

        refused_dir = tmp_path / "refused"
        refused_dir.mkdir()
        t3 = Task("j3", 1, 0, refused_dir, 0)
        agent.refuse(t3, "no account")
        deadline = time.monotonic() + REAP_IDLE_S / 2
        while not t3.reporting and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert t3.reporting, "a refusal is reported at once"
    finally:
        reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reaper


async def test_an_exit_whose_record_lags_is_reported_with_its_code_and_one_never_recorded_as_lost(tmp_path: Path) -> None:
    """A task's keeper writes its exit record when it reaps it, a moment after the task's pidfd woke the reaper:
    the reaper looks again soon (RECORD_POLL_S) and reports the code, not 'lost'; a record that never comes is
    reported lost after RECORD_WAIT_S."""
    agent = _agent(tmp_path)
    ended = subprocess.Popen(["true"])
    ended.wait()  # gone, and no record yet (its keeper would write it)
    t = _task(tmp_path, ended, watched=True)
    agent.tasks[t.key] = t
    reaper = asyncio.create_task(agent._reap_rounds())
    try:
        await asyncio.sleep(0.05)
        assert not t.reporting, "no record yet: nothing reported"
        with open(t.dir / "record", "ab") as f:  # as its keeper appends it
            f.write(b'\n{"step": "exited", "code": 5}')
        deadline = time.monotonic() + REAP_IDLE_S / 2
        while not t.reporting and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert t.reporting, "the record was read at the next short round, not the idle one"
        [report] = [r for r in agent.outbox.pending.values() if r.env.data.TYPE == ev.JobTaskExited.TYPE]
        assert report.env.data.code == 5 and not report.env.data.reason

        never = subprocess.Popen(["true"])
        never.wait()
        d2 = tmp_path / "never"
        d2.mkdir()
        t2 = Task("j2", 1, 0, d2, never.pid, watched=True)
        agent.tasks[t2.key] = t2
        agent.exited.set()
        await asyncio.sleep(RECORD_WAIT_S / 2)
        assert not t2.reporting
        deadline = time.monotonic() + RECORD_WAIT_S + 1
        while not t2.reporting and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        [lost] = [r for r in agent.outbox.pending.values() if r.env.data.TYPE == ev.JobTaskExited.TYPE
                  and r.env.data.job_id == "j2"]
        assert lost.env.data.code is None and "lost" in lost.env.data.reason
    finally:
        reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reaper
