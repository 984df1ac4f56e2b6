"""Slurm habits on the command line, against the in-process stack: show (scontrol show job), jobs -s (squeue
--states) with EXIT, cancel by filter (scancel --name/--partition/--state), --time-limit as Slurm's --time (-t, and
-J for the name, as sbatch takes them)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import typer

from services import cli
from tests.jobfiles.test_cli import gpuorch, through_response
from tests.support import as_user, in_process_stack, nodes_up, until


async def wait_job(client, job_id: str, *states: str) -> dict:
    async def check():
        job = (await client.get(f"/v1/jobs/{job_id}")).json()
        return job if job["state"] in states else None
    return await until(check, 30, f"job {job_id} to be {'/'.join(states)}")


async def submit(*args: str) -> str:
    code, out = await gpuorch("submit", "--json", *args)
    assert code == 0, out
    return json.loads(out[out.index("{"):])["id"]


def ids_in(out: str) -> set[str]:
    return {w for w in out.split() if w.startswith("j-")}


async def test_jobs_s_takes_slurm_codes_and_show_tells_exit_codes_reasons_and_the_estimated_start(
        eventlog, agents, monkeypatch):
    agents("a")  # t4-4x: four GPUs
    async with in_process_stack(eventlog) as (client, _):
        monkeypatch.setattr(cli, "api_response", through_response(client, asyncio.get_running_loop()))
        await nodes_up(client, 1)
        ok = await submit("--name", "ok", "--", "true")
        bad = await submit("--name", "bad", "--", "sh", "-c", "exit 3")
        await wait_job(client, ok, "succeeded")
        await wait_job(client, bad, "failed")
        hog = await submit("-J", "hog", "-g", "4", "-t", "10", "--", "sleep", "60")  # sbatch's -J and -t
        hog_job = await wait_job(client, hog, "running")
        nxt = await submit("--name", "next", "-g", "4", "--", "true")
        await until(lambda: _has_reason(client, nxt), 20, "the next job to be given a reason")

        code, out = await gpuorch("jobs", "-s", "F")
        assert code == 0 and ids_in(out) == {bad}, out
        assert out.splitlines()[1].split()[7] == "3", "EXIT is the failed task's code"
        code, out = await gpuorch("jobs", "-s", "CD")
        assert ids_in(out) == {ok} and out.splitlines()[1].split()[7] == "0", out
        code, out = await gpuorch("jobs", "-t", "PD,R", "--json")  # squeue's -t
        assert {j["id"] for j in json.loads(out)} == {nxt, hog}, "PD is queued, R running"
        code, out = await gpuorch("jobs", "-s", "CD,failed", "--json")
        assert {j["id"] for j in json.loads(out)} == {ok, bad}, "Slurm codes and gpuorch's names mix"
        code, out = await gpuorch("jobs", "-s", "XX")
        assert code == 1 and "PD" in out, out
        code, out = await gpuorch("jobs", "-t", "all", "--json")  # squeue -t all
        assert {j["id"] for j in json.loads(out)} == {ok, bad, hog, nxt}, out
        code, out = await gpuorch("jobs", "-a", "-u", "admin", "--json")  # squeue -u: the owner
        assert {j["id"] for j in json.loads(out)} == {ok, bad, hog, nxt}, out
        code, out = await gpuorch("jobs", "-a", "-u", "alice", "--json")
        assert json.loads(out) == [], out

        code, out = await gpuorch("show", nxt, "--json")
        shown = json.loads(out)
        assert shown["estimated_start"] == pytest.approx(hog_job["started_at"] + 600, abs=2), \
            "the held job starts when the job before it reaches its time limit"
        code, out = await gpuorch("show", nxt)
        assert code == 0 and "estimated start:" in out and "(in " in out and "next in line" in out, out
        code, out = await gpuorch("show", bad)
        lines = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        assert lines["exit code"].strip() == "3" and lines["task exits"].strip() == "0:3", out
        history = out[out.index("events (UTC):"):].splitlines()[1:]  # as kubectl describe's Events
        assert [line.split()[1] for line in history] == ["job.submitted", "job.queued", "job.placed",
                                                         "job.task_started", "job.task_exited", "job.failed"], out
        assert history[4].split(None, 2)[2] == "task 0 on a: code 3" and "task 0 exited with code 3" in history[5], out
        assert lines["command"].strip() == "sh -c 'exit 3'" and lines["state"].strip() == "failed", out
        assert re.fullmatch(r"node a, 1 GPU\(s\): [0-7]", lines["task 0"].strip()), out  # its index: which is free
        assert lines["time limit"].strip() == "none" and lines["retries"].strip() == "0 of 0", out
        code, out = await gpuorch("show", hog)
        assert "00:10:00" in out and "hog" in out, "a bare -t is minutes, as Slurm's --time; -J names the job"
        await client.delete(f"/v1/jobs/{hog}")


async def _has_reason(client, job_id: str) -> bool:
    return bool((await client.get(f"/v1/jobs/{job_id}")).json()["reason"])


async def test_cancel_takes_filters_cancels_only_what_matches_and_the_caller_may_cancel(eventlog, monkeypatch):
    from shared import events as ev
    from shared.events import Envelope
    from tests.builders import node

    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        await eventlog.append_many([Envelope(ev.NodeRegistered(node_id="n0", node=node("n0").gpus(8).build()))])
        await nodes_up(client, 1)
        alice, bob = await as_user(client, "alice", role="operator"), await as_user(client, "bob")  # she sees his
        monkeypatch.setattr(cli, "api_response", through_response(alice, asyncio.get_running_loop()))
        sweeps = [await submit("--name", "sweep", "-g", "8", "--", "true") for _ in range(3)]  # one placed, two wait
        other = await submit("--name", "eval", "-g", "8", "--", "true")
        body = {"name": "sweep", "command": ["true"], "resources": {"gpus": 8}}
        bobs = (await bob.post("/v1/jobs", json=body)).json()["id"]
        await until(lambda: _placed(client, sweeps[0]), 20, "the first sweep to be placed")

        code, out = await gpuorch("cancel")
        assert code == 1 and "give a job id, or filters" in out, out
        code, out = await gpuorch("cancel", sweeps[0], "--name", "sweep")
        assert code == 1 and "not both" in out, out
        code, out = await gpuorch("cancel", "--state", "CD,F")
        assert code == 1 and "only unfinished jobs" in out, out

        code, out = await gpuorch("cancel", "--name", "sweep", "--state", "PD")
        assert code == 0 and "cancelled 2 job(s); 1 could not be" in out, out
        states = {j: (await client.get(f"/v1/jobs/{j}")).json()["state"] for j in [*sweeps, other, bobs]}
        assert states == {sweeps[0]: "placed", sweeps[1]: "cancelled", sweeps[2]: "cancelled", other: "queued",
                          bobs: "queued"}, "only alice's pending sweeps: not her placed one, her eval, nor bob's"

        code, out = await gpuorch("cancel", "--queue", "default")
        assert code == 0 and "cancelled 2 job(s); 1 could not be" in out, out
        assert (await client.get(f"/v1/jobs/{bobs}")).json()["state"] in ("queued", "placed"), "bob's is his to cancel"
        code, out = await gpuorch("cancel", "--name", "sweep")
        assert code == 0 and "cancelled 0 job(s)" in out, out


async def _placed(client, job_id: str) -> bool:
    return (await client.get(f"/v1/jobs/{job_id}")).json()["state"] == "placed"


@pytest.mark.parametrize("text, seconds", [
    ("90", 5400), ("10:30", 630), ("01:30:00", 5400), ("1-00:00", 86400), ("2-12", 216000), ("1-00:00:30", 86430),
    ("1h", 3600), ("90m", 5400), ("45s", 45), ("1h30m", 5400), ("UNLIMITED", None), ("0", None),
], ids=lambda v: str(v))
def test_time_limit_reads_slurm_times_and_durations(text: str, seconds: int | None):
    assert cli.time_limit_s(text) == seconds


def test_a_time_limit_it_cannot_read_names_the_forms_it_takes():
    with pytest.raises(typer.Exit):
        cli.time_limit_s("ten minutes")


def test_show_and_jobs_name_the_signal_that_ended_a_task():
    """A gang's peer stopped when another task failed reads SIGTERM (the API's -15), never None."""
    job = {"id": "j-1", "name": "x", "queue": "default", "priority": "normal", "state": "failed", "reason": "",
           "exit_code": None, "task_exits": {"0": -15, "1": 127, "2": None, "3": -77}}
    lines = dict(cli.job_lines(job, 0.0))
    assert lines["task exits"] == "0:SIGTERM, 1:127, 2:unknown, 3:signal 77"
    assert lines["exit code"] == "127"
    killed = {**job, "task_exits": {"0": -9}}
    assert dict(cli.job_lines(killed, 0.0))["exit code"] == "SIGKILL"
    # a task killed after its peer had ended cleanly: the job's exit is the kill, not the peer's 0
    assert dict(cli.job_lines({**job, "task_exits": {"0": 0, "1": -9}}, 0.0))["exit code"] == "SIGKILL"
    assert dict(cli.job_lines({**job, "state": "succeeded", "task_exits": {"0": 0, "1": 0}}, 0.0))["exit code"] == "0"


def test_show_names_a_task_s_gpus_by_index_in_ranges_else_by_the_start_of_their_uuid():
    """It printed every full UUID, joined by commas, wrapped over three lines for an 8-GPU task."""
    uuids = [f"GPU-{i:08x}-5a45-a896-ff26b982f551" for i in range(8)]
    assert cli.gpu_list({"gpus": uuids, "indexes": list(range(8))}) == "0-7"
    assert cli.gpu_list({"gpus": uuids[:5], "indexes": [6, 0, 1, 3, 2]}) == "0-3,6"
    assert cli.gpu_list({"gpus": uuids[:1], "indexes": [4], "shares": [500]}) == "4 (0.5 of a GPU)"
    assert cli.gpu_list({"gpus": uuids[:2], "indexes": [0, None]}) == "GPU-00000000, GPU-00000001"
    assert cli.gpu_list({"gpus": uuids[:1]}) == "GPU-00000000"  # an API older than indexes


def test_a_job_s_history_line_says_what_happened_and_marks_an_earlier_attempt_s_task():
    def rec(seq, kind, **data):
        return {"seq": seq, "type": f"io.gpuorch.job.{kind}.v1", "time": "2026-11-28T10:40:24.614322Z",
                "data": {"job_id": "j-1", **data}}
    placed = rec(7, "placed", placements=[{"task": 1, "node_id": "b"}, {"task": 0, "node_id": "a"}])
    assert cli.history_line(placed, 7) == "10:40:24  job.placed         on a, b"
    assert cli.history_line({**rec(5, "submitted"), "gpuorchactor": "ann"}) == "10:40:24  job.submitted      (by ann)"
    exited = rec(9, "task_exited", task=0, node_id="a", code=None, signal=15, reason="", attempt=3)
    assert cli.history_line(exited, 7) == "10:40:24  job.task_exited    task 0 on a: SIGTERM (an earlier attempt)"
    assert cli.history_line(exited, 3) == "10:40:24  job.task_exited    task 0 on a: SIGTERM"
    lost = rec(8, "requeued", reason="node lost: a (retry 1 of 1)")
    assert cli.history_line(lost, 3) == "10:40:24  job.requeued       node lost: a (retry 1 of 1)"
