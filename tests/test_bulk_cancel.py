"""POST /v1/jobs:cancel cancels many jobs in one request, as scancel does, and `gpuorch cancel` with filters or
several ids uses it: one DELETE per job took the CLI 9 min 45 s for 19,960 queued jobs (a new HTTP client each).

Who may cancel what is the single DELETE's rule: a job the caller may only see is skipped and said so, one it
cannot see is ``unknown`` (no existence leak), an ended one is skipped; nothing is cancelled twice."""

from __future__ import annotations

import asyncio

from services import cli
from shared import events as ev
from tests.jobfiles.test_cli import gpuorch, through_response
from tests.support import as_user, in_process_stack
from tests.test_batch_submit import job, with_a_node


async def submitted(client, body) -> list[str]:
    resp = await client.post("/v1/jobs", json=body)
    assert resp.status_code == 201, resp.text
    answer = resp.json()
    return [j.get("id") for j in answer] if isinstance(answer, list) else [answer["id"]]


async def states(client, ids) -> dict[str, str]:
    return {i: (await client.get(f"/v1/jobs/{i}")).json()["state"] for i in ids}


async def test_ids_arrays_and_filters_cancel_only_what_the_caller_may_cancel(eventlog):
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        await with_a_node(eventlog)
        alice = await as_user(client, "alice", groups=("team",))
        bob = await as_user(client, "bob", groups=("team",))
        carol = await as_user(client, "carol")
        await client.put("/v1/queues/shared", json={"groups": ["team"], "group_access": "read"})
        hers = await submitted(alice, [job("sweep", 8), job("sweep", 8), job("eval", 8, queue="shared")])
        array = (await alice.post("/v1/jobs", json={**job("arr", 8), "array": {"indices": [0, 1, 2]}})).json()
        his = await submitted(bob, [job("sweep", 8, queue="shared"), job("sweep", 8)])
        ended = (await submitted(alice, job("done", 8)))[0]
        assert (await alice.delete(f"/v1/jobs/{ended}")).status_code == 200

        resp = await alice.post("/v1/jobs:cancel", json={"ids": [hers[0], array["id"], his[0], his[1], ended,
                                                                   "j-nothing", hers[0]]})
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        assert answer["cancelled"] == [hers[0], *array["jobs"]], "a job named twice is cancelled once"
        skipped = {s["id"]: s["why"] for s in answer["skipped"]}
        assert skipped == {his[0]: "alice may see it but not cancel it", his[1]: "unknown", ended: "already cancelled",
                           "j-nothing": "unknown"}, "bob's job outside the shared queue is not even seen"
        assert "cancelled" not in (await states(client, [hers[1], hers[2], *his])).values()

        resp = await alice.post("/v1/jobs:cancel", json={"name": "sweep"})
        answer = resp.json()
        assert answer["cancelled"] == [hers[1]], answer
        assert answer["skipped"] == [{"id": his[0], "why": "alice may see it but not cancel it"}]
        resp = await carol.post("/v1/jobs:cancel", json={"queue": "shared"})
        assert resp.json() == {"cancelled": [], "skipped": [], "seq": None}, "carol sees nothing of the team's"
        resp = await client.post("/v1/jobs:cancel", json={"owner": "bob", "states": ["queued", "placed"]})
        assert resp.json()["cancelled"] == his, "an admin cancels anyone's"
        assert (await states(client, [hers[2]]))[hers[2]] != "cancelled", "her eval matched no filter"

        for body in ({}, {"ids": [hers[2]], "name": "eval"}, {"states": ["cancelled", "bogus"]}, {"ids": ["../x"]},
                     {"name": "eval", "extra": 1}, {"states": []}, {"ids": []}):  # an empty filter is not "any"
            resp = await alice.post("/v1/jobs:cancel", json=body)
            assert resp.status_code == 422, (body, resp.text)
        assert (await carol.post("/v1/jobs:cancel", json={"ids": [hers[2]]})).json()["skipped"] == [
            {"id": hers[2], "why": "unknown"}]
        assert (await states(client, [hers[2]]))[hers[2]] != "cancelled"


