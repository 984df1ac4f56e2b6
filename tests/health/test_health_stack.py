"""Health on the real stack: agents as processes, a real nats-server, faults injected where a GPU would report them."""

from __future__ import annotations

import asyncio
import signal
import time
from datetime import datetime

import httpx

from services.inventory.taskdir import read_record
from shared.eventlog import EventLog
from tests.builders import job
from tests.support import in_process_stack, nodes_up, until

SLEEPER = ("sleep", "60")


async def submit(client: httpx.AsyncClient, spec) -> str:
    r = await client.post("/v1/jobs", json=spec.model_dump(mode="json"))
    assert r.status_code == 201, r.text
    return r.json()["id"]


async def job_when(client: httpx.AsyncClient, job_id: str, cond, what: str, timeout: float = 20.0) -> dict:
    async def check():
        j = (await client.get(f"/v1/jobs/{job_id}")).json()
        return j if cond(j) else None
    return await until(check, timeout, what)


async def history(client: httpx.AsyncClient, subject: str) -> list[dict]:
    return (await client.get("/v1/events", params={"subject": subject, "limit": 1000})).json()


def kind(e: dict) -> str:
    return e["type"].split(".")[3]  # io.gpuorch.<aggregate>.<verb>.v1


def at(e: dict) -> float:
    return datetime.fromisoformat(e["time"]).timestamp()


async def test_an_xid_79_on_a_busy_gpu_cordons_its_node_and_the_job_moves_elsewhere_after_grace(eventlog: EventLog, agents):
    async with in_process_stack(eventlog) as (client, _):
        agents("a", "b")
        await nodes_up(client, 2)
        job_id = await submit(client, job("train").gpus(1).build().model_copy(update={"command": SLEEPER}))
        running = await job_when(client, job_id, lambda j: j["state"] == "running", "the job to run")
        sick_node, sick_uuid = running["placement"][0]["node"], running["placement"][0]["gpus"][0]
        gpus = (await client.get(f"/v1/nodes/{sick_node}")).json()["gpus"]
        index = next(g["index"] for g in gpus if g["uuid"] == sick_uuid)

        r = await client.post(f"/v1/nodes/{sick_node}/inject-xid", json={"gpu_index": index, "xid": 79})
        assert r.status_code == 200, r.text

        moved = await job_when(client, job_id, lambda j: j["state"] == "running" and j["placement"][0]["node"] != sick_node,
                               "the job to run on the other node")
        assert moved["preemptions"] == 1
        node = (await client.get(f"/v1/nodes/{sick_node}")).json()
        gpu = next(g for g in node["gpus"] if g["uuid"] == sick_uuid)
        assert gpu["health"] == "unhealthy" and "79" in gpu["health_reason"] and "fallen off the bus" in gpu["health_reason"]
        assert node["state"] in ("cordoned", "draining")

        steps = [(kind(e), e["data"]) for e in await history(client, f"job/{job_id}")]
        pre = next(d for k, d in steps if k == "preempting")
        assert pre["grace_s"] == 30 and f"node {sick_node} draining" in pre["reason"] and "xid 79" in pre["reason"]
        kinds = [k for k, _ in steps]
        assert kinds.index("preempting") < kinds.index("preempted") < kinds.index("queued", kinds.index("preempted"))

        async def drained():
            return [kind(e) for e in await history(client, f"node/{sick_node}")][-1] == "drained"
        await until(drained, 10, "the node to be drained")
        node_kinds = [kind(e) for e in await history(client, f"node/{sick_node}")]
        assert node_kinds[-4:] == ["unhealthy", "cordoned", "drain_requested", "drained"]


