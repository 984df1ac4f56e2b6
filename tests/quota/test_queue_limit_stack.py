"""A queue's limit holds on the real stack: real agents, a real nats-server, the scheduler's own cycles."""

from __future__ import annotations

from shared.eventlog import EventLog
from tests.builders import job
from tests.support import in_process_stack, nodes_up, until


async def test_a_queue_limited_to_one_gpu_runs_one_of_three_one_gpu_jobs_and_the_others_wait_with_the_reason(
        eventlog: EventLog, agents):
    async with in_process_stack(eventlog) as (client, _):
        agents("a")  # 4 T4 GPUs: room for all three, but for the limit
        await nodes_up(client, 1)
        r = await client.put("/v1/queues/research", json={"limit": {"gpus": 1}})
        assert r.status_code == 200, r.text
        ids = []
        for i in range(3):
            spec = job(f"j{i}").gpus(1).queue("research").command("sleep", "30").build()
            r = await client.post("/v1/jobs", json=spec.model_dump(mode="json"))
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])

        async def settled():
            jobs = [(await client.get(f"/v1/jobs/{i}")).json() for i in ids]
            waiting = [j for j in jobs if j["state"] == "queued" and j["reason"]]
            running = [j for j in jobs if j["state"] == "running"]
            return (running, waiting) if len(running) == 1 and len(waiting) == 2 else None

        running, waiting = await until(settled, 30, "one job to run and two to wait with a reason")
        assert all("research at its limit of 1 GPU" in j["reason"] for j in waiting), [j["reason"] for j in waiting]
        queue = {q["path"]: q for q in (await client.get("/v1/queues")).json()}["research"]
        assert queue["allocated"]["gpus"] == 1
        await client.delete(f"/v1/jobs/{running[0]['id']}")

        async def next_one_runs():
            states = [(await client.get(f"/v1/jobs/{i}")).json()["state"] for i in ids]
            return states.count("running") == 1 and states.count("cancelled") == 1
        await until(next_one_runs, 30, "a waiting job to take the freed place, and only one")
