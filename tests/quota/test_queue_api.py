"""The queue API refuses what would break the tree, with a reason."""

from __future__ import annotations

from shared import events as ev
from shared.eventlog import EventLog
from shared.events import Envelope
from tests.builders import job, node
from tests.support import in_process_stack, until


async def test_the_queue_tree_refuses_bad_definitions_with_reasons(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, _):
        ok = await client.put("/v1/queues/research", json={"guaranteed": {"gpus": 10}, "limit": {"gpus": 20}})
        assert ok.status_code == 200
        assert (await client.put("/v1/queues/research.nlp", json={"guaranteed": {"gpus": 6}})).status_code == 200
        over = await client.put("/v1/queues/research.vision", json={"guaranteed": {"gpus": 5}})
        assert over.status_code == 422 and "above its own guarantee" in over.json()["detail"]
        low = await client.put("/v1/queues/prod", json={"guaranteed": {"gpus": 8}, "limit": {"gpus": 4}})
        assert low.status_code == 422 and "limit" in str(low.json()["detail"])
        bad = await client.put("/v1/queues/Bad Name", json={})
        assert bad.status_code == 422

        parent = await client.post("/v1/jobs", json=job("x").queue("research").build().model_dump(mode="json"))
        assert parent.status_code == 422 and "leaf" in parent.json()["detail"]

        leaf_job = await client.post("/v1/jobs", json=job("x").queue("research.nlp").build().model_dump(mode="json"))
        assert leaf_job.status_code == 201
        busy = await client.delete("/v1/queues/research.nlp")
        assert busy.status_code == 409 and "jobs" in busy.json()["detail"]
        has_kids = await client.delete("/v1/queues/research")
        assert has_kids.status_code == 409 and "child" in has_kids.json()["detail"]
        await client.delete(f"/v1/jobs/{leaf_job.json()['id']}")
        assert (await client.delete("/v1/queues/research.nlp")).status_code == 200
        assert (await client.delete("/v1/queues/nope")).status_code == 404

        rows = {q["path"]: q for q in (await client.get("/v1/queues")).json()}
        assert set(rows) == {"default", "research"}
        assert {"entitlement", "fair_share", "usage", "allocated", "pending"} <= set(rows["research"])
        usage = (await client.get("/v1/usage", params={"by": "queue"})).json()
        assert "queues" in usage


async def test_the_queue_api_counts_a_cpu_heavy_job_by_its_dominant_share(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, _):
        # 4 GPUs and 16 CPUs: a job asking 1 GPU and 8 CPUs takes half the CPUs, 2 GPUs' worth
        await eventlog.append_many([Envelope(ev.NodeRegistered(node_id="n1", node=node("n1").gpus(4).cpu(16_000).build()))])
        assert (await client.put("/v1/queues/research", json={"guaranteed": {"gpus": 2}})).status_code == 200
        spec = job("heavy").gpus(1).cpu(8_000).queue("research").build()
        assert (await client.post("/v1/jobs", json=spec.model_dump(mode="json"))).status_code == 201

        async def counted():
            row = {q["path"]: q for q in (await client.get("/v1/queues")).json()}["research"]
            gpus = row["allocated"]["gpus"] + row["pending"]["gpus"]
            dominant = row["allocated"]["dominant_gpus"] + row["pending"]["dominant_gpus"]
            return (gpus, dominant) if dominant else None

        assert await until(counted, 10, "the job to be counted") == (1, 2)
