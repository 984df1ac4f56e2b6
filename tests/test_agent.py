"""The node agent as a real process: gang environment, exit codes, re-adoption after SIGKILL, grace."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
from services.inventory.taskdir import ExitRecord, read_exit, read_record
from shared import events as ev
from shared.eventlog import EventLog
from shared.events import Envelope
from tests.builders import job
from tests.support import in_process_stack, nodes_up, until


async def final(client: httpx.AsyncClient, job_id: str, states=("succeeded", "failed", "cancelled")) -> dict:
    async def check():
        j = (await client.get(f"/v1/jobs/{job_id}")).json()
        return j if j["state"] in states else None
    return await until(check, 30, f"job {job_id} to reach {states}")


PRINT_ENV = ["python3", "-c", "import os, json; print(json.dumps({k: os.environ.get(k) for k in "
             "('RANK','WORLD_SIZE','LOCAL_RANK','LOCAL_WORLD_SIZE','MASTER_ADDR','MASTER_PORT','CUDA_VISIBLE_DEVICES','GPUORCH_JOB_ID')}))"]


async def test_a_two_task_gang_runs_as_two_processes_with_a_torchrun_environment(eventlog: EventLog, agents):
    async with in_process_stack(eventlog) as (client, _):
        agents("a", "b")
        await nodes_up(client, 2)
        spec = job("envs").gpus(4).tasks(2).build().model_copy(update={"command": tuple(PRINT_ENV)})
        job_id = (await client.post("/v1/jobs", json=spec.model_dump(mode="json"))).json()["id"]
        done = await final(client, job_id)
        assert done["state"] == "succeeded", done
        envs = []
        for task in (0, 1):
            out = (await client.get(f"/v1/jobs/{job_id}/logs", params={"task": task})).json()
            envs.append(json.loads(out["data"]))
        assert [e["RANK"] for e in envs] == ["0", "1"]
        assert {e["WORLD_SIZE"] for e in envs} == {"2"}
        assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
        assert {e["GPUORCH_JOB_ID"] for e in envs} == {job_id}
        for task, e in enumerate(envs):
            placed = next(p for p in done["placement"] if p["task"] == task)
            assert e["CUDA_VISIBLE_DEVICES"].split(",") == placed["gpus"]
            assert e["LOCAL_RANK"] == "0" and e["LOCAL_WORLD_SIZE"] == "1"


async def test_a_task_exiting_3_fails_the_job_with_code_3_also_under_a_relative_work_dir(eventlog: EventLog, agents):
    async with in_process_stack(eventlog) as (client, _):
        agents("a", relative=True)  # as `gpuorch up` on its default data dir, .gpuorch
        await nodes_up(client, 1)
        spec = job("boom").gpus(1).build().model_copy(update={"command": ("sh", "-c", "echo oops >&2; exit 3")})
        job_id = (await client.post("/v1/jobs", json=spec.model_dump(mode="json"))).json()["id"]
        done = await final(client, job_id)
        assert (done["state"], done["exit_code"]) == ("failed", 3)
        err = (await client.get(f"/v1/jobs/{job_id}/logs", params={"stream": "stderr"})).json()
        assert err["data"] == "oops\n"


async def test_an_agent_killed_while_its_task_runs_re_adopts_it_and_never_starts_it_twice(eventlog: EventLog, agents):
    async with in_process_stack(eventlog) as (client, services):
        agent = agents("a")[0]
        await nodes_up(client, 1)
        cmd = ("sh", "-c", "echo run >> runs; sleep 2")  # in its work dir: it runs as its owner, not as us
        spec = job("long").gpus(1).build().model_copy(update={"command": cmd})
        job_id = (await client.post("/v1/jobs", json=spec.model_dump(mode="json"))).json()["id"]
        await until(lambda: _state_is(client, job_id, "running"), 20, "the task to start")
        agent.kill()
        agent.start()  # the same node and work dir
        done = await final(client, job_id)
        assert done["state"] == "succeeded"
        history = (await client.get(f"/v1/jobs/{job_id}/events")).json()
        assert [h["type"].split(".")[3] for h in history].count("task_started") == 1
        [marker] = agent.work.glob(f"jobs/{job_id}/*/0/work/runs")
        assert marker.read_text() == "run\n", "the command ran exactly once"


async def test_a_finished_task_leaves_its_logs_its_exit_and_one_record_of_the_agents_steps(eventlog: EventLog, agents):
    """Eight inodes a task, not nine (twelve before the record): the agent's steps and the keeper's exit are lines
    appended to one file (``taskdir``)."""
    async with in_process_stack(eventlog) as (client, _):
        agent = agents("a")[0]
        await nodes_up(client, 1)
        spec = job("short").gpus(1).build().model_copy(update={"command": ("true",)})
        job_id = (await client.post("/v1/jobs", json=spec.model_dump(mode="json"))).json()["id"]
        assert (await final(client, job_id))["state"] == "succeeded"
        [d] = agent.work.glob(f"jobs/{job_id}/*/0")
        async def recorded():
            return (r := read_record(d)).reported and r
        record = await until(recorded, 10, "the exit's acknowledgement recorded")
        assert record.started and record.pid > 1
        made = sorted(str(p.relative_to(d)) for p in d.rglob("*"))
        assert made == ["record", "stderr.log", "stdout.log", "work", "work/tmp"], made
        assert read_exit(d) == ExitRecord(0, None), "its exit, as its keeper appended it"


async def test_a_task_gone_while_its_agent_was_down_is_reported_lost(eventlog: EventLog, agents):
    async with in_process_stack(eventlog) as (client, _):
        agent = agents("a")[0]
        await nodes_up(client, 1)
        spec = job("doomed").gpus(1).build().model_copy(update={"command": ("sleep", "30")})
        job_id = (await client.post("/v1/jobs", json=spec.model_dump(mode="json"))).json()["id"]
        await until(lambda: _state_is(client, job_id, "running"), 20, "the task to start")
        agent.stop_everything()  # the node rebooted: agent and task gone
        agent.start()
        done = await final(client, job_id)
        assert done["state"] == "failed" and "lost" in done["reason"], done


async def _state_is(client, job_id: str, state: str) -> bool:
    return (await client.get(f"/v1/jobs/{job_id}")).json()["state"] == state


async def test_preemption_grace_is_honoured_and_enforced(eventlog: EventLog, agents):
    async with in_process_stack(eventlog) as (client, services):
        agents("a")
        await nodes_up(client, 1)
        polite = ("python3", "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); time.sleep(60)")
        stubborn = ("python3", "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)")
        ids = []
        for name, cmd in (("polite", polite), ("stubborn", stubborn)):
            spec = job(name).gpus(1).build().model_copy(update={"command": cmd})
            ids.append((await client.post("/v1/jobs", json=spec.model_dump(mode="json"))).json()["id"])
        for i in ids:
            await until(lambda i=i: _state_is(client, i, "running"), 20, "tasks to start")
        await asyncio.sleep(0.5)  # let the Python tasks install their handlers
        await eventlog.append_many([Envelope(ev.JobPreempting(job_id=i, reason="test", grace_s=2)) for i in ids])
        exits = {}
        for i in ids:
            async def exited(i=i):
                h = (await client.get(f"/v1/jobs/{i}/events")).json()
                pre = next((e for e in h if e["type"].endswith("job.preempting.v1")), None)
                ex = next((e for e in h if e["type"].endswith("job.task_exited.v1")), None)
                return (pre, ex) if pre and ex else None
            exits[i] = await until(exited, 20, "task exits")
        polite_pre, polite_exit = exits[ids[0]]
        stubborn_pre, stubborn_exit = exits[ids[1]]
        from datetime import datetime
        dt = lambda a, b: (datetime.fromisoformat(b["time"]) - datetime.fromisoformat(a["time"])).total_seconds()
        assert polite_exit["data"]["code"] == 0 and dt(polite_pre, polite_exit) < 2
        assert stubborn_exit["data"]["signal"] == signal.SIGKILL and dt(stubborn_pre, stubborn_exit) >= 2
        for i in ids:  # both go back to the queue and run again
            await until(lambda i=i: _state_is(client, i, "running"), 20, "the requeued job to run again")
