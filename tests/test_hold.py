"""Holding a waiting job (scontrol hold, sbatch --hold, Kubernetes' suspend) over a real nats-server: a held job is
never placed and wants nothing of quota, until released; only a waiting job can be held; who may cancel a job may
hold it."""

from __future__ import annotations

import asyncio
import json

from services import cli
from shared.eventlog import EventLog
from tests.jobfiles.test_cli import gpuorch, through_response
from tests.support import as_user, in_process_stack
from tests.test_batch_submit import job, quiet, with_a_node


async def state_of(client, job_id: str) -> dict:
    return (await client.get(f"/v1/jobs/{job_id}")).json()


async def pending_gpus(client, queue: str = "default") -> float:
    return next(q for q in (await client.get("/v1/queues")).json() if q["path"] == queue)["pending"]["gpus"]


async def test_a_job_submitted_held_waits_on_a_free_node_until_released(eventlog: EventLog):
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, services):
        await with_a_node(eventlog)
        r = await client.post("/v1/jobs", json={**job("held", 4), "hold": True})
        assert r.status_code == 201 and r.json()["state"] == "held", r.text
        held = r.json()["id"]
        await quiet(eventlog)
        assert (await state_of(client, held))["state"] == "held", "placed although held"
        assert services["scheduler"].projection.invalid_transitions == [], "the scheduler tried to place it"
        assert await pending_gpus(client) == 0, "a held job wants nothing of its queue"
        r = await client.post(f"/v1/jobs/{held}/hold")
        assert r.status_code == 409 and r.json()["detail"] == f"job {held} is held already", r.text
        listed = (await client.get("/v1/jobs", params={"state": "held"})).json()
        assert [j["id"] for j in listed] == [held]

        r = await client.post(f"/v1/jobs/{held}/release")
        assert r.status_code == 200 and r.json()["state"] in ("queued", "placed"), r.text
        await quiet(eventlog)
        assert (await state_of(client, held))["state"] == "placed"
        r = await client.post(f"/v1/jobs/{held}/hold")
        assert r.status_code == 409 and "is placed: only a job that waits" in r.json()["detail"], r.text
        r = await client.post(f"/v1/jobs/{held}/release")
        assert r.status_code == 409 and "only a held job is released" in r.json()["detail"], r.text


async def test_a_released_job_is_placed_at_once_not_at_the_next_timed_cycle(eventlog: EventLog):
    """Its release wakes the scheduler as a submission does (the API's own wake may come before the fold)."""
    from tests.support import until

    async with in_process_stack(eventlog, heartbeat_timeout_s=3600, cycle_interval_s=3600) as (client, _):
        await with_a_node(eventlog)
        held = (await client.post("/v1/jobs", json={**job("held", 4), "hold": True})).json()["id"]
        assert (await client.post(f"/v1/jobs/{held}/release")).status_code == 200

        async def placed():
            return (await state_of(client, held))["state"] == "placed"
        await until(placed, 10, "the released job to be placed")


async def test_a_queued_job_held_is_passed_over_and_its_turn_comes_after_release(eventlog: EventLog):
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        await with_a_node(eventlog)
        ids = [(await client.post("/v1/jobs", json=job(n, 8))).json()["id"] for n in ("first", "second", "third")]
        await quiet(eventlog)
        first, second, third = ids
        assert [(await state_of(client, i))["state"] for i in ids] == ["placed", "queued", "queued"]
        r = await client.post(f"/v1/jobs/{second}/hold")
        assert r.status_code == 200, r.text
        assert (r.json()["state"], r.json()["reason"]) == ("held", "held by admin (an admin)")
        assert await pending_gpus(client) == 8, "only the third wants its GPUs"
        assert (await client.delete(f"/v1/jobs/{first}")).status_code == 200
        await quiet(eventlog)
        assert [(await state_of(client, i))["state"] for i in (second, third)] == ["held", "placed"]
        assert (await client.post(f"/v1/jobs/{second}/release")).status_code == 200
        assert (await client.delete(f"/v1/jobs/{third}")).status_code == 200
        await quiet(eventlog)
        assert (await state_of(client, second))["state"] == "placed"


