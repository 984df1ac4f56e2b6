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
from services.inventory.launcher import parent_in_stat
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


def kill_group(pid: int) -> None:
    """SIGKILL the task's group; never pid 0 or 1 (killpg(0) is this test's own group)."""
    if pid > 1:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


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
        kill_group(pid)


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
        with contextlib.suppress(NameError):
            kill_group(pid)


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
        kill_group(pid)


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


# --- account keepers: the tasks of another account are started by a keeper that is that account -----------------

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="switching a task's account needs a root keeper")
NOBODY = 65534


def launch_as(forker: Forker, d: Path, uid: int, *command: str) -> int:
    """The pid of the task started as ``uid`` (0: refused)."""
    d.mkdir(exist_ok=True)
    out = os.open(d / "stdout.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        return asyncio.run(forker.launch_async(["--cwd", str(d), "--uid", str(uid), "--gid", str(uid), "--groups", "",
                                                str(d / "record"), "--", *command], d, out, out))
    finally:
        os.close(out)


def started_as(forker: Forker, d: Path, uid: int, *command: str) -> int:
    pid = launch_as(forker, d, uid, *command)
    assert pid > 1, (d / "record").read_text() if (d / "record").exists() else "no record"
    return pid


def parent(pid: int) -> int:
    return int(field(pid, "PPid")[0])


def field(pid: int, name: str) -> list[str]:
    return next(line.split()[1:] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith(f"{name}:"))


def account_keepers(forker: Forker) -> list[int]:
    out = []
    for p in children(forker.proc.pid):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # one that ended meanwhile
            if field(p, "Uid")[0] != "0" and field(p, "State")[0] != "Z":
                out.append(p)
    return out