async def test_thousands_of_jobs_are_one_request_appended_in_batches(eventlog, monkeypatch):
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        await with_a_node(eventlog)
        n = 2_500
        ids = []
        for i in range(0, n, 1000):
            ids += await submitted(client, [job("flood", 8) for _ in range(min(1000, n - i))])
        calls: list[int] = []  # the cancellations each append_many carried (the cycles append too)
        real = eventlog.append_many

        async def append_many(envs, *a, **kw):
            envs = list(envs)
            calls.append(sum(isinstance(e.data, ev.JobCancelled) for e in envs))
            return await real(envs, *a, **kw)
        monkeypatch.setattr(eventlog, "append_many", append_many)
        monkeypatch.setattr(cli, "api_response", through_response(client, asyncio.get_running_loop()))
        code, out = await gpuorch("cancel", "--name", "flood")
        assert code == 0 and f"cancelled {n} job(s)" in out, out
        assert [c for c in calls if c] == [1_000, 1_000, 500], "in batches of a thousand, one request"
        cancelled = [e async for e in eventlog.replay(0) if isinstance(e.data, ev.JobCancelled)]
        assert sorted(e.data.job_id for e in cancelled) == sorted(ids)
        code, out = await gpuorch("cancel", "--name", "flood")
        assert code == 0 and "cancelled 0 job(s)" in out, out


def test_the_split_gateway_sends_every_service_route_to_its_service():
    """`--split`: the gateway forwards by path; a route no prefix owns answers 404 there (POST /v1/jobs:cancel did)."""
    import re

    from services.stack import owner
    from shared.auth import ROUTE_ROLES

    gateway_own = ("/v1/tokens", "/v1/events", "/v1/services", "/v1/whoami", "/v1/{rest:path}")
    unrouted = [(m, p) for m, p in ROUTE_ROLES if p.startswith("/v1/") and not p.startswith(gateway_own)
                and owner(re.sub(r"\{[^}]+\}", "x", p)) is None]
    assert unrouted == []
    assert owner("/v1/jobs:cancel") == owner("/v1/jobs") == "scheduler"


async def test_gpuorch_cancel_of_several_ids_fails_as_one_would_when_any_could_not_be_cancelled(eventlog, monkeypatch):
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        await with_a_node(eventlog)
        ids = await submitted(client, [job("a", 8), job("b", 8), job("c", 8)])
        monkeypatch.setattr(cli, "api_response", through_response(client, asyncio.get_running_loop()))
        code, out = await gpuorch("cancel", ids[0], ids[1])
        assert code == 0 and "cancelled 2 job(s)" in out, out
        code, out = await gpuorch("cancel", ids[2], ids[0], "j-nothing")
        said = " ".join(out.split())
        assert code == 1, "an ended or unknown id fails the command, as `gpuorch cancel ONE-ID` does"
        assert "cancelled 1 job(s); 2 could not be" in said and f"{ids[0]}: already cancelled" in said, out
        assert "j-nothing: unknown" in said, out
        array = (await client.post("/v1/jobs", json={**job("arr", 8), "array": {"indices": [0, 1, 2]}})).json()["id"]
        code, out = await gpuorch("cancel", array)
        said = " ".join(out.split())
        assert code == 0 and f"cancelled {array} (an array: 3 unfinished job(s) cancelled)" in said, out


async def test_a_job_that_ends_while_the_request_runs_is_answered_as_ended_not_cancelled(eventlog, monkeypatch):
    """The request reads the jobs, then appends: a job that ends in between gets a late cancellation, and the answer
    says so instead of listing it as cancelled."""
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, services):
        await with_a_node(eventlog)
        ids = await submitted(client, [job("ends", 8), job("stays", 8)])
        real = eventlog.append_many

        async def append_many(envs, *a, **kw):  # the first job fails just before the cancellations go in
            envs = list(envs)
            if any(isinstance(e.data, ev.JobCancelled) for e in envs):
                await real([ev.Envelope(ev.JobFailed(job_id=ids[0], code=1, reason="its task died"),
                                        source="/gpuorch/scheduler")])
            return await real(envs, *a, **kw)
        monkeypatch.setattr(eventlog, "append_many", append_many)
        answer = (await client.post("/v1/jobs:cancel", json={"ids": ids})).json()
        assert answer["cancelled"] == [ids[1]], answer
        assert answer["skipped"] == [{"id": ids[0], "why": "failed meanwhile"}]
        proj = services["scheduler"].projection
        late = [line for line, kind in zip(proj.invalid_transitions, proj.invalid_kinds) if kind == "late"]
        assert any(f"job {ids[0]} had already failed" in line for line in late), proj.invalid_transitions
        assert not proj.kinds.get("invalid"), proj.invalid_transitions  # (a cycle's reason may come late too)
