"""Borrowing and reclaim on the real stack: real agents run the tasks, a real nats-server holds the log."""

from __future__ import annotations

import time

import httpx

from shared.eventlog import EventLog
from tests.builders import job
from tests.support import in_process_stack, until


async def put_queue(client: httpx.AsyncClient, path: str, body: dict) -> None:
    r = await client.put(f"/v1/queues/{path}", json=body)
    assert r.status_code == 200, r.text


async def submit(client, name: str, queue: str, seconds: float) -> str:
    spec = job(name).gpus(1).queue(queue).build().model_copy(update={"command": ("sleep", str(seconds))})
    r = await client.post("/v1/jobs", json=spec.model_dump(mode="json"))
    assert r.status_code == 201, r.text
    return r.json()["id"]


async def held(client, queue: str) -> float:
    rows = {q["path"]: q for q in (await client.get("/v1/queues")).json()}
    return rows[queue]["allocated"]["gpus"]


async def test_a_borrower_gives_back_the_guarantee_within_grace_and_nothing_is_lost(eventlog: EventLog, agents):
    async with in_process_stack(eventlog, reclaim_grace_s=1) as (client, services):
        agents("a", "b")  # 2 x 4 T4 GPUs
        await until(lambda: _n_nodes(client, 2), 30, "agents to register")
        await put_queue(client, "research", {"guaranteed": {"gpus": 4}})
        await put_queue(client, "production", {"guaranteed": {"gpus": 4}})
        prod = [await submit(client, f"p{i}", "production", 4) for i in range(8)]
        await until(lambda: _held_is(client, "production", 8), 30, "production to borrow all 8 GPUs")

        t0 = time.monotonic()
        research = [await submit(client, f"r{i}", "research", 2) for i in range(4)]
        await until(lambda: _held_is(client, "research", 4), 30, "research to get its guarantee")
        took = time.monotonic() - t0
        assert took < 1 + 5, f"guarantee restored after {took:.1f}s; grace is 1 s and a cycle well under a second"

        preempted = [j for j in prod if (await client.get(f"/v1/jobs/{j}")).json()["preemptions"] > 0]
        assert len(preempted) == 4, "exactly the borrowed GPUs were reclaimed"
        for j in prod + research:
            await until(lambda j=j: _ended(client, j), 60, f"{j} to finish")
        states = {(await client.get(f"/v1/jobs/{j}")).json()["state"] for j in prod + research}
        assert states == {"succeeded"}, "every job finished: the preempted ones after requeueing"


async def _n_nodes(client, n: int) -> bool:
    return len((await client.get("/v1/nodes")).json()) >= n


async def _held_is(client, queue: str, gpus: float) -> bool:
    return await held(client, queue) >= gpus


async def _ended(client, job_id: str) -> bool:
    return (await client.get(f"/v1/jobs/{job_id}")).json()["state"] in ("succeeded", "failed", "cancelled")