def ended(pid: int) -> bool:
    """Gone, or a zombie its parent has yet to reap."""
    try:
        return field(pid, "State")[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.fixture
def closed_dir(tmp_path: Path) -> Path:
    """A directory no other account may pass through, as a root agent's work dir may be; a task's own dir in it."""
    os.chmod(tmp_path, 0o700)
    d = tmp_path / "task"
    d.mkdir()
    os.chown(d, NOBODY, NOBODY)
    return d


@root_only
def test_a_task_of_another_account_is_started_by_a_keeper_that_is_that_account_and_not_dumpable(forker, closed_dir):
    """A fork of the root keeper to switch ids cost a task 2.3 ms of CPU against 1.1 with vfork, which CPython does
    only when it switches nothing: an account's keeper has switched once for all its tasks. It must not be
    something its account's processes can trace or read (not dumpable: its /proc files are root's), and it starts
    the task where it stands though it cannot reach that directory by its path."""
    pid = started_as(forker, closed_dir, NOBODY, "sh", "-c", "pwd; id -u; sleep 30")
    try:
        keeper = parent(pid)
        assert keeper != forker.proc.pid and parent(keeper) == forker.proc.pid, "a keeper of the account, a child"
        assert field(keeper, "Uid") == [str(NOBODY)] * 4 and field(keeper, "Gid") == [str(NOBODY)] * 4
        assert field(keeper, "Groups") == [], "exactly the request's groups: none"
        assert os.stat(f"/proc/{keeper}/environ").st_uid == 0, "not dumpable: no ptrace, no /proc of it for nobody"
        held = sorted(int(f) for f in os.listdir(f"/proc/{keeper}/fd"))
        assert len(held) <= 6 and all(f < 3 or stat.S_ISSOCK(os.stat(f"/proc/{keeper}/fd/{f}").st_mode) or
                                      os.readlink(f"/proc/{keeper}/fd/{f}").startswith("pipe:") for f in held), \
            "its socket and wake-up pipe: none of the root keeper's (the agent's socket, another task's logs)"
        assert until(lambda: (closed_dir / "stdout.log").read_text().splitlines()[:2] == [str(closed_dir), str(NOBODY)])
        assert os.getsid(pid) == pid, "the task leads its own session"
        sockets = [f for f in os.listdir(f"/proc/{pid}/fd") if stat.S_ISSOCK(os.stat(f"/proc/{pid}/fd/{f}").st_mode)]
        assert sockets == [], "nor does it hold its keeper's socket"
    finally:
        kill_group(pid)
    assert exit_record(closed_dir) == {"signal": 9}, "the root keeper records its exit (the account cannot)"
    assert os.stat(closed_dir / "record").st_uid == 0


@root_only
def test_one_keeper_per_account_and_a_bounded_number_of_them(forker, tmp_path, monkeypatch):
    """Tasks of one account share its keeper; past ACCOUNT_KEEPERS_MAX accounts an idle keeper ends for the new
    one, and when none is idle the task is forked from the root keeper, as before."""
    from services.inventory import launcher
    os.chmod(tmp_path, 0o755)
    a = started_as(forker, tmp_path / "a", NOBODY, "sleep", "30")
    b = started_as(forker, tmp_path / "b", NOBODY, "sleep", "30")
    running = [a, b]
    try:
        assert parent(a) == parent(b) != forker.proc.pid
        for i in range(launcher.ACCOUNT_KEEPERS_MAX - 1):  # the others: all busy
            running.append(started_as(forker, tmp_path / f"u{i}", 70000 + i, "sleep", "30"))
        assert len(account_keepers(forker)) == launcher.ACCOUNT_KEEPERS_MAX
        extra = started_as(forker, tmp_path / "extra", 71000, "sleep", "30")
        running.append(extra)
        assert parent(extra) == forker.proc.pid, "every keeper busy: forked from the root keeper"
        assert field(extra, "Uid") == ["71000"] * 4
        kill_group(running.pop())
        for pid in running[2:]:
            kill_group(pid)
        for i in range(launcher.ACCOUNT_KEEPERS_MAX - 1):
            exit_record(tmp_path / f"u{i}")
        last = started_as(forker, tmp_path / "last", 72000, "sleep", "30")
        running[2:] = [last]
        assert parent(last) != forker.proc.pid, "an idle keeper made room"
        assert until(lambda: len(account_keepers(forker)) <= launcher.ACCOUNT_KEEPERS_MAX)
        assert parent(a) in account_keepers(forker), "the busy one stays"
    finally:
        for pid in running:
            kill_group(pid)


@root_only
def test_a_killed_account_keeper_leaves_its_tasks_exits_to_the_root_keeper_and_is_replaced(forker, tmp_path):
    """A task of the account may kill its keeper (same uid): its tasks run on, the root keeper (a subreaper) reaps
    them and records how they ended, and the account's next task gets a new keeper."""
    os.chmod(tmp_path, 0o777)
    pid = started_as(forker, tmp_path / "a", NOBODY, "sh", "-c", "while [ ! -e go ]; do sleep 0.02; done; exit 7")
    try:
        keeper = parent(pid)
        os.kill(keeper, signal.SIGKILL)
        assert until(lambda: parent(pid) == forker.proc.pid), "its task is the root keeper's now"
        (tmp_path / "a" / "go").touch()
        assert exit_record(tmp_path / "a") == {"code": 7}
        nxt = started_as(forker, tmp_path / "b", NOBODY, "sh", "-c", "exit 5")
        assert exit_record(tmp_path / "b") == {"code": 5}
        assert nxt != pid
    finally:
        kill_group(pid)


@root_only
def test_an_account_keeper_that_does_not_answer_is_killed_and_its_task_refused_with_the_reason(forker, tmp_path):
    """A task of the account may stop its keeper: the task being started is refused (its record says why) within
    ACCOUNT_REPLY_S, never left to the agent's timeout, and the next one gets a new keeper."""
    from services.inventory import launcher
    os.chmod(tmp_path, 0o755)
    pid = started_as(forker, tmp_path / "a", NOBODY, "sleep", "30")
    keeper = parent(pid)
    try:
        os.kill(keeper, signal.SIGSTOP)
        t = time.monotonic()
        assert launch_as(forker, tmp_path / "b", NOBODY, "true") == 0
        assert time.monotonic() - t < launcher.ACCOUNT_REPLY_S + 1.5
        assert exit_record(tmp_path / "b") == {"code": 126, "reason": "cannot start true: the keeper of its account "
                                                                        "did not answer"}
        assert until(lambda: ended(keeper)), "killed"
        started_as(forker, tmp_path / "c", NOBODY, "sh", "-c", "exit 4")
        assert exit_record(tmp_path / "c") == {"code": 4}
    finally:
        kill_group(pid)


@root_only
def test_a_closed_keeper_ends_its_account_keepers_and_still_records_their_tasks(forker, tmp_path):
    os.chmod(tmp_path, 0o777)
    pid = started_as(forker, tmp_path / "a", NOBODY, "sh", "-c", "while [ ! -e go ]; do sleep 0.02; done; exit 3")
    try:
        keeper, proc = parent(pid), forker.proc
        forker.sock.close()
        assert until(lambda: ended(keeper)), "its account keeper ends"
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.3)  # the task runs on: the keeper stays to record it
        (tmp_path / "a" / "go").touch()
        assert exit_record(tmp_path / "a") == {"code": 3}
        assert proc.wait(5) == 0
    finally:
        kill_group(pid)


@root_only
def test_an_account_keeper_is_believed_only_about_the_tasks_it_started(forker, tmp_path):
    """The root keeper records an exit an account's keeper tells only for a task that keeper started: never for
    another account's task (a pid reused, a keeper gone wrong). The message is forged on the keeper's own socket,
    taken from it as root (pidfd_getfd)."""
    os.chmod(tmp_path, 0o777)
    mine = started_as(forker, tmp_path / "a", NOBODY, "sleep", "30")
    other = started_as(forker, tmp_path / "b", 70000, "sh", "-c", "while [ ! -e go ]; do sleep 0.02; done; exit 4")
    try:
        keeper = parent(mine)
        assert keeper != parent(other)
        with keepers_socket(keeper) as s:
            s.send(json.dumps({"exit": [other, 9]}).encode())
        (tmp_path / "c").mkdir()
        launch(forker, tmp_path / "c", "true")  # a round trip: the forged word was heard before its answer
        assert exit_record(tmp_path / "c") == {"code": 0}
        assert exited((tmp_path / "b" / "record").read_text() if (tmp_path / "b" / "record").exists() else "") is None
        (tmp_path / "b" / "go").touch()
        assert exit_record(tmp_path / "b") == {"code": 4}, "its own keeper's word, not the forged one"
    finally:
        kill_group(mine)
        kill_group(other)


