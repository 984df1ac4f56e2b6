"""GET /v1/jobs in pages: newest first, an opaque cursor in X-Next-Cursor, filters, each caller only their own."""

from __future__ import annotations

import asyncio
import json

from services import cli
from shared.eventlog import EventLog
from tests.builders import job
from tests.jobfiles.test_cli import gpuorch, through_response
from tests.support import as_user, in_process_stack


def body(name: str, **extra) -> dict:
    return {**job(name).gpus(1).command("true").build().model_dump(mode="json"), **extra}


async def submit(client, name: str = "j", **extra) -> list[str]:
    """The ids of what was submitted, oldest first (an array's elements in index order)."""
    r = await client.post("/v1/jobs", json=body(name, **extra))
    assert r.status_code == 201, r.text
    return r.json().get("jobs") or [r.json()["id"]]


async def pages(client, between=None, **params) -> list[list[str]]:
    """Every page's ids, following X-Next-Cursor; ``between()`` runs after each page."""
    out, cursor = [], None
    while True:
        assert len(out) < 100, f"no last page after 100: the cursor does not move ({cursor})"
        r = await client.get("/v1/jobs", params={**params, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        out.append([j["id"] for j in r.json()])
        cursor = r.headers.get("x-next-cursor")
        if cursor:
            assert r.headers["link"].endswith('; rel="next"') and f"cursor={cursor}" in r.headers["link"]
        else:
            return out
        if between:
            await between()


async def test_pages_run_newest_first_without_a_duplicate_or_a_gap_while_new_jobs_arrive(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, _):  # no nodes: every job waits
        ids = await submit(client, "old", array={"indices": list(range(23))})
        arrived: list[str] = []

        async def more():
            arrived.extend(await submit(client, "new"))

        seen = await pages(client, between=more, limit=5)
        flat = [i for page in seen for i in page]
        assert [len(p) for p in seen] == [5, 5, 5, 5, 3]
        assert flat == ids[::-1], "the jobs there at the first page, each once, newest first; none that came later"
        assert len(arrived) == 4
        fresh = (await client.get("/v1/jobs", params={"limit": 6})).json()
        assert [j["id"] for j in fresh] == [*arrived[::-1], ids[-1], ids[-2]]


async def test_filters_narrow_every_page_and_several_states_come_in_one_call(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, _):
        sweep = await submit(client, "sweep", array={"indices": list(range(7))})
        other = await submit(client, "eval", queue="default")
        gone = (await submit(client, "gone"))[0]
        assert (await client.delete(f"/v1/jobs/{gone}")).status_code == 200

        def flat(seen):
            return [i for page in seen for i in page]

        assert flat(await pages(client, limit=2, name="sweep")) == sweep[::-1]
        assert flat(await pages(client, limit=3, array=sweep[0].rsplit("-", 1)[0])) == sweep[::-1]
        assert flat(await pages(client, limit=2, state="cancelled")) == [gone]
        both = flat(await pages(client, limit=4, state=["queued", "cancelled"]))
        assert both == [gone, *other, *sweep[::-1]]
        assert flat(await pages(client, limit=4, owner="nobody")) == []
        assert flat(await pages(client, limit=50, owner="admin", name="eval")) == other


async def test_a_malformed_cursor_or_limit_is_422(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, _):
        await submit(client)
        for params in ({"cursor": "abc"}, {"cursor": "v1."}, {"cursor": "v1.-4"}, {"cursor": "v2.4"},
                       {"cursor": "v1.4 "}, {"limit": 0}, {"limit": 1001}, {"state": "bogus"}):
            r = await client.get("/v1/jobs", params=params)
            assert r.status_code == 422, (params, r.text)


async def test_a_user_sees_only_their_own_jobs_across_pages(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, _):
        alice, bob = await as_user(client, "alice"), await as_user(client, "bob")
        mine, everyone = [], []
        for _ in range(4):  # interleaved, so that every page of alice's is cut out of bob's too
            mine += await submit(alice, "a")
            everyone += mine[-1:] + await submit(bob, "b", array={"indices": [0, 1]})
        assert [i for page in await pages(alice, limit=3) for i in page] == mine[::-1]
        assert await pages(bob, limit=3, owner="alice") == [[]], "a filter shows nothing hidden"
        assert [i for page in await pages(client, limit=5) for i in page] == everyone[::-1], "an admin sees all"


async def test_gpuorch_jobs_follows_the_cursor_up_to_its_limit_with_several_states_at_once(
        eventlog: EventLog, monkeypatch):
    async with in_process_stack(eventlog) as (client, _):
        monkeypatch.setattr(cli, "api_response", through_response(client, asyncio.get_running_loop()))
        monkeypatch.setattr(cli, "JOBS_PAGE", 4)
        ids = await submit(client, "many", array={"indices": list(range(11))})
        gone = (await submit(client, "gone"))[0]
        assert (await client.delete(f"/v1/jobs/{gone}")).status_code == 200
        asked: list[dict] = []
        real = cli.api_response
        monkeypatch.setattr(cli, "api_response", lambda *a, **kw: asked.append(kw["params"]) or real(*a, **kw))

        code, out = await gpuorch("jobs", "--json", "--limit", "9")
        assert code == 0, out
        assert [j["id"] for j in json.loads(out)] == ids[::-1][:9], "unfinished ones, newest first, up to --limit"
        assert len(asked) == 3 and [p["limit"] for p in asked] == [4, 4, 2], "one more than shown: are there more?"
        code, out = await gpuorch("jobs", "--json", "-s", "PD,CA")
        assert [j["id"] for j in json.loads(out)] == [gone, *ids[::-1]]
        assert asked[-1]["state"] == ["submitted", "queued", "held", "cancelled"], "one call names every state"
        code, out = await gpuorch("jobs", "--limit", "9")
        assert code == 0 and "the newest 9 shown; --limit N shows more" in out, "a cut list says it is cut"
        code, out = await gpuorch("jobs", "--limit", "11")
        assert code == 0 and "shown" not in out and ids[0] in out, "a list of exactly --limit jobs is whole"


async def test_reads_and_submissions_answer_while_every_thread_of_the_pool_is_busy(eventlog: EventLog):
    """Routes are async and so are their dependencies (the caller, a path id): a plain ``def`` ran in FastAPI's
    thread pool, a thread handoff and a wait for the GIL in every request (during a 20,000-job flood,
    GET /v1/jobs p50 26 -> 9 ms without them, bench.backlog), and no answer at all while the pool was full."""
    import threading

    import anyio.to_thread

    async with in_process_stack(eventlog) as (client, _):
        [job_id] = await submit(client, "before")
        limiter = anyio.to_thread.current_default_thread_limiter()
        tokens, limiter.total_tokens = limiter.total_tokens, 1
        release = threading.Event()
        held = asyncio.create_task(anyio.to_thread.run_sync(release.wait))  # the pool's one thread, busy
        try:
            await asyncio.sleep(0.05)
            assert limiter.borrowed_tokens == 1
            listed = await asyncio.wait_for(client.get("/v1/jobs"), 5)
            assert [j["id"] for j in listed.json()] == [job_id]
            one = await asyncio.wait_for(client.get(f"/v1/jobs/{job_id}"), 5)
            assert one.status_code == 200, one.text
            assert len(await asyncio.wait_for(submit(client, "during"), 5)) == 1
            for path in ("/v1/nodes", "/v1/queues", "/v1/usage", "/v1/pools", "/v1/deployments", "/healthz",
                         "/readyz", "/v1/whoami", "/v1/services"):
                r = await asyncio.wait_for(client.get(path), 5)
                assert r.status_code == 200, (path, r.text)
        finally:
            release.set()
            await held
            limiter.total_tokens = tokens
