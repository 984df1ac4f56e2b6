"""Tasks are contained: their job's environment only, their owner's account, no reach into the agent's files."""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.inventory.agent import Agent
from services.inventory.work import WorkOrder
from services.inventory.runas import RunAs, RunAsRefused, UserMap, UserMapError, load_user_map, resolve
from services.inventory.taskenv import SHIMS
from services.inventory.taskdir import (ExitRecord, LogNotFound, StateUnreadable, TaskRecord, append_record, has_record,
                                        make_task_dir, make_workspace, read_exit, read_record, read_task_log)
from shared import events as ev
from shared.eventlog import EventLog
from shared.profiles import build
from tests.builders import job
from tests.support import AgentProc, as_user, in_process_stack, nodes_up, until

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="switching a task's user needs a root agent")
DOCUMENTED = {"CUDA_VISIBLE_DEVICES", "GPUORCH_JOB_ID", "GPUORCH_ATTEMPT", "GPUORCH_GPU_SHARES", "MASTER_ADDR",
              "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
              "SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_NAME", "SLURM_JOB_PARTITION", "SLURM_PROCID", "SLURM_NTASKS",
              "SLURM_NPROCS", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_NODEID", "SLURM_LOCALID",
              "SLURM_NTASKS_PER_NODE"}
BASE = {"PATH", "HOME", "TMPDIR", "USER", "LOGNAME", "LANG"}
PRINT_ENV_AND_WAIT = ("python3", "-c", "import os, json, sys, time; print(json.dumps(dict(os.environ))); "
                      "sys.stdout.flush(); time.sleep(60)")


@pytest.fixture
def agent_with(tmp_path: Path, nats_url: str):
    """``agent_with("a", "--user-map", path)``: a simulated agent process with more options."""
    made: list[AgentProc] = []

    def make(node_id: str, *args: str) -> AgentProc:
        work = tmp_path / "agents" / node_id
        work.mkdir(parents=True)
        made.append(AgentProc(nats_url, node_id, work, args=args).start())
        return made[-1]

    yield make
    for a in made:
        a.stop_everything()


@pytest.fixture
def local_user():
    """A system account made for this test (and removed after it): a job owner with a local account."""
    name = f"gpuorch-t-{os.urandom(3).hex()}"
    subprocess.run(["useradd", "--system", "--no-create-home", name], check=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False)


async def submit(client, name: str, command: tuple[str, ...], **spec) -> str:
    body = job(name).gpus(1).build().model_copy(update={"command": command, **spec}).model_dump(mode="json")
    r = await client.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    return r.json()["id"]


async def final(client, job_id: str) -> dict:
    async def check():
        j = (await client.get(f"/v1/jobs/{job_id}")).json()
        return j if j["state"] in ("succeeded", "failed", "cancelled") else None
    return await until(check, 30, f"job {job_id} to end")


def output(agent: AgentProc, job_id: str, stream: str = "stdout") -> str:
    try:
        return read_task_log(agent.work, job_id, None, 0, stream, 0, 1 << 20)["data"]
    except LogNotFound:
        return ""


def task_dir(agent: AgentProc, job_id: str) -> Path:
    [d] = agent.work.glob(f"jobs/{job_id}/*/0")
    return d