async def test_only_who_may_cancel_a_job_may_hold_or_release_it_and_an_array_is_held_whole(eventlog: EventLog):
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        await with_a_node(eventlog)
        await client.put("/v1/queues/shared", json={"groups": ["team"], "group_access": "read"})
        alice = await as_user(client, "alice", groups=("team",))
        bob = await as_user(client, "bob", groups=("team",))
        carol = await as_user(client, "carol")
        await client.post("/v1/jobs", json=job("blocker", 8))  # the node's 8 GPUs: the others wait
        hers = (await alice.post("/v1/jobs", json=job("big", 8, queue="shared"))).json()["id"]
        r = await bob.post(f"/v1/jobs/{hers}/hold")
        assert r.status_code == 403 and "bob may see job" in r.json()["detail"] and "not hold it" in r.json()["detail"]
        assert (await carol.post(f"/v1/jobs/{hers}/hold")).status_code == 404, "no existence leak"
        assert (await alice.post(f"/v1/jobs/{hers}/hold")).status_code == 200
        assert (await bob.post(f"/v1/jobs/{hers}/release")).status_code == 403
        assert (await alice.post(f"/v1/jobs/{hers}/release")).status_code == 200
        # an admin's hold (Slurm's JobHeldAdmin): its owner may not release it
        r = await client.post(f"/v1/jobs/{hers}/hold")
        assert r.status_code == 200 and r.json()["reason"] == "held by admin (an admin)", r.text
        r = await alice.post(f"/v1/jobs/{hers}/release")
        assert r.status_code == 403 and "only an admin releases it" in r.json()["detail"], r.text
        assert (await client.post(f"/v1/jobs/{hers}/release")).status_code == 200

        array = (await alice.post("/v1/jobs", json={**job("arr", 8), "array": {"indices": [0, 1, 2]}})).json()["id"]
        assert (await carol.post(f"/v1/jobs/{array}/hold")).status_code == 404
        r = await alice.post(f"/v1/jobs/{array}/hold")
        assert r.status_code == 200 and r.json()["held"] == [f"{array}-{i}" for i in range(3)], r.text
        assert {(await state_of(client, f"{array}-{i}"))["state"] for i in range(3)} == {"held"}
        assert (await alice.post(f"/v1/jobs/{array}/hold")).status_code == 409, "none waits to be held"
        r = await alice.post(f"/v1/jobs/{array}/release")
        assert r.status_code == 200 and len(r.json()["released"]) == 3, r.text
        assert (await client.post(f"/v1/jobs/{array}/hold")).status_code == 200
        r = await alice.post(f"/v1/jobs/{array}/release")
        assert r.status_code == 403 and "held by an admin" in r.json()["detail"], r.text


async def test_gpuorch_submit_hold_and_release_from_the_command_line(eventlog: EventLog, monkeypatch, tmp_path):
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        await with_a_node(eventlog)
        monkeypatch.setattr(cli, "api_response", through_response(client, asyncio.get_running_loop()))
        await client.post("/v1/jobs", json=job("blocker", 8))  # the node's 8 GPUs: the others wait
        code, out = await gpuorch("submit", "-H", "-g", "1", "--json", "--", "true")
        assert code == 0, out
        held = json.loads(out)["id"]
        assert (await state_of(client, held))["state"] == "held"
        code, out = await gpuorch("jobs", "-s", "PD")
        assert code == 0 and held in out and "held" in out, "squeue shows a held job as pending"
        code, out = await gpuorch("release", held)
        assert code == 0 and f"released {held}" in out, out
        code, out = await gpuorch("release", held)
        assert code == 1 and "only a held job is released" in " ".join(out.split()), out

        script = tmp_path / "held.sbatch"
        script.write_text("#!/bin/bash\n#SBATCH --hold\n#SBATCH --gpus=1\ntrue\n")
        code, out = await gpuorch("submit", str(script), "--json")
        assert code == 0 and "ignored" not in out, out
        assert (await state_of(client, json.loads(out[out.index("{"):])["id"]))["state"] == "held"
        code, out = await gpuorch("hold", held)
        assert code == 0 and f"held {held}: held" in out, out


