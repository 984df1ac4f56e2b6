"""Changing a job after submission (Slurm's scontrol update) over a real nats-server: a waiting job's priority, a
waiting or running job's time limit; who may cancel a job may change it, only an admin raises a time limit, and a
priority stays within what the job's queue lets its owner submit at."""

from __future__ import annotations

import asyncio

from shared import events as ev
from services import cli
from shared.cluster import ClusterProjection
from shared.eventlog import EventLog
from shared.events import Envelope
from tests.jobfiles.test_cli import gpuorch, through_response
from tests.support import as_user, in_process_stack
from tests.test_batch_submit import job, quiet, with_a_node


async def state_of(client, job_id: str) -> dict:
    return (await client.get(f"/v1/jobs/{job_id}")).json()


async def test_a_waiting_job_raised_to_high_priority_goes_before_the_job_submitted_ahead_of_it(eventlog: EventLog):
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        await with_a_node(eventlog)
        blocker, first, second = [(await client.post("/v1/jobs", json=job(n, 8))).json()["id"]
                                  for n in ("blocker", "first", "second")]
        await quiet(eventlog)
        r = await client.patch(f"/v1/jobs/{second}", json={"priority": "high"})
        assert r.status_code == 200 and r.json()["spec"]["priority"] == "high", r.text
        assert (await client.delete(f"/v1/jobs/{blocker}")).status_code == 200
        await quiet(eventlog)
        assert [(await state_of(client, i))["state"] for i in (first, second)] == ["queued", "placed"]
        r = await client.patch(f"/v1/jobs/{second}", json={"priority": "low"})
        assert r.status_code == 409 and r.json()["detail"] == (
            f"job {second} is placed: a job's priority is changed only while it waits"), r.text
        r = await client.patch(f"/v1/jobs/{second}", json={"time_limit_s": 600})
        assert r.status_code == 200 and r.json()["spec"]["time_limit_s"] == 600, "a running job's limit changes"
        assert (await client.patch(f"/v1/jobs/{second}", json={})).status_code == 422


async def test_only_who_may_cancel_a_job_changes_it_only_admins_raise_a_limit_and_the_queue_caps_priority(
        eventlog: EventLog):
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        await with_a_node(eventlog)
        await client.put("/v1/queues/shared", json={"groups": ["team"], "group_access": "read",
                                                    "max_priority": "normal"})
        alice = await as_user(client, "alice", groups=("team",))
        bob = await as_user(client, "bob", groups=("team",))
        carol = await as_user(client, "carol")
        await client.post("/v1/jobs", json=job("blocker", 8))
        hers = (await alice.post("/v1/jobs", json=job("big", 8, queue="shared", time_limit_s=3600))).json()["id"]
        r = await bob.patch(f"/v1/jobs/{hers}", json={"time_limit_s": 60})
        assert r.status_code == 403 and "not change it" in r.json()["detail"], r.text
        assert (await carol.patch(f"/v1/jobs/{hers}", json={"time_limit_s": 60})).status_code == 404
        assert (await alice.patch(f"/v1/jobs/{hers}", json={"time_limit_s": 1800})).status_code == 200
        r = await alice.patch(f"/v1/jobs/{hers}", json={"time_limit_s": 3600})
        assert r.status_code == 403 and r.json()["detail"] == (
            f"only an admin raises a job's time limit (job {hers}: 1800 s, asked 3600 s)"), r.text
        r = await alice.patch(f"/v1/jobs/{hers}", json={"priority": "high"})
        assert r.status_code == 403 and "up to priority normal" in r.json()["detail"], r.text
        assert (await alice.patch(f"/v1/jobs/{hers}", json={"priority": "low"})).status_code == 200
        r = await client.patch(f"/v1/jobs/{hers}", json={"time_limit_s": 7200, "priority": "high"})
        assert r.status_code == 200, r.text
        assert {k: r.json()["spec"][k] for k in ("time_limit_s", "priority")} == {"time_limit_s": 7200,
                                                                                 "priority": "high"}
        events = [e["type"] for e in (await client.get(f"/v1/jobs/{hers}/events")).json()]
        assert events.count("io.gpuorch.job.updated.v1") == 3, events

        array = (await alice.post("/v1/jobs", json={**job("arr", 8), "array": {"indices": [0, 1]}})).json()["id"]
        r = await alice.patch(f"/v1/jobs/{array}", json={"priority": "low"})
        assert r.status_code == 200 and r.json()["updated"] == [f"{array}-0", f"{array}-1"], r.text
        assert {(await state_of(client, f"{array}-{i}"))["spec"]["priority"] for i in (0, 1)} == {"low"}


def test_a_forged_update_of_a_job_that_no_longer_waits_or_runs_changes_nothing() -> None:
    from shared.model import JobSpec

    state = ClusterProjection()
    spec = JobSpec(name="a", command=("true",), time_limit_s=100)
    for seq, e in enumerate([ev.JobSubmitted(job_id="j-a", spec=spec, owner="alice"), ev.JobQueued(job_id="j-a"),
                             ev.JobCancelled(job_id="j-a", reason="x"),
                             ev.JobUpdated(job_id="j-a", priority="critical", time_limit_s=99999)], 1):
        state.apply(Envelope(e, seq=seq))
    job = state.jobs["j-a"]
    assert (job.state, job.spec.priority, job.spec.time_limit_s) == ("cancelled", "normal", 100)
    assert state.invalid_transitions, "the forged update is recorded as invalid"


async def test_gpuorch_update_changes_priority_and_time_limit_from_the_command_line(eventlog: EventLog, monkeypatch):
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        await with_a_node(eventlog)
        await client.post("/v1/jobs", json=job("blocker", 8))
        waiting = (await client.post("/v1/jobs", json=job("waits", 8, time_limit_s=7200))).json()["id"]
        monkeypatch.setattr(cli, "api_response", through_response(client, asyncio.get_running_loop()))
        code, out = await gpuorch("update", waiting, "--priority", "high", "-t", "30m")
        assert code == 0 and f"updated {waiting}: queued, priority high, time limit 00:30:00" in out, out
        code, out = await gpuorch("update", waiting, "-t", "UNLIMITED")
        assert code != 0 and "not removed" in " ".join(out.split()), out
        code, out = await gpuorch("update", waiting)
        assert code != 0 and "nothing to change" in " ".join(out.split()), out


async def test_a_change_read_again_after_a_race_is_checked_again(eventlog: EventLog, monkeypatch):
    """A user lowers a limit from 3,600 s to 3,000 s while an admin lowers it to 1,000 s: tried again on the job as
    it is now, the user's change would raise the limit, so it is refused, not appended."""
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        await with_a_node(eventlog)
        alice = await as_user(client, "alice")
        await client.post("/v1/jobs", json=job("blocker", 8))
        hers = (await alice.post("/v1/jobs", json=job("big", 8, time_limit_s=3600))).json()["id"]
        await quiet(eventlog)
        real = eventlog.append_many

        async def admin_first(envs, *a, **kw):
            envs = list(envs)
            if any(isinstance(e.data, ev.JobUpdated) for e in envs):
                await eventlog.append(Envelope(ev.JobUpdated(job_id=hers, time_limit_s=1000)))
            return await real(envs, *a, **kw)
        monkeypatch.setattr(eventlog, "append_many", admin_first)
        r = await alice.patch(f"/v1/jobs/{hers}", json={"time_limit_s": 3000})
        assert r.status_code == 403 and "1000 s, asked 3000 s" in r.json()["detail"], r.text
        assert (await state_of(client, hers))["spec"]["time_limit_s"] == 1000