async def test_a_task_gets_its_jobs_environment_and_nothing_of_its_agents(eventlog: EventLog, agents, monkeypatch):
    monkeypatch.setenv("GPUORCH_TEST_SECRET", "leak")  # in the agent's environment, not the job's
    async with in_process_stack(eventlog) as (client, _):
        agent = agents("a")[0]
        await nodes_up(client, 1)
        job_id = await submit(client, "env", PRINT_ENV_AND_WAIT,
                              env={"EPOCHS": "3", "RANK": "99", "HF_TOKEN": "hf-1", "LD_PRELOAD": "/no/such.so"})
        env = json.loads(await until(lambda: _line(agent, job_id), 20, "the task to print its environment"))
        assert "GPUORCH_TEST_SECRET" not in env
        assert set(env) == BASE | DOCUMENTED | {"EPOCHS", "HF_TOKEN", "LD_PRELOAD"}, set(env) ^ (BASE | DOCUMENTED)
        assert (env["EPOCHS"], env["HF_TOKEN"]) == ("3", "hf-1"), "a job's secret env reaches its task too"
        assert env["RANK"] == "0" and env["GPUORCH_JOB_ID"] == job_id, "the documented variables win over the job's"
        d = task_dir(agent, job_id)
        assert (env["HOME"], env["TMPDIR"], env["LANG"]) == (str(d / "work"), str(d / "work" / "tmp"), "C.UTF-8")
        assert env["PATH"].split(":")[:2] == [SHIMS, os.path.dirname(sys.executable)], "gpuorch's srun, then python3"
        expected_user = "nobody" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        assert env["USER"] == env["LOGNAME"] == expected_user
        task = read_record(d).pid
        keeper = next(int(line.split()[1]) for line in Path(f"/proc/{task}/status").read_text().splitlines()
                      if line.startswith("PPid:"))
        assert b"--serve" in Path(f"/proc/{keeper}/cmdline").read_bytes(), "the task is its keeper's child"
        assert not any(v.startswith((b"LD_PRELOAD=", b"EPOCHS=", b"HF_TOKEN=")) for v in
                       Path(f"/proc/{keeper}/environ").read_bytes().split(b"\0")), \
            "the keeper (the agent's user) never gets the job's variables"
        assert not (d / "env.json").exists(), "the keeper removes the task's environment once read"
        assert (await client.delete(f"/v1/jobs/{job_id}")).status_code == 200


async def _line(agent: AgentProc, job_id: str) -> str | None:
    out = output(agent, job_id)
    return out.splitlines()[0] if out.endswith("\n") else None


@root_only
async def test_a_root_agent_runs_a_task_as_its_owner_in_a_work_dir_of_its_own(eventlog: EventLog, agents, local_user):
    async with in_process_stack(eventlog) as (client, _):
        agent = agents("a")[0]
        await nodes_up(client, 1)
        owner = await as_user(client, local_user.pw_name)
        job_id = await submit(owner, "whoami", ("sh", "-c", "id -u; id -g; id -G; touch made-here"))
        done = await final(client, job_id)
        assert done["state"] == "succeeded", (done, output(agent, job_id, "stderr"))
        uid, gid, groups = output(agent, job_id).split("\n")[:3]
        assert (int(uid), int(gid)) == (local_user.pw_uid, local_user.pw_gid)
        assert sorted(map(int, groups.split())) == sorted(set(os.getgrouplist(local_user.pw_name, local_user.pw_gid)))
        d = task_dir(agent, job_id)
        work = (d / "work").stat()
        assert (work.st_uid, work.st_gid, stat.S_IMODE(work.st_mode)) == (local_user.pw_uid, local_user.pw_gid, 0o700)
        assert (d / "work" / "made-here").stat().st_uid == local_user.pw_uid
        for agents_own in (d, d.parent, d.parent.parent, agent.work / "jobs"):
            st = agents_own.lstat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o711), f"{agents_own}: the task can only pass through"
        for log in ("stdout.log", "stderr.log"):
            st = (d / log).lstat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600), f"{log}: the agent's alone"


