"""The scheduler on the real stack: services in this loop, a real nats-server, nodes registered by events."""

from __future__ import annotations

import httpx

from shared import events as ev
from shared.eventlog import EventLog
from shared.events import Envelope
from tests.builders import job, node
from tests.support import eventually, in_process_stack, until


async def register(log: EventLog, *nodes) -> None:
    await log.append_many([Envelope(ev.NodeRegistered(node_id=n.node_id, node=n)) for n in nodes])


async def submit(client: httpx.AsyncClient, spec) -> str:
    r = await client.post("/v1/jobs", json=spec.model_dump(mode="json"))
    assert r.status_code == 201, r.text
    return r.json()["id"]


async def job_state(client: httpx.AsyncClient, job_id: str) -> dict:
    return (await client.get(f"/v1/jobs/{job_id}")).json()


async def wait_state(client, job_id: str, state: str, timeout: float = 10) -> dict:
    seen: dict = {}

    async def check() -> bool:
        seen.update(await job_state(client, job_id))
        return seen.get("state") == state

    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"{job_id} stayed {seen.get('state')} ({seen.get('reason')}), wanted {state}"
        await asyncio.sleep(0.05)
    return seen


async def test_three_gangs_that_fit_only_one_way_are_all_placed_that_way(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, _):
        await register(eventlog, node("a").gpus(8).build(), node("b").gpus(4).build(), node("c").gpus(2).build())
        # submitted largest-last: a greedy first fit would put the 2-GPU job on the 8-GPU node and strand the 8
        ids = [await submit(client, job("two").gpus(2).build()), await submit(client, job("four").gpus(4).build()),
               await submit(client, job("eight").gpus(8).build())]
        nodes = []
        for i in ids:
            j = await wait_state(client, i, "placed")
            nodes.append(j["placement"][0]["node"])
        assert nodes == ["c", "b", "a"]


async def test_a_gang_never_starts_partially_and_starts_when_a_cancel_frees_room(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, services):
        await register(eventlog, *(node(f"n{i}").gpus(8).rack("r1").build() for i in range(4)))
        blocker = await submit(client, job("blocker").gpus(8).build())
        await wait_state(client, blocker, "placed")
        gang = await submit(client, job("gang").gpus(8).tasks(4).build())
        waiting = await wait_state(client, gang, "queued")
        await eventually(lambda: services["scheduler"].projection.jobs[gang].reason != "", what="a reason")
        waiting = await job_state(client, gang)
        assert waiting["placement"] == [] and "4" in waiting["reason"]
        used = {u for n in (await client.get("/v1/nodes")).json() for g in n["gpus"] if g["allocated_milli"] for u in [g["uuid"]]}
        assert len(used) == 8, "only the blocker holds GPUs: nothing of the gang"
        assert (await client.delete(f"/v1/jobs/{blocker}")).status_code == 200
        placed = await wait_state(client, gang, "placed")
        assert sorted(p["node"] for p in placed["placement"]) == ["n0", "n1", "n2", "n3"]
        assert (await client.delete(f"/v1/jobs/{blocker}")).status_code == 409


async def test_a_four_gpu_task_lands_inside_one_nvlink_domain(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, services):
        nodes = [node(f"n{i}").gpus(8).nvlink_domains(2).build() for i in range(2)]
        await register(eventlog, *nodes)
        small = await submit(client, job("one").gpus(1).build())
        await wait_state(client, small, "placed")
        four = await wait_state(client, await submit(client, job("four").gpus(4).build()), "placed")
        domains = {g.uuid: g.nvlink_domain for n in nodes for g in n.gpus}
        assert len({domains[u] for u in four["placement"][0]["gpus"]}) == 1


async def test_a_rack_job_lands_in_one_rack_or_waits(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, _):
        await register(eventlog, node("a1").gpus(8).rack("a").build(), node("a2").gpus(8).rack("a").labels(pin="a2")
                       .build(), node("b1").gpus(8).rack("b").labels(pin="b1").build(), node("b2").gpus(8).rack("b").build())
        # blockers on a2 and b1 leave a1 and b2 free: 16 GPUs, but no two free nodes in one rack
        blockers = [await wait_state(client, await submit(client, job(f"blocker-{n}").gpus(8).selector(pin=n).build()),
                                     "placed") for n in ("a2", "b1")]
        rack_job = await submit(client, job("pair").gpus(8).tasks(2).topology("rack").build())

        async def told() -> dict | None:  # a cycle has looked at it: it waits, and says why
            j = await job_state(client, rack_job)
            return j if j["state"] == "queued" and j.get("reason") else None

        j = await until(told, 10, "a reason for the rack job")
        assert j["placement"] == [] and "rack" in j["reason"], j
        await client.delete(f"/v1/jobs/{blockers[1]['id']}")  # b1 frees up: rack b holds the pair
        j = await wait_state(client, rack_job, "placed")
        assert sorted(p["node"] for p in j["placement"]) == ["b1", "b2"]


BAD = [
    ("negative gpus", {"name": "x", "resources": {"gpus": -1}}),
    ("1.5 gpus", {"name": "x", "resources": {"gpus": 1.5}}),
    ("unknown priority", {"name": "x", "priority": "urgent"}),
    ("unknown queue", {"name": "x", "queue": "nope"}),
    ("zero tasks", {"name": "x", "tasks": 0}),
    ("long name", {"name": "x" * 1000}),
    ("extra field", {"name": "x", "gpus": 2}),
    ("tasks as string", {"name": "x", "tasks": "four"}),
    ("gpus as list", {"name": "x", "resources": {"gpus": [1]}}),
    ("no name", {"queue": "default"}),
    ("empty name", {"name": ""}),
    ("bad name chars", {"name": "rm -rf /"}),
    ("unknown topology", {"name": "x", "topology": "galaxy"}),
    ("negative time limit", {"name": "x", "time_limit_s": -5}),
    ("too many tasks", {"name": "x", "tasks": 100_000}),
    ("bad mig profile", {"name": "x", "gpu": {"mig": "huge"}}),
    ("env not strings", {"name": "x", "env": {"A": 1}}),
    ("command not a list", {"name": "x", "command": 5}),
    ("shape no node holds", {"name": "x", "resources": {"gpus": 16}}),
    ("model nobody has", {"name": "x", "gpu": {"models": ["B200"]}}),
]