def keepers_socket(keeper: int) -> socket.socket:
    """The account keeper's end of its socket to the root keeper, taken from it as root (pidfd_getfd)."""
    import ctypes
    (fd,) = [int(f) for f in os.listdir(f"/proc/{keeper}/fd") if stat.S_ISSOCK(os.stat(f"/proc/{keeper}/fd/{f}").st_mode)]
    pidfd = os.pidfd_open(keeper)
    try:
        stolen = ctypes.CDLL(None, use_errno=True).syscall(438, pidfd, fd, 0)  # SYS_pidfd_getfd
        assert stolen >= 0, os.strerror(ctypes.get_errno())
    finally:
        os.close(pidfd)
    return socket.socket(fileno=stolen)


@root_only
@pytest.mark.parametrize("word", [b"not json", b'{"exit": "x"}', b'{"exit": [1, 2, 3]}', b'{"pid": "1"}',
                                  b'{"refused": {"code": "x"}}', b'{"pid": 7, "exit": [7, 0]}', b"[]"])
def test_a_malformed_word_from_an_account_keeper_ends_it_and_never_the_root_keeper(forker, tmp_path, word):
    os.chmod(tmp_path, 0o777)
    pid = started_as(forker, tmp_path / "a", NOBODY, "sh", "-c", "while [ ! -e go ]; do sleep 0.02; done; exit 6")
    try:
        keeper, root = parent(pid), forker.proc.pid
        with keepers_socket(keeper) as s:
            s.send(word)
        assert until(lambda: ended(keeper)), "a keeper that said what it may not is killed"
        assert forker.proc is not None and forker.proc.pid == root and forker.proc.poll() is None, "the root serves on"
        (tmp_path / "a" / "go").touch()
        assert exit_record(tmp_path / "a") == {"code": 6}, "its task, now the root keeper's, is recorded"
        nxt = started_as(forker, tmp_path / "b", NOBODY, "sh", "-c", "exit 5")
        assert exit_record(tmp_path / "b") == {"code": 5} and parent_or_none(nxt) != keeper
    finally:
        kill_group(pid)


@root_only
def test_a_pid_its_account_keeper_did_not_start_is_not_believed(forker, tmp_path):
    """The root agent signals a task's process group when it stops it: a pid an account keeper tells for a request
    must be its own child. A keeper that tells another (here a process of this test's, forged on its socket while
    it is stopped) is killed and the task refused; the process is never handed to the agent as the task."""
    import concurrent.futures

    os.chmod(tmp_path, 0o755)
    pid = started_as(forker, tmp_path / "a", NOBODY, "sleep", "30")
    keeper = parent(pid)
    victim = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        os.kill(keeper, signal.SIGSTOP)
        with keepers_socket(keeper) as s, concurrent.futures.ThreadPoolExecutor(1) as pool:
            started = pool.submit(launch_as, forker, tmp_path / "b", NOBODY, "true")
            until(lambda: readable(s))  # the root keeper's request, which the stopped account keeper cannot read
            s.send(json.dumps({"pid": victim.pid}).encode())  # the root keeper now waits for this request's answer
            assert started.result(timeout=10) == 0
        assert exit_record(tmp_path / "b") == {"code": 126, "reason": f"cannot start true: the keeper of its account "
                                                                        f"told pid {victim.pid}, which it did not start"}
        assert until(lambda: ended(keeper)), "a keeper that told a pid not its own is killed"
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()
        kill_group(pid)


def test_a_task_reaped_as_its_pid_is_checked_counts_as_gone_not_as_another_process():
    """The pid check reads ``/proc/PID/stat``: a ``true`` that its account keeper reaped at that instant shows state
    X and parent 0 (seen: 1-4 of 500 jobs in bench.e2e refused as started by "another" process). That is a task that
    ended, not a pid the keeper did not start; a live process with another parent still is."""
    assert parent_in_stat(b"25388 (true) X 0 -1 -1 0 -1 4227084 51 0 0") is None
    assert parent_in_stat(b"25388 (true) Z 4100 25388 25388 0 -1") == 4100, "a zombie names its parent"
    assert parent_in_stat(b"7 (a) b) R 9 7 7 0") == 9, "a name with ') ' in it"
    assert parent_in_stat(b"1 (init) S 0 1 1 0") == 0, "a live process whose parent is outside the namespace"
    assert parent_in_stat(b"garbled") is None and parent_in_stat(b"3 (x) S") is None
    with open(f"/proc/{os.getpid()}/stat", "rb") as f:
        assert parent_in_stat(f.read()) == os.getppid()


def readable(s: socket.socket) -> bool:
    with contextlib.suppress(BlockingIOError):
        return bool(s.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    return False


def parent_or_none(pid: int) -> int | None:
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        return parent(pid)
    return None