@root_only
async def test_an_owner_with_no_account_fails_its_job_with_the_reason_and_runs_nothing(
        eventlog: EventLog, agent_with, tmp_path):
    users = tmp_path / "users.yaml"
    users.write_text("users: {}\ndefault: null\n")
    async with in_process_stack(eventlog) as (client, _):
        agent = agent_with("n1", "--user-map", str(users))
        await nodes_up(client, 1)
        stranger = await as_user(client, "gpuorch-no-such-user")
        job_id = await submit(stranger, "stranger", ("sh", "-c", "touch ran"))
        done = await final(client, job_id)
        assert (done["state"], done["exit_code"]) == ("failed", 126)
        assert "no local account for owner 'gpuorch-no-such-user' on node n1: add it to the user map" in done["reason"]
        history = [h["type"].split(".")[3] for h in (await client.get(f"/v1/jobs/{job_id}/events")).json()]
        assert (history.count("task_started"), history.count("task_exited")) == (0, 1)
        assert not (task_dir(agent, job_id) / "work").exists()


@root_only
async def test_an_owner_resolving_to_root_is_refused(eventlog: EventLog, agents):
    async with in_process_stack(eventlog) as (client, _):
        agent = agents("a")[0]
        await nodes_up(client, 1)
        root = await as_user(client, "root")
        job_id = await submit(root, "as-root", ("sh", "-c", "touch ran"))
        done = await final(client, job_id)
        assert (done["state"], done["exit_code"]) == ("failed", 126)
        assert "owner 'root' would run as root on node a" in done["reason"] and "--allow-root-tasks" in done["reason"]
        assert not (task_dir(agent, job_id) / "work").exists()


@root_only
async def test_a_task_cannot_replace_its_logs_with_a_link(eventlog: EventLog, agents, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("TOPSECRET\n")
    secret.chmod(0o600)
    async with in_process_stack(eventlog) as (client, _):
        agent = agents("a")[0]
        await nodes_up(client, 1)
        steal = f"ln -sf {secret} ../stderr.log; ln -sf {secret} stderr.log; echo tried"
        job_id = await submit(client, "steal", ("sh", "-c", steal))
        await final(client, job_id)
        d = task_dir(agent, job_id)
        assert stat.S_ISREG((d / "stderr.log").lstat().st_mode)
        err = output(agent, job_id, "stderr")
        assert "Permission denied" in err and "TOPSECRET" not in err
        (d / "stderr.log").unlink()  # were a link there anyway (planted as root), the API would not follow it
        (d / "stderr.log").symlink_to(secret)
        r = await client.get(f"/v1/jobs/{job_id}/logs", params={"stream": "stderr"})
        assert r.status_code == 404 and "TOPSECRET" not in r.text, r.text


# --- reading logs and records: a planted link, FIFO or path never steers a read ------------------------------


@pytest.fixture
def task(tmp_path: Path) -> Path:
    d = make_task_dir(tmp_path / "work", "j-1", 3, 0)
    make_workspace(d, None)
    (d / "stdout.log").write_bytes(b"0123456789")
    return d


def test_a_log_is_read_from_an_offset_up_to_a_limit(task: Path):
    assert read_task_log(task.parents[3], "j-1", None, 0, "stdout", 2, 5) == {
        "task": 0, "attempt": 3, "stream": "stdout", "offset": 2, "next_offset": 7, "data": "23456"}


def test_a_log_is_read_from_its_end_and_a_chunk_never_cuts_a_character(task: Path):
    work = task.parents[3]
    assert read_task_log(work, "j-1", None, 0, "stdout", 0, 4, tail=True)["data"] == "6789"
    assert read_task_log(work, "j-1", None, 0, "stdout", 0, 100, tail=True)["offset"] == 0
    text = "a\u00e9\u20ac\U0001f600b"  # 1, 2, 3, 4 and 1 bytes
    (task / "stdout.log").write_text(text, encoding="utf-8")
    for limit in range(4, 12):
        read, offset = [], 0
        while chunk := read_task_log(work, "j-1", None, 0, "stdout", offset, limit)["data"]:
            read.append(chunk)
            offset = read_task_log(work, "j-1", None, 0, "stdout", offset, limit)["next_offset"]
        assert "".join(read) == text and "\ufffd" not in "".join(read), limit
    assert read_task_log(work, "j-1", None, 0, "stdout", 1, 1)["next_offset"] == 2, "less than a character: as is"


def test_a_log_that_is_a_link_is_not_followed(task: Path, tmp_path: Path):
    (tmp_path / "secret").write_text("TOPSECRET")
    (task / "stderr.log").symlink_to(tmp_path / "secret")
    with pytest.raises(LogNotFound, match="symbolic links"):
        read_task_log(task.parents[3], "j-1", 3, 0, "stderr", 0, 100)


def test_a_task_directory_that_is_a_link_is_not_followed(task: Path, tmp_path: Path):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "3" / "0").mkdir(parents=True)
    (elsewhere / "3" / "0" / "stdout.log").write_text("TOPSECRET")
    (task.parents[3] / "jobs" / "j-2").symlink_to(elsewhere)
    with pytest.raises(LogNotFound):
        read_task_log(task.parents[3], "j-2", 3, 0, "stdout", 0, 100)
    with pytest.raises(LogNotFound):
        read_task_log(task.parents[3], "j-2", None, 0, "stdout", 0, 100)


