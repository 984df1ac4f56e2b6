"""Autoscaling on the real stack: a pool of simulated nodes grows for a gang and shrinks when idle."""

from __future__ import annotations

import time

from shared.eventlog import EventLog
from tests.builders import job
from tests.support import in_process_stack, until


async def events_of(client, type_: str) -> list[dict]:
    return (await client.get("/v1/events", params={"type": type_, "limit": 1000})).json()


async def test_a_gang_makes_the_pool_provision_exactly_what_it_needs_and_idle_nodes_go_away(eventlog: EventLog, agents, tmp_path):
    async with in_process_stack(eventlog, autoscale_interval_s=0.3, data_dir=tmp_path / "d") as (client, services):
        agents("small")  # 4 T4s: the gang cannot run here
        await until(lambda: _nodes(client, 1), 30, "the static node")
        r = await client.put("/v1/pools/h100", json={"profile": "dgx-h100", "min_nodes": 0, "max_nodes": 4,
                                                     "provision_delay_s": 1, "idle_timeout_s": 2})
        assert r.status_code == 200, r.text
        spec = job("gang").gpus(8).tasks(2).build().model_copy(update={"command": ("sleep", "1")})
        sub = await client.post("/v1/jobs", json=spec.model_dump(mode="json"))
        assert sub.status_code == 201, sub.text
        job_id = sub.json()["id"]
        t0 = time.monotonic()
        await until(lambda: _state(client, job_id, "succeeded"), 60, "the gang to run on new nodes and succeed")
        requests = await events_of(client, "pool.scale_requested")
        assert [e["data"]["delta"] for e in requests] == [2], "exactly two nodes, asked once"
        provisioned = await events_of(client, "pool.node_provisioned")
        assert len(provisioned) == 2
        assert time.monotonic() - t0 >= 1, "not before the provision delay"
        placed = (await client.get(f"/v1/jobs/{job_id}")).json()["placement"]
        assert {p["node"] for p in placed} == {e["data"]["node_id"] for e in provisioned}

        await until(lambda: _pool_size(client, "h100", 0), 30, "idle pool nodes to be terminated")
        terminated = await events_of(client, "pool.node_terminated")
        assert len(terminated) == 2
        assert {n["id"] for n in (await client.get("/v1/nodes")).json()} == {"small"}

        await client.put("/v1/pools/h100", json={"profile": "dgx-h100", "min_nodes": 1, "max_nodes": 4,
                                                 "provision_delay_s": 0, "idle_timeout_s": 1})
        await until(lambda: _pool_size(client, "h100", 1), 30, "the pool to reach its minimum")
        await until(lambda: _nodes(client, 2), 30, "the minimum node to register")
        time_idle = time.monotonic()
        while time.monotonic() - time_idle < 2.5:  # well past the idle timeout: min is respected
            assert await _pool_size(client, "h100", 1)
            await _sleep(0.3)


async def _sleep(s: float) -> None:
    import asyncio

    await asyncio.sleep(s)


async def _nodes(client, n: int) -> bool:
    return len((await client.get("/v1/nodes")).json()) >= n


async def _state(client, job_id: str, state: str) -> bool:
    j = (await client.get(f"/v1/jobs/{job_id}")).json()
    assert j["state"] not in ("failed", "cancelled"), j
    return j["state"] == state


async def _pool_size(client, pool: str, n: int) -> bool:
    p = next(p for p in (await client.get("/v1/pools")).json() if p["name"] == pool)
    return len(p["nodes"]) == n and p["in_flight"] == 0