async def test_malformed_submissions_get_422_with_a_reason_and_the_log_is_unchanged(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, _):
        await register(eventlog, node("n0").gpus(8, model="H100").build())
        before = await eventlog.last_seq()
        for label, body in BAD:
            r = await client.post("/v1/jobs", json={"command": ["true"], **body})  # refused for what the label says
            assert r.status_code == 422, f"{label}: {r.status_code} {r.text[:200]}"
            detail = r.json()["detail"]
            assert detail, label
            if isinstance(detail, list):
                assert all(d.get("msg") and d.get("loc") for d in detail), label
                assert all(d["loc"][:2] != ["body", "command"] for d in detail if label != "command not a list"), label
        r = await client.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 422
        assert await eventlog.last_seq() == before


async def test_a_second_scheduler_replica_stands_by_and_nothing_is_placed_twice(eventlog: EventLog, tmp_path):
    from services.stack import build_service
    from shared.settings import Settings
    from tests.support import running

    async with in_process_stack(eventlog) as (client, services):
        standby = build_service("scheduler", Settings(cycle_interval_s=0.3, debounce_s=0.01, instance="standby", data_dir=tmp_path))
        async with running(standby, eventlog):
            await register(eventlog, *(node(f"n{i}").gpus(8).build() for i in range(2)))
            ids = [await submit(client, job(f"j{i}").gpus(1).build()) for i in range(12)]
            for i in ids:
                await wait_state(client, i, "placed")
            placed = [e for e in (await client.get("/v1/events", params={"type": "job.placed", "limit": 100})).json()]
            assert sorted(e["data"]["job_id"] for e in placed) == sorted(ids)
            assert len({e["gpuorchepoch"] for e in placed}) == 1, "one leader decided every placement"
            assert services["scheduler"].projection.invalid_count == 0
            # the stack's scheduler shares its process's projection (fold_once); its digest is its own view of it
            assert standby.status()["digest"] == services["scheduler"].status()["digest"]


async def test_a_job_finished_long_ago_is_still_readable_from_the_sql_history(eventlog: EventLog, monkeypatch):
    import shared.cluster

    monkeypatch.setattr(shared.cluster, "KEEP_FINISHED", 2)
    async with in_process_stack(eventlog) as (client, services):
        ids = [await submit(client, job(f"j{i}").gpus(1).build()) for i in range(4)]
        for i in ids:
            assert (await client.delete(f"/v1/jobs/{i}")).status_code == 200
        assert ids[0] not in services["scheduler"].projection.jobs  # evicted from memory
        import asyncio
        import time

        deadline = time.monotonic() + 10
        while (r := await client.get(f"/v1/jobs/{ids[0]}")).status_code != 200:
            assert time.monotonic() < deadline, r.text
            await asyncio.sleep(0.1)
        assert r.json()["state"] == "cancelled" and r.json()["archived"] is True


async def test_an_admission_verdict_is_kept_only_until_the_clusters_shape_changes(eventlog: EventLog):
    """Verdicts are kept between requests (each judgement builds every node anew): a node that joins must end
    the 'never' at once."""
    async with in_process_stack(eventlog) as (client, services):
        await register(eventlog, node("small").gpus(4).build())
        big = job("big").gpus(8).build().model_dump(mode="json")
        await until(lambda: _registered(client, 1), 10, "the node")
        for _ in range(2):  # the second answer comes from the kept verdict
            r = await client.post("/v1/jobs", json=big)
            assert r.status_code == 422 and "no node could ever run this job" in r.text, r.text
        version = services["scheduler"].projection.shape_version
        await register(eventlog, node("large").gpus(8).build())
        await until(lambda: _registered(client, 2), 10, "the second node")
        assert services["scheduler"].projection.shape_version != version
        r = await client.post("/v1/jobs", json=big)
        assert r.status_code == 201, r.text


async def _registered(client: httpx.AsyncClient, n: int) -> bool:
    return len((await client.get("/v1/nodes")).json()) >= n


async def test_a_failed_jobs_reason_says_what_a_shells_code_or_a_signal_means(eventlog: EventLog, agents):
    """'task 0 exited with code 127' left a user to know that 127 is a shell's 'command not found'; a signal read as
    a bare number. The reason now says so, and where to read the task's stderr."""
    from tests.support import nodes_up

    agents("a", profile="t4-4x")
    async with in_process_stack(eventlog) as (client, _):
        await nodes_up(client, 1)
        ids = {}
        for name, script in (("missing", "no-such-program-here"), ("killed", "kill -KILL $$")):
            r = await client.post("/v1/jobs", json={"name": name, "command": ["sh", "-c", script]})
            assert r.status_code == 201, r.text
            ids[name] = r.json()["id"]
        missing = await wait_state(client, ids["missing"], "failed", 30)
        assert missing["reason"] == (f"task 0 exited with code 127 (a command it ran was not found: gpuorch logs "
                                     f"{ids['missing']} -t 0 --stderr)"), missing["reason"]
        killed = await wait_state(client, ids["killed"], "failed", 30)
        assert killed["reason"] == "task 0 was killed by signal 9 (SIGKILL)", killed["reason"]