def test_a_fifo_in_place_of_a_log_is_refused_without_blocking(task: Path):
    fifo = task / "stderr.log"
    os.mkfifo(fifo)
    outcome: list[BaseException | dict] = []
    reader = threading.Thread(target=lambda: outcome.append(_try(read_task_log, task.parents[3], "j-1", 3, 0,
                                                                 "stderr", 0, 100)), daemon=True)
    reader.start()
    reader.join(5)
    assert not reader.is_alive(), "reading a FIFO blocked"
    assert isinstance(outcome[0], LogNotFound) and "not a regular file" in str(outcome[0])


def _try(f, *args):
    try:
        return f(*args)
    except Exception as e:  # noqa: BLE001 - handed back to the test
        return e


@pytest.mark.parametrize("job_id", ["../../outside", "../j-1", "j-1/../j-1", "J-1", "", "j-1\0"])
def test_a_job_id_that_is_not_one_never_reaches_the_file_system(task: Path, tmp_path: Path, job_id: str):
    planted = tmp_path / "outside" / "3" / "0"
    planted.mkdir(parents=True)
    (planted / "stdout.log").write_text("TOPSECRET")
    with pytest.raises(LogNotFound, match="not a job id"):
        read_task_log(task.parents[3], job_id, 3, 0, "stdout", 0, 100)


async def test_an_agent_keeps_a_bounded_number_of_ended_jobs_and_never_forgets_one_placed_again(tmp_path: Path,
                                                                                                  monkeypatch):
    import services.inventory.agent as agent_module
    monkeypatch.setattr(agent_module, "ENDED_KEPT", 3)
    agent = Agent(build("t4-4x", "n1"), tmp_path / "work")

    async def word(seq: int, job_id: str, ended: bool) -> None:
        w = WorkOrder(seq=seq, job_id=job_id, ended=ended)
        await agent.take(f"gpuorch.work.n1.{job_id}", w.model_dump_json().encode())

    for i in range(3):
        await word(10 + i, f"j-{i}", ended=True)
    await word(20, "j-0", ended=False)  # requeued and placed here again: running, not ended
    await word(21, "j-3", ended=True)
    await word(22, "j-4", ended=True)
    assert sorted(agent.orders) == ["j-0", "j-2", "j-3", "j-4"], "the earliest ended (j-1) forgotten; j-0 kept"
    assert not agent.orders["j-0"].ended
    await word(11, "j-2", ended=False)  # a redelivered older word of a kept ended job
    assert agent.orders["j-2"].ended and agent.orders["j-2"].seq == 12
    await word(30, "j-2", ended=True)  # a later word that it ended: it counts from this end
    await word(31, "j-0", ended=True)
    await word(32, "j-5", ended=True)
    assert sorted(agent.orders) == ["j-0", "j-2", "j-5"], "each counts from its latest end: j-3, j-4 forgotten"


