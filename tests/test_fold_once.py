"""Fold once per process (issue 15): the services of one process share one projection, fold each event once, and
still each answer the digest of their own projection, as if it ran alone."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from services.cli import verify_log
from shared.eventlog import EventLog
from tests.builders import job, node
from tests.test_scheduler_stack import register
from tests.support import eventually, in_process_stack


def counted(text: str, family: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == family
               for s in f.samples if s.name.endswith("_total"))


async def workload(client, eventlog: EventLog) -> None:
    await register(eventlog, node("n1").gpus(8).build(), node("n2").gpus(8).build())
    await client.post("/v1/jobs", json=[job(f"j{i}").gpus(1 + i % 4).build().model_dump(mode="json") for i in range(12)])
    await client.post("/v1/jobs", json=job("too-big").gpus(64).build().model_dump(mode="json"))  # refused: a 4xx


async def same_position(eventlog: EventLog, services: dict) -> tuple[dict, dict]:
    """Each service's status and the log replayed alone through each projection, at one position of the log (the
    stack's reactions may still append: try again until both sides saw the same events)."""
    for _ in range(50):
        head = await eventlog.last_seq()
        await eventually(lambda: all(s.projection.seq >= head for s in services.values()), what="every service to fold")
        live = {s.name: s.status() for s in services.values()}
        alone = {r["service"]: r for r in await verify_log(eventlog)}
        if {s["seq"] for s in live.values()} == {r["seq"] for r in alone.values()}:
            return live, alone
    raise AssertionError("the log never stood still")


async def test_the_services_of_one_process_fold_each_event_once_into_one_projection(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, services):
        assert len({id(s.projection) for s in services.values()}) == 1
        await workload(client, eventlog)
        head = await eventlog.last_seq()
        await eventually(lambda: all(s.projection.seq >= head for s in services.values()), what="every service to fold")
        before = services["scheduler"].projection.seq
        text = (await client.get("/metrics")).text
        after = services["scheduler"].projection.seq
        folds = counted(text, "gpuorch_events_applied") + counted(text, "gpuorch_events_skipped")
        # an event is folded by one of the five consumers; the others run their reactions only (one fold per service
        # would make it 5x); the log is new: it holds nothing the stack did not fold
        assert before <= folds <= after, f"{folds} folds for {before}..{after} events"


async def test_each_service_answers_the_digest_of_its_own_projection_replayed_alone(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, services):
        await workload(client, eventlog)
        live, alone = await same_position(eventlog, services)
        assert {n: s["digest"] for n, s in live.items()} == {n: alone[n]["digest"] for n in live}
        assert {n: s["applied"] for n, s in live.items()} == {n: alone[n]["applied"] for n in live}
        assert len({s["digest"] for s in live.values()}) > 1, "health and the autoscaler hold more than the others"


async def test_a_restart_restores_one_snapshot_for_the_process_and_replays_to_the_same_digests(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, services):
        await workload(client, eventlog)
        head = await eventlog.last_seq()
        await eventually(lambda: all(s.projection.seq >= head for s in services.values()), what="every service to fold")
    shared_name = "+".join(sorted(services))
    saved = await eventlog.load_snapshot(shared_name)
    assert saved is not None, "the last service to stop saved the process's snapshot"
    assert [n for n in services if await eventlog.load_snapshot(n) is not None] == [], "one snapshot, not one each"
    async with in_process_stack(eventlog) as (client, again):
        assert len({id(s.projection) for s in again.values()}) == 1
        assert again["scheduler"].fold.restored, "the process started from its snapshot, not from the log"
        live, alone = await same_position(eventlog, again)
        assert {n: s["digest"] for n, s in live.items()} == {n: alone[n]["digest"] for n in live}


async def test_a_service_without_a_reaction_rides_on_the_folds_of_its_process_with_no_consumer_of_its_own(
        eventlog: EventLog):
    """Quota, autoscaler and health need no event delivered to them: beside the services with a reaction
    (scheduler, inventory), a consumer of theirs would only deliver and acknowledge every event again (three in five
    deliveries). They make none, and still see every event folded, their timers woken, their digests their own;
    health's watch (its wake and trace notes) sees each event once, as the process first folds it."""
    async with in_process_stack(eventlog) as (client, services):
        riders = {n for n, s in services.items() if s.reaction is None}
        assert riders == {"quota", "autoscaler", "health"}
        health = services["health"]
        seen: list[str] = []
        watch = health.watch
        health.watch = lambda env: (seen.append(env.id), watch(env))
        await workload(client, eventlog)
        live, alone = await same_position(eventlog, services)
        assert {n: live[n]["digest"] for n in riders} == {n: alone[n]["digest"] for n in riders}
        consumers = {c.name for c in await eventlog.js.consumers_info("GPUORCH") if c.config.durable_name}
        assert {n for n in services if any(c.startswith(f"svc-{n}-") for c in consumers)} \
            == set(services) - riders, consumers
        placed = [r.id for r in await eventlog.read(0, limit=1000) if r.data.TYPE in ("job.placed", "node.registered")]
        assert placed and set(placed) <= set(seen), "health watched every placement and registration"
        assert len(seen) == len(set(seen)), "each event watched once, though two consumers delivered it"
        services["quota"].changed.clear()
        head = await eventlog.last_seq()
        await client.post("/v1/jobs", json=job("one-more").gpus(1).build().model_dump(mode="json"))
        await eventually(lambda: services["quota"].changed.is_set(), what="the quota service to be told of the fold")
        later = [r.id for r in await eventlog.read(head, limit=1000)]
        await eventually(lambda: later and set(later) <= set(seen), what="health to watch the new job's events")
