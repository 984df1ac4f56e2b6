"""The agent's task keeper (bench.e2e: a launcher per task, forked or a new interpreter, was the largest CPU cost of a
short job): it starts each task as its child and records its exit as a launcher of the task's own would, and a task
can neither reach it nor die with it; the exits of a dead keeper's tasks are recorded by the agent (a subreaper)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.inventory.agent import notify_on_exit
from services.inventory.forker import Forker, _answer
from shared.aio import wait_event


@pytest.fixture
def forker():
    f = Forker("test")
    yield f
    f.close()


def launch(forker: Forker, d: Path, *command: str, env: dict[str, str] | None = None) -> int:
    return asyncio.run(launched(forker, d, *command, env=env))


async def launched(forker: Forker, d: Path, *command: str, env: dict[str, str] | None = None) -> int:
    out = os.open(d / "stdout.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    err = os.open(d / "stderr.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        return await forker.launch_async([str(d / "record"), "--", *command], d, out, err, env)
    finally:
        os.close(out)
        os.close(err)


def request(forker: Forker, args: list[str], d: Path, out: int) -> int:
    """One request as the agent sends it, without launch's retries and fallback."""
    forker._send(args, d, out, out)
    return _answer(forker.sock.recv(4096))


def until(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
    return found


def exit_record(d: Path, name: str = "record") -> dict:
    """The exit the keeper appended to the task's record (its ``exited`` line), once it is there."""
    return until(lambda: exited((d / name).read_text() if (d / name).exists() else ""))


def exited(text: str) -> dict | None:
    for line in text.splitlines():
        if line and (step := json.loads(line)).pop("step") == "exited":
            return step
    return None


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_keeper_runs_a_task_in_a_session_of_its_own_and_records_its_exit(forker, tmp_path):
    pid = launch(forker, tmp_path, "sh", "-c", "echo out; echo err >&2; exit 3")
    assert exit_record(tmp_path) == {"code": 3}
    assert (tmp_path / "stdout.log").read_text() == "out\n"
    assert (tmp_path / "stderr.log").read_text() == "err\n"
    assert until(lambda: gone(pid)), "the kernel reaps it: no zombie left for the agent to find alive"


def test_a_task_that_cannot_start_is_recorded_as_the_shell_would(forker, tmp_path):
    launch(forker, tmp_path, "/no/such/program")
    assert exit_record(tmp_path)["code"] == 127
    assert "cannot start '/no/such/program'" in (tmp_path / "stderr.log").read_text()


def test_a_task_leads_its_own_session_and_holds_no_socket_of_its_keeper(forker, tmp_path):
    pid = launch(forker, tmp_path, "sleep", "30")
    try:
        assert os.getsid(pid) == pid and os.getpgid(pid) == pid, "a stop signals the task's whole group"
        sockets = []
        for f in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(FileNotFoundError):  # closed meanwhile: it still sets up its descriptors
                if stat.S_ISSOCK(os.stat(f"/proc/{pid}/fd/{f}").st_mode):
                    sockets.append(int(f))
        assert sockets == [], "a task that kept its keeper's socket could ask it (root) for more"
    finally:
        os.killpg(pid, signal.SIGKILL)


ORPHANED = """
import asyncio, json, os, signal, sys, time
from pathlib import Path
from services.inventory.forker import Forker, _answer
from services.inventory.launcher import become_subreaper, record_orphan
assert become_subreaper()
d = Path(sys.argv[1])
forker = Forker("orphans")
out = os.open(d / "stdout.log", os.O_WRONLY | os.O_CREAT, 0o600)
pid = asyncio.run(forker.launch_async([str(d / "record"), "--", "sh", "-c", "while [ ! -e go ]; do sleep 0.02; done; exit 7"], d, out, out))
os.kill(forker.proc.pid, signal.SIGKILL)  # as the OOM killer would
forker.proc.wait()
print(pid, flush=True)
deadline = time.monotonic() + 20
while (record := record_orphan(pid, str(d / "record"))) is None and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps(record), flush=True)
"""


def test_tasks_outlive_their_keeper_and_its_subreaper_records_their_exits(forker, tmp_path):
    """The agent is a child subreaper (run_agent): a task whose keeper was killed runs on, becomes the agent's
    child, and the agent records its exit. A new keeper serves the next task."""
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    agent = subprocess.Popen([sys.executable, "-c", ORPHANED, str(first)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(agent.stdout.readline())
        assert not gone(pid), "the task runs on"
        assert not (first / "record").exists()
        launch(forker, second, "true")
        assert exit_record(second) == {"code": 0}, "a new keeper started the next task"
        (first / "go").touch()
        assert json.loads(agent.stdout.readline()) == {"code": 7}
        assert exit_record(first) == {"code": 7}, "its subreaper recorded how it ended"
        assert agent.wait(10) == 0
    finally:
        agent.kill()
        agent.wait()
        with contextlib.suppress(ProcessLookupError, NameError):
            os.killpg(pid, signal.SIGKILL)


def test_the_keeper_ends_when_its_agent_closes_it_and_its_tasks_have_ended(forker, tmp_path):
    """An agent that dies (the kernel closes its end) leaves its keeper to record its running tasks' exits."""
    pid = launch(forker, tmp_path, "sh", "-c", "while [ ! -e go ]; do sleep 0.02; done; exit 2")
    try:
        assert forker.proc is not None
        proc = forker.proc
        forker.sock.close()
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.5)  # a task still runs: the keeper stays to record it
        (tmp_path / "go").touch()
        assert exit_record(tmp_path) == {"code": 2}
        assert proc.wait(5) == 0, "then it ends"
        assert until(lambda: gone(pid))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def test_a_malformed_request_is_answered_and_the_forker_serves_on(forker, tmp_path):
    launch(forker, tmp_path, "true")
    exit_record(tmp_path)
    socket.send_fds(forker.sock, [b"{not json"], [0, 1])
    assert forker.sock.recv(4096).startswith(b"error ")
    socket.send_fds(forker.sock, [b"{}"], [0])
    assert forker.sock.recv(4096).startswith(b"error "), "two descriptors or none"
    (tmp_path / "record").unlink()
    launch(forker, tmp_path, "true")
    assert exit_record(tmp_path) == {"code": 0}


async def test_the_reaper_hears_of_a_keepers_tasks_exit(forker, tmp_path):
    exited = asyncio.Event()
    pid = await launched(forker, tmp_path, "sleep", "0.2")
    assert notify_on_exit(pid, exited), "a pidfd watches a process that is not the agent's child too"
    assert await wait_event(exited, 10)
    assert exit_record(tmp_path) == {"code": 0}


def test_a_forker_that_cannot_serve_falls_back_to_a_launcher_of_its_own(forker, tmp_path, monkeypatch):
    def broken(*_a):
        raise OSError("no forker here")
    monkeypatch.setattr(forker, "_send", broken)
    pid = launch(forker, tmp_path, "/bin/sh", "-c", 'echo "$SECRET"; exit 4', env={"SECRET": "s-1"})
    assert exit_record(tmp_path) == {"code": 4}, "the task still ran, and its exit was recorded"
    assert (tmp_path / "stdout.log").read_text() == "s-1\n", "its environment went by a file its launcher read"
    assert not (tmp_path / "env.json").exists(), "and removed"
    assert [p.pid for p in forker.strays] == [pid]
    until(lambda: forker.strays[0].poll() is not None)
    (tmp_path / "next").mkdir()
    launch(forker, tmp_path / "next", "true")
    assert pid not in [p.pid for p in forker.strays], "an ended stray is reaped, not kept"


def test_the_forker_refuses_bad_arguments_before_it_forks(forker: Forker, tmp_path: Path):
    """It parses a request's arguments itself (a fork's first parse cost it 5 ms of CPU): arguments a launcher
    would refuse are answered with an error, and no launcher is forked; the next good request still runs."""
    out = os.open(tmp_path / "stdout.log", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError, match="bad launcher arguments"):
            request(forker, ["--uid", "nobody", str(tmp_path / "record"), "--", "true"], tmp_path, out)
        with pytest.raises(OSError, match="bad launcher arguments"):
            request(forker, [str(tmp_path / "record"), "--"], tmp_path, out)  # no command
    finally:
        os.close(out)
    assert not (tmp_path / "record").exists() and forker.proc is not None and forker.proc.poll() is None
    launch(forker, tmp_path, "sh", "-c", "exit 3")
    assert exit_record(tmp_path) == {"code": 3}


async def test_an_agent_awaits_the_keepers_answer_without_blocking_its_loop(forker, tmp_path):
    """launch_async: the event loop runs on while the keeper forks and execs (the agent reports other tasks
    meanwhile); requests go one at a time, so each answer reaches its own request."""
    forker.ready()
    ticks = 0

    async def ticking():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(ticking())
    dirs = [tmp_path / str(i) for i in range(6)]
    for d in dirs:
        d.mkdir()
    out = os.open(tmp_path / "out.log", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        pids = await asyncio.gather(*(forker.launch_async([str(d / "record"), "--", "sh", "-c", f"exit {i}"], d,
                                                          out, out) for i, d in enumerate(dirs)))
    finally:
        os.close(out)
        ticker.cancel()
    assert ticks > 100, f"the loop ran while the keeper answered ({ticks} rounds)"
    assert len(set(pids)) == len(dirs) and all(p > 1 for p in pids)
    assert [exit_record(d) for d in dirs] == [{"code": i} for i in range(len(dirs))], "each task its own command"


def test_a_tasks_environment_goes_in_the_request_and_never_touches_the_disk(forker, tmp_path):
    launch(forker, tmp_path, "/bin/sh", "-c", 'echo "$SECRET $HOME"', env={"SECRET": "s-1", "HOME": "/h"})
    assert exit_record(tmp_path) == {"code": 0}
    assert (tmp_path / "stdout.log").read_text() == "s-1 /h\n"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["record", "stderr.log", "stdout.log"]
    out = os.open(tmp_path / "x.log", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        forker._send([str(tmp_path / "bad-record"), "--", "true"], tmp_path, out, out, {"A": 1})  # type: ignore[dict-item]
        answer = _answer(forker.sock.recv(4096))
    finally:
        os.close(out)
    assert answer == 0 and exit_record(tmp_path, "bad-record")["code"] == 126, \
        "an environment that is not strings is refused, and recorded as a task that could not start"


def test_an_environment_too_large_for_one_request_goes_by_a_file_the_keeper_removes(forker, tmp_path):
    big = "x" * 120_000  # a job may have 128 KiB of environment (MAX_ENV_BYTES)
    launch(forker, tmp_path, "/bin/sh", "-c", 'printf %s "$BIG" | wc -c', env={"BIG": big})
    assert exit_record(tmp_path) == {"code": 0}
    assert (tmp_path / "stdout.log").read_text().strip() == "120000"
    assert forker.strays == [], "the keeper started it"
    assert not (tmp_path / "env.json").exists()


async def test_a_launch_cancelled_while_it_awaits_the_answer_leaves_no_answer_for_the_next(forker, tmp_path):
    """An agent stopping mid-launch: the answer still to come must not be read as the next task's pid."""
    forker.ready()
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    out = os.open(second / "stdout.log", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        pending = asyncio.create_task(forker.launch_async([str(first / "record"), "--", "true"], first, out, out))
        await asyncio.sleep(0)  # sent, awaiting the answer
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        assert exit_record(first) == {"code": 0}, "its keeper started it and recorded it, though its agent left"
        pid = await forker.launch_async([str(second / "record"), "--", "sh", "-c", "echo $$; exit 6"], second,
                                        out, out)
    finally:
        os.close(out)
    assert exit_record(second) == {"code": 6}
    assert pid == int((second / "stdout.log").read_text()), "the answer is the second task's pid"