async def test_a_forged_job_id_makes_the_agent_create_nothing(tmp_path: Path):
    node = build("t4-4x", "n1")
    agent = Agent(node, tmp_path / "work")
    forged = "../../../../forged"
    order = WorkOrder.model_construct(seq=1, job_id=forged, attempt=1, owner="", spec=job("x").gpus(1).build(),
                                      placements=[ev.TaskPlacement(task=0, node_id="n1", gpus=(
                                          ev.GpuShare(uuid=node.gpus[0].uuid, milli=1000),))], addresses={})
    await agent.start(order, 0)
    assert list(tmp_path.iterdir()) == [], "nothing created, inside the work dir or out of it"
    assert agent.tasks == {}


@pytest.mark.parametrize("plant, why", [
    (lambda d: (d / "exit.json").write_text("{not json"), "not JSON"),
    (lambda d: (d / "exit.json").write_text("[0]"), "not an object"),
    (lambda d: (d / "exit.json").write_text('{"code": "0"}'), "must be integers"),
    (lambda d: (d / "exit.json").write_text(" " * 5000), "over 4096 bytes"),
    (lambda d: (d / "exit.json").symlink_to(d / "real.json"), "symbolic links"),
    (lambda d: os.mkfifo(d / "exit.json"), "not a regular file"),
], ids=["garbled", "a list", "a string code", "huge", "a link", "a fifo"])
def test_an_exit_record_that_cannot_be_trusted_is_unreadable(task: Path, plant, why: str):
    (task / "real.json").write_text('{"code": 0}')
    plant(task)
    with pytest.raises(StateUnreadable, match=why):
        read_exit(task)


def test_the_agents_record_of_a_task_is_its_appended_steps_and_a_line_cut_short_is_skipped(task: Path):
    assert read_record(task) == TaskRecord() and not has_record(task)
    append_record(task, "started", pid=4242, at=1.0)
    with open(task / "record", "ab") as f:
        f.write(b'\n{"step": "reported", "co')  # a write cut short (a full disk, a power loss)
    assert read_record(task) == TaskRecord(started=True, pid=4242) and has_record(task)
    append_record(task, "start_reported")
    append_record(task, "reported", code=0, signal=None)
    assert read_record(task) == TaskRecord(started=True, pid=4242, start_reported=True, reported=True)


@pytest.mark.parametrize("line, why", [
    (b'{"step": "exited", "code": "0"}', "record: exited: code and signal must be integers"),
    (b'{"step": "exited", "code": 0, "reason": "' + b"x" * 20000 + b'"}', "record is over 16384 bytes"),
], ids=["a string code", "huge"])
def test_an_exit_in_the_record_that_cannot_be_trusted_is_unreadable(task: Path, line: bytes, why: str):
    (task / "exit.json").write_text('{"code": 0}')  # an older keeper's file does not stand in for it
    with open(task / "record", "ab") as f:
        f.write(b"\n" + line)
    with pytest.raises(StateUnreadable, match=why):
        read_exit(task)


def test_a_tasks_exit_is_the_first_exited_step_of_its_record_and_else_an_older_keepers_file(task: Path):
    assert read_exit(task) is None
    (task / "exit.json").write_text('{"code": 3}')  # an older keeper, still running under an upgraded agent
    assert read_exit(task) == ExitRecord(3, None)
    append_record(task, "started", pid=4242, at=1.0)
    with open(task / "record", "ab") as f:  # the keeper's line, as launcher._record writes it
        f.write(b'\n{"step": "exited", "signal": 9}')
    append_record(task, "exited", code=1)  # a second exit step never rewrites the first
    assert read_exit(task) == ExitRecord(None, 9)
    assert read_record(task) == TaskRecord(started=True, pid=4242)


