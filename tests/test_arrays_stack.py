"""Job arrays and dependencies on the real stack: a real nats-server, real agents, the scheduler's own cycles."""

from __future__ import annotations

from services.scheduler.projection import SchedulerProjection
from shared.eventlog import EventLog, Undecodable
from tests.builders import job
from tests.support import in_process_stack, nodes_up, until

HOLD = {"job.placed": 1, "job.succeeded": -1, "job.failed": -1, "job.cancelled": -1, "job.requeued": -1,
        "job.preempted": -1}


def body(name: str, *argv: str, **extra) -> dict:
    return {**job(name).gpus(1).command(*argv).build().model_dump(mode="json"), **extra}


async def job_events(log: EventLog, job_id: str = ">") -> list:
    return [r async for r in log.replay(1, [f"gpuorch.events.job.{job_id}"])]


async def test_an_array_of_ten_at_two_at_a_time_never_holds_more_than_two_and_every_element_succeeds(
        eventlog: EventLog, agents):
    async with in_process_stack(eventlog) as (client, _):
        agents("a")  # 4 GPUs: room for four at once, but for the array's limit
        await nodes_up(client, 1)
        r = await client.post("/v1/jobs", json=body("sweep", "sh", "-c", "sleep 0.3",
                                                    array={"indices": list(range(10)), "max_running": 2}))
        assert r.status_code == 201, r.text
        array = r.json()
        assert array["count"] == 10 and array["jobs"] == [f"{array['id']}-{i}" for i in range(10)]

        async def all_ended():
            jobs = (await client.get("/v1/jobs", params={"array": array["id"]})).json()
            return jobs if len(jobs) == 10 and all(j["state"] in ("succeeded", "failed") for j in jobs) else None
        jobs = await until(all_ended, 30, "every element to end")
        assert {j["state"] for j in jobs} == {"succeeded"}
        assert {j["spec"]["array"]["index"] for j in jobs} == set(range(10))

        held, most = 0, 0
        for rec in await job_events(eventlog):
            if rec.data.job_id.startswith(array["id"]):
                held += HOLD.get(rec.data.TYPE, 0)
                most = max(most, held)
        assert most == 2, f"at most {most} elements held at once; the limit is 2"
        summary = (await client.get(f"/v1/jobs/{array['id']}")).json()
        assert summary["states"] == {"succeeded": 10} and summary["max_running"] == 2
        # an array has no output of its own: the answer names its elements (gpuorch logs ARRAY said "no job")
        r = await client.get(f"/v1/jobs/{array['id']}/logs")
        assert r.status_code == 404 and r.json()["detail"] == (
            f"{array['id']} is an array of 10 jobs: ask for one of them ({array['id']}-0 to {array['id']}-9)"), r.text


async def test_afterok_waits_for_its_job_to_succeed_and_is_cancelled_naming_a_job_that_failed(
        eventlog: EventLog, agents):
    async with in_process_stack(eventlog) as (client, services):
        agents("a")
        await nodes_up(client, 1)
        first = (await client.post("/v1/jobs", json=body("train", "sh", "-c", "sleep 1"))).json()["id"]
        broken = (await client.post("/v1/jobs", json=body("broken", "sh", "-c", "sleep 0.3; exit 3"))).json()["id"]
        r = await client.post("/v1/jobs", json=body("eval", "true", dependencies=[{"kind": "afterok", "job": first}]))
        assert r.status_code == 201, r.text
        then = r.json()["id"]
        doomed = (await client.post("/v1/jobs", json=body(
            "report", "true", dependencies=[{"kind": "afterok", "job": broken}]))).json()["id"]

        async def waits_saying_why():
            j = (await client.get(f"/v1/jobs/{then}")).json()
            return j if j["reason"].startswith(f"waiting for dependency afterok:{first}") else None
        assert (await until(waits_saying_why, 10, "the dependent job to wait, saying why"))["state"] == "queued"

        async def ended(job_id: str):
            j = (await client.get(f"/v1/jobs/{job_id}")).json()
            return j if j["state"] in ("succeeded", "failed", "cancelled") else None
        after, before = await until(lambda: ended(then), 20, "the dependent job"), await ended(first)
        assert (before["state"], after["state"]) == ("succeeded", "succeeded")
        assert after["placed_at"] >= before["ended_at"], "placed before its dependency succeeded"
        cancelled = await until(lambda: ended(doomed), 20, "the job on a failed one to be cancelled")
        assert cancelled["state"] == "cancelled"
        assert cancelled["reason"] == f"dependency afterok:{broken} can never be met: {broken} failed"

        # a scheduler deciding on a stale view (a second leader, a restart) appends the same event id: stored once
        scheduler = services["scheduler"].reaction.__self__
        scheduler.proj.jobs[doomed].state = "queued"
        try:
            await scheduler.cancel_unmet(doomed, cancelled["reason"], None)
        finally:
            scheduler.proj.jobs[doomed].state = "cancelled"
        assert [r.data.TYPE for r in await job_events(eventlog, doomed)].count("job.cancelled") == 1

        replayed = SchedulerProjection()  # a restart's fold of the whole log: the same jobs, the same ends
        async for rec in eventlog.replay(1):
            replayed.skip(rec.seq) if isinstance(rec, Undecodable) else replayed.apply(rec)
        live = services["scheduler"].projection.jobs
        assert {j: (r.state, r.reason) for j, r in replayed.jobs.items()} == \
            {j: (r.state, r.reason) for j, r in live.items()}
        assert replayed.invalid_transitions == [], replayed.invalid_transitions

        r = await client.post("/v1/jobs", json=body("x", "true", dependencies=[{"kind": "afterany", "job": "4242"}]))
        assert r.status_code == 422 and "no job or array 4242" in r.text and "gpuorch job id" in r.text, r.text
        r = await client.post("/v1/jobs", json=body("x", "true", dependencies=[{"kind": "afterok", "job": broken}]))
        assert r.status_code == 422 and f"can never be met: {broken} failed" in r.text, r.text
        r = await client.post("/v1/jobs", json=body("x", "true", dependencies=[{"kind": "afternotok", "job": broken}]))
        assert r.status_code == 201, r.text


async def test_cancelling_an_array_s_id_cancels_every_element_not_ended(eventlog: EventLog, agents):
    async with in_process_stack(eventlog) as (client, _):
        agents("a")
        await nodes_up(client, 1)
        r = await client.post("/v1/jobs", json=body("long", "sleep", "30", array={"indices": [1, 2, 3, 4],
                                                                               "max_running": 1}))
        array = r.json()["id"]

        async def one_runs():
            jobs = (await client.get("/v1/jobs", params={"array": array})).json()
            return [j for j in jobs if j["state"] == "running"]
        await until(one_runs, 15, "an element to run")
        r = await client.delete(f"/v1/jobs/{array}")
        assert r.status_code == 200, r.text
        assert sorted(r.json()["cancelled"]) == [f"{array}-{i}" for i in (1, 2, 3, 4)]
        jobs = (await client.get("/v1/jobs", params={"array": array})).json()
        assert {j["state"] for j in jobs} == {"cancelled"} and len(jobs) == 4
        assert (await client.delete(f"/v1/jobs/{array}")).status_code == 409

        r = await client.post("/v1/jobs", json=body("huge", "true", array={"indices": list(range(10_001))}))
        assert r.status_code == 422 and "10000" in r.text, r.text[:300]