async def test_a_hold_that_loses_a_race_with_the_job_s_next_event_is_refused_not_appended(eventlog: EventLog,
                                                                                         monkeypatch):
    """The hold expects the job's last event to be the one it was read at: one appended in between (here a
    cancellation; a placement alike) makes it 409, where appending it anyway would have held a job that moved."""
    from shared import events as ev
    from shared.events import Envelope

    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        await with_a_node(eventlog)
        await client.post("/v1/jobs", json=job("blocker", 8))
        waiting = (await client.post("/v1/jobs", json=job("waits", 8))).json()["id"]
        await quiet(eventlog)
        real = eventlog.append

        async def cancelled_first(env, *a, **kw):
            if isinstance(env.data, ev.JobHeld):
                await real(Envelope(ev.JobCancelled(job_id=waiting, reason="in between")))
            return await real(env, *a, **kw)
        monkeypatch.setattr(eventlog, "append", cancelled_first)
        r = await client.post(f"/v1/jobs/{waiting}/hold")
        assert r.status_code == 409 and f"job {waiting} is cancelled" in r.json()["detail"], r.text
        monkeypatch.undo()
        held = [e for e in (await client.get(f"/v1/jobs/{waiting}/events")).json() if e["type"] == "job.held"]
        assert held == [], "nothing appended"


async def test_an_array_is_held_in_one_pipelined_append_each_element_expecting_its_last_event(eventlog: EventLog,
                                                                                             monkeypatch):
    """Holding an array of 10,000 elements one append and one fold at a time took seconds per thousand. The holds
    now go in one append_many, each expecting its element's last event, as a single hold does: an element cancelled
    in between is neither held nor reported; one that only logged a reason in between (it did not move) is read
    again and held alone."""
    from shared import events as ev
    from shared.events import Envelope

    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        await with_a_node(eventlog)
        await client.post("/v1/jobs", json=job("blocker", 8))
        array = (await client.post("/v1/jobs", json={**job("arr", 8), "array": {"indices": [0, 1, 2]}})).json()["id"]
        await quiet(eventlog)
        batches: list[int] = []
        real = eventlog.append_many

        async def in_between(envs, *a, **kw):
            envs = list(envs)
            if any(isinstance(e.data, ev.JobHeld) for e in envs):
                batches.append(len(envs))
                await eventlog.append(Envelope(ev.JobCancelled(job_id=f"{array}-1", reason="in between")))
                await eventlog.append(Envelope(ev.JobUnschedulable(job_id=f"{array}-2", reason="a reason, no move")))
            return await real(envs, *a, **kw)
        monkeypatch.setattr(eventlog, "append_many", in_between)
        r = await client.post(f"/v1/jobs/{array}/hold")
        assert r.status_code == 200 and r.json()["held"] == [f"{array}-0", f"{array}-2"], r.text
        assert batches[:1] == [3], f"the holds went in appends of {batches}"
        assert [(await state_of(client, f"{array}-{i}"))["state"] for i in range(3)] == ["held", "cancelled", "held"]
        held = [e for e in (await client.get(f"/v1/jobs/{array}-1/events")).json() if e["type"] == "job.held"]
        assert held == [], "no hold on the element that moved"


async def test_append_many_stores_only_the_events_whose_subject_is_where_they_expect_it(eventlog: EventLog):
    from shared import events as ev
    from shared.events import Envelope

    first = await eventlog.append(Envelope(ev.JobCancelled(job_id="j-a", reason="one")))
    await eventlog.append(Envelope(ev.JobCancelled(job_id="j-b", reason="one")))
    last_b = await eventlog.append(Envelope(ev.JobCancelled(job_id="j-b", reason="two")))
    seqs = await eventlog.append_many([Envelope(ev.JobCancelled(job_id="j-a", reason="three")),
                                       Envelope(ev.JobCancelled(job_id="j-b", reason="three")),
                                       Envelope(ev.JobCancelled(job_id="j-c", reason="free"))],
                                      expected=[first, last_b - 1, None])
    assert seqs[0] > last_b and seqs[1] == 0 and seqs[2] > seqs[0]
    reasons = [(r.data.job_id, r.data.reason) async for r in eventlog.replay(first)]
    assert reasons == [("j-a", "one"), ("j-b", "one"), ("j-b", "two"), ("j-a", "three"), ("j-c", "free")]