def test_a_refusal_reason_is_cut_so_that_the_record_stays_readable(tmp_path: Path):
    from services.inventory.launcher import _record
    assert _record(str(tmp_path / "record"), {"code": 126, "reason": "cannot start " + "\u00e9" * 5000})
    ended = read_exit(tmp_path)
    assert ended is not None and ended.code == 126 and len(ended.reason) == 500


def test_the_agents_record_is_never_written_through_a_link_or_into_a_fifo(task: Path):
    (task / "record").symlink_to(task / "elsewhere")
    with pytest.raises(OSError):
        append_record(task, "started", pid=1, at=1.0)
    assert not (task / "elsewhere").exists()
    (task / "record").unlink()
    os.mkfifo(task / "record")
    with pytest.raises(OSError):  # no reader: refused at once, never waited on
        append_record(task, "started", pid=1, at=1.0)


async def test_an_agent_upgraded_under_a_running_task_adopts_what_an_older_agent_recorded(tmp_path: Path):
    """Before the record, each step was a file of its own (pid, started, start_reported, reported)."""
    agent = Agent(build("t4-4x", "n1"), tmp_path / "work")
    live = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        running = make_task_dir(agent.work_dir, "j-running", 1, 0)
        (running / "pid").write_text(str(live.pid))
        (running / "started").write_text("1.0")
        done = make_task_dir(agent.work_dir, "j-done", 1, 0)
        for name, text in (("pid", "999999"), ("started", "1.0"), ("start_reported", ""), ("reported", "{}")):
            (done / name).write_text(text)
        assert read_record(running) == TaskRecord(started=True, pid=live.pid) and has_record(done)
        await agent.adopt()
        assert list(agent.tasks) == ["j-running-1-0"] and agent.tasks["j-running-1-0"].pid == live.pid
        append_record(running, "start_reported")  # what this agent records once its start report is acknowledged
        assert read_record(running) == TaskRecord(started=True, pid=live.pid, start_reported=True), \
            "the next restart still adopts it: steps appended since read with the older agent's files"
        assert live.wait(5) == -signal.SIGTERM, "its job is not known here: stopped, by the pid the old file held"
    finally:
        live.kill()
        live.wait()


async def test_a_corrupt_exit_record_is_reported_lost_and_the_next_task_still_reported(eventlog: EventLog, agents):
    async with in_process_stack(eventlog) as (client, _):
        agent = agents("a")[0]
        await nodes_up(client, 1)
        first = await submit(client, "corrupt", ("sleep", "60"))
        d = await until(lambda: _started(agent, first), 20, "the first task to start")
        with open(d / "record", "ab") as f:  # an exit step that is not one, before its keeper's
            f.write(b'\n{"step": "exited", "code": "0"}')
        os.killpg(read_record(d).pid, signal.SIGKILL)
        done = await final(client, first)
        assert done["state"] == "failed" and "exit record is unreadable" in done["reason"], done
        second = await submit(client, "next", ("true",))
        assert (await final(client, second))["state"] == "succeeded", "the reaper lives on"


async def _started(agent: AgentProc, job_id: str) -> Path | None:
    found = list(agent.work.glob(f"jobs/{job_id}/*/0"))
    return found[0] if found and read_record(found[0]).pid else None


# --- which account: the user map, the system, the default, never root unless allowed ------------------------

NOBODY = pwd.getpwnam("nobody")
MAP = UserMap(users={"alice": {"uid": 1001, "gid": 1001, "groups": [2000]}, "zero": {"uid": 1002, "gid": 0}})