async def test_a_silent_agent_is_lost_within_t_its_job_is_requeued_and_it_rejoins_when_it_beats_again(eventlog: EventLog, agents):
    timeout_s = 2.0
    async with in_process_stack(eventlog, heartbeat_timeout_s=timeout_s) as (client, _):
        procs = {a.node_id: a for a in agents("a", "b")}
        await nodes_up(client, 2)
        spec = job("retry-me").gpus(1).build().model_copy(update={"command": SLEEPER, "max_retries": 1})
        job_id = await submit(client, spec)
        first = await job_when(client, job_id, lambda j: j["state"] == "running", "the job to run")
        silent = procs[first["placement"][0]["node"]]

        silent.signal(signal.SIGSTOP)
        stopped_at = time.time()
        try:
            async def lost():
                return next((e for e in await history(client, f"node/{silent.node_id}") if kind(e) == "lost"), None)
            event = await until(lost, 10, "node.lost")
            assert at(event) - stopped_at <= timeout_s + 1.0, "the last beat was at most 1 s before the stop"
            again = await job_when(client, job_id, lambda j: j["state"] == "running" and j["placement"][0]["node"] != silent.node_id,
                                   "the job to run on the other node")
            assert "node lost" in [e for e in await history(client, f"job/{job_id}") if kind(e) == "requeued"][0]["data"]["reason"]
        finally:
            silent.signal(signal.SIGCONT)

        async def rejoined():
            return (await client.get(f"/v1/nodes/{silent.node_id}")).json()["state"] != "lost"
        await until(rejoined, 10, "the node to register again")

        async def old_task_stopped():
            return (silent.work / "jobs" / job_id).exists() and all(
                read_record(d).reported for d in (silent.work / "jobs" / job_id).glob("*/*"))
        await until(old_task_stopped, 15, "the requeued job's old task to be stopped")
        await asyncio.sleep(0.3)  # a wrong report of that exit would fail the job right away
        now = (await client.get(f"/v1/jobs/{job_id}")).json()
        assert now["state"] == "running" and now["placement"] == again["placement"], "the old attempt's exit ended nothing"


async def test_a_job_past_its_time_limit_is_stopped_and_fails_with_the_reason(eventlog: EventLog, agents):
    async with in_process_stack(eventlog) as (client, _):
        agents("a")
        await nodes_up(client, 1)
        spec = job("overrun").gpus(1).time_limit(1).build().model_copy(update={"command": SLEEPER, "max_retries": 3})
        job_id = await submit(client, spec)
        done = await job_when(client, job_id, lambda j: j["state"] in ("failed", "succeeded"), "the job to end")
        assert (done["state"], done["reason"]) == ("failed", "time limit exceeded")

        async def exited():
            h = await history(client, f"job/{job_id}")
            return h if any(kind(e) == "task_exited" for e in h) else None
        steps = await until(exited, 10, "the task to be stopped")
        kinds = [kind(e) for e in steps]
        assert kinds.index("task_started") < kinds.index("timed_out") < kinds.index("failed") < kinds.index("task_exited")
        timed_out = steps[kinds.index("timed_out")]
        assert timed_out["data"]["grace_s"] == 30
        assert at(timed_out) - at(steps[kinds.index("task_started")]) < 1 + 2.5
        assert steps[kinds.index("task_exited")]["data"]["signal"] == signal.SIGTERM
        assert "queued" not in kinds[kinds.index("timed_out"):], "a timed-out job is never requeued"


async def test_a_running_job_whose_time_limit_is_lowered_is_stopped_at_the_new_limit(eventlog: EventLog, agents):
    """scontrol update TimeLimit on a running job: the health service enforces the limit the job has now."""
    async with in_process_stack(eventlog) as (client, _):
        agents("a")
        await nodes_up(client, 1)
        spec = job("long").gpus(1).time_limit(3600).build().model_copy(update={"command": SLEEPER})
        job_id = await submit(client, spec)
        await job_when(client, job_id, lambda j: j["state"] == "running", "the job to run")
        r = await client.patch(f"/v1/jobs/{job_id}", json={"time_limit_s": 1})
        assert r.status_code == 200 and r.json()["spec"]["time_limit_s"] == 1, r.text
        done = await job_when(client, job_id, lambda j: j["state"] in ("failed", "succeeded"), "the job to end")
        assert (done["state"], done["reason"]) == ("failed", "time limit exceeded")