@pytest.mark.parametrize("owner, user_map, allow_root, expected", [
    ("alice", MAP, False, RunAs("alice", 1001, 1001, (2000,))),
    ("nobody", None, False, RunAs("nobody", NOBODY.pw_uid, NOBODY.pw_gid,
                                  tuple(os.getgrouplist("nobody", NOBODY.pw_gid)))),
    ("gpuorch-no-such-user", None, False, "nobody"),
    ("", MAP, False, "nobody"),
    ("root", None, True, RunAs("root", 0, 0, tuple(os.getgrouplist("root", 0)))),
    ("root", UserMap(allow_root=True), False, "root"),
    ("gpuorch-no-such-user", UserMap(default=None), False, "no local account for owner 'gpuorch-no-such-user' on "
                                                           "node n1: add it to the user map"),
    ("gpuorch-no-such-user", UserMap(default="gpuorch-nor-this"), False, "nor the default account 'gpuorch-nor-this'"),
    ("", UserMap(default=None), False, "no local account for a job submitted before users existed (no owner)"),
    ("root", MAP, False, "owner 'root' would run as root on node n1"),
    ("zero", MAP, False, "owner 'zero' would run as root on node n1 (account 'zero', uid 1002, gid 0)"),
], ids=["mapped", "system account", "unknown: default", "no owner: default", "root allowed by flag",
        "root allowed by map", "no default", "default missing", "no owner, no default", "root", "gid 0"])
def test_an_owner_resolves_to_an_account_or_a_reason(owner, user_map, allow_root, expected):
    if isinstance(expected, RunAs):
        assert resolve(owner, "n1", user_map, allow_root) == expected
    elif expected in ("nobody", "root"):
        assert resolve(owner, "n1", user_map, allow_root).name == expected
    else:
        with pytest.raises(RunAsRefused, match=re.escape(expected)):
            resolve(owner, "n1", user_map, allow_root)


@pytest.mark.parametrize("text, why", [
    ("users: {alice: {uid: 1001}}", "users.alice.gid: Field required"),
    ("users: {alice: {uid: -1, gid: 1}}", "users.alice.uid: Input should be greater than or equal to 0"),
    ("defualt: nobody", "defualt: Extra inputs are not permitted"),
    ("users: [", "cannot read the user map"),
], ids=["no gid", "negative uid", "a typo", "not YAML"])
def test_a_user_map_that_does_not_fit_says_where(tmp_path: Path, text: str, why: str):
    f = tmp_path / "users.yaml"
    f.write_text(text)
    with pytest.raises(UserMapError, match=why):
        load_user_map(f)


# --- making a task's directories: modes enforced, and nothing written that is already so ------------------


def test_task_directories_get_their_modes_under_any_umask_and_a_wrong_mode_is_corrected(tmp_path: Path):
    (tmp_path / "work" / "jobs" / "j-1").mkdir(parents=True)
    (tmp_path / "work" / "jobs" / "j-1").chmod(0o777)  # left so by someone: corrected
    old = os.umask(0o077)  # would make 0o711 into 0o700: the agent's mode is set after the mkdir
    try:
        d = make_task_dir(tmp_path / "work", "j-1", 3, 0)
        make_workspace(d, None)
    finally:
        os.umask(old)
    for path, mode in [(d.parents[1], 0o711), (d.parent, 0o711), (d, 0o711), (d / "work", 0o700),
                       (d / "work" / "tmp", 0o700)]:
        assert stat.S_IMODE(path.stat().st_mode) == mode, path


def test_making_an_existing_task_directory_again_writes_no_metadata(tmp_path: Path):
    """A mode or owner is changed only where it differs: on this VM's ext4 each change is a journal write, and
    the agent made eight a task (a chmod of every directory on the path, each time)."""
    d = make_task_dir(tmp_path / "work", "j-1", 3, 0)
    make_workspace(d, None)
    before = [p.stat().st_ctime_ns for p in (d, d / "work", d / "work" / "tmp")]
    time.sleep(0.05)  # past the file-system clock's tick: a chmod now would show in the ctime
    make_task_dir(tmp_path / "work", "j-1", 3, 0)
    make_workspace(d, None)
    assert [p.stat().st_ctime_ns for p in (d, d / "work", d / "work" / "tmp")] == before
