"""The service runtime against a real nats-server: fold, snapshot, skip, dead-letter, reconnect."""

from __future__ import annotations

import asyncio
import json

from prometheus_client import generate_latest

from bench.workload import workload
from services.scheduler.projection import SchedulerProjection
from shared import events as ev
from shared.eventlog import EventLog, Undecodable
from shared.events import Envelope
from shared.model import JobSpec
from shared.natsd import NatsServer
from shared.runtime import Service
from tests.support import eventually, running, until


def scheduler(snapshot_every: int = 10_000, **kw) -> Service:
    return Service("scheduler", SchedulerProjection(), snapshot_every=snapshot_every, **kw)


async def full_replay_digest(log: EventLog) -> str:
    proj = SchedulerProjection()
    async for rec in log.replay(1):
        proj.skip(rec.seq) if isinstance(rec, Undecodable) else proj.apply(rec)
    return proj.digest()


async def test_live_projection_equals_full_replay_and_snapshot_plus_tail(eventlog: EventLog):
    envs = list(workload(600))
    svc = scheduler(snapshot_every=100)
    async with running(svc, eventlog):
        await eventlog.append_many(envs[:400])
        await eventlog.append_many(envs[400:])
        await eventlog.append(envs[5])  # a retried append: stored once, folded once
        await eventlog.append_many(envs[10:20])  # folded once even if a consumer sees them again
        await eventlog.append(Envelope(ev.JobQueued(job_id="j-late")))
        last = await eventlog.last_seq()
        await eventlog.append(Envelope(ev.JobQueued(job_id="j-late2")))
        await eventlog.append(Envelope(ev.JobQueued(job_id="j-late3")))
        last = await eventlog.last_seq()
        await eventlog_wait(svc, last)
        live = svc.projection.digest()
        assert svc.projection.invalid_count == 3  # only the three queued-without-submit events
    assert live == await full_replay_digest(eventlog)

    snap_seq, _ = await eventlog.load_snapshot("scheduler")
    assert 0 < snap_seq <= last
    restored = scheduler()
    async with running(restored, eventlog):
        assert restored.projection.seq == last
        assert restored.projection.digest() == live


async def eventlog_wait(svc: Service, seq: int) -> None:
    await eventually(lambda: svc.projection.seq >= seq, what=f"{svc.name} to fold up to seq {seq}")


async def test_snapshot_plus_tail_resumes_from_an_older_snapshot(eventlog: EventLog):
    envs = list(workload(500))
    first = scheduler()
    async with running(first, eventlog):
        await eventlog.append_many(envs[:200])
        await eventlog_wait(first, 200)
    assert (await eventlog.load_snapshot("scheduler"))[0] == 200  # saved on stop
    await eventlog.append_many(envs[200:])
    second = scheduler()
    async with running(second, eventlog):
        assert second.projection.seq == len(envs)
        assert second.projection.digest() == await full_replay_digest(eventlog)


async def test_unknown_and_malformed_events_are_skipped_counted_and_logged(eventlog: EventLog, caplog):
    svc = scheduler()
    async with running(svc, eventlog):
        await eventlog.js.publish("gpuorch.events.job.j-x", json.dumps(
            {"specversion": "1.0", "id": "u1", "source": "/future", "type": "io.gpuorch.job.teleported.v1",
             "time": "2026-01-01T00:00:00Z", "data": {}}).encode())
        await eventlog.js.publish("gpuorch.events.job.j-y", b"\x00garbage")
        await eventlog.append(Envelope(ev.JobSubmitted(job_id="j-ok", spec={"name": "ok"})))
        await eventually(lambda: "j-ok" in svc.projection.jobs, what="the service to keep going")
        assert svc.projection.seq == 3
        text = generate_latest(svc.metrics.registry).decode()
        assert 'gpuorch_events_skipped_total{reason="unknown_type",service="scheduler"} 1.0' in text
        assert 'gpuorch_events_skipped_total{reason="malformed",service="scheduler"} 1.0' in text
    assert any("skipped seq=1" in r.getMessage() and "unknown event type" in r.getMessage() for r in caplog.records)
    assert any("skipped seq=2" in r.getMessage() for r in caplog.records)


async def test_an_event_whose_reaction_keeps_failing_is_dead_lettered_with_the_reason(eventlog: EventLog):
    seen: list[str] = []

    async def react(env: Envelope) -> None:
        if getattr(env.data, "job_id", "") == "j-poison":
            seen.append(env.id)
            raise ValueError("cannot handle j-poison")

    svc = scheduler(reaction=react, max_deliver=3)
    async with running(svc, eventlog):
        await eventlog.append(Envelope(ev.JobSubmitted(job_id="j-poison", spec={"name": "p"})))
        await eventlog.append(Envelope(ev.JobSubmitted(job_id="j-fine", spec={"name": "f"})))
        await eventually(lambda: len(seen) == 3, what="three delivery attempts")
        dead: list[dict] = []

        async def dlq_has_one() -> bool:
            dead[:] = await eventlog.dead_letters("scheduler")
            return len(dead) == 1

        await eventually_async(dlq_has_one)
        assert "j-fine" in svc.projection.jobs
    assert dead[0]["subject"] == "gpuorch.dlq.scheduler.job.j-poison"
    assert dead[0]["headers"]["Gpuorch-Dlq-Reason"] == "ValueError: cannot handle j-poison"
    assert dead[0]["headers"]["Gpuorch-Dlq-Seq"] == "1"
    assert json.loads(dead[0]["body"])["data"]["job_id"] == "j-poison"
    assert svc.projection.applied == 2  # folded once, despite three deliveries


async def eventually_async(check, timeout: float = 10.0) -> None:
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def test_services_reconnect_and_catch_up_when_nats_server_restarts(nats_server: NatsServer):
    log = await EventLog.connect(nats_server.url)
    writer = await EventLog.connect(nats_server.url)
    envs = list(workload(300))
    try:
        svc = scheduler()
        async with running(svc, log):
            await writer.append_many(envs[:100])
            await eventlog_wait(svc, 100)
            nats_server.restart()  # same port, same store
            await writer.append_many(envs[100:])  # acks lost in the reconnect are retried
            await eventlog_wait(svc, len(envs))
            assert svc.projection.digest() == await full_replay_digest(writer)
    finally:
        await log.close()
        await writer.close()


def metric(svc: Service, line_start: str) -> float:
    from prometheus_client import generate_latest

    for line in generate_latest(svc.metrics.registry).decode().splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_an_event_with_a_forged_job_id_is_skipped_counted_and_never_reacted_to(eventlog: EventLog):
    seen: list[Envelope] = []

    async def react(env: Envelope) -> None:
        seen.append(env)

    svc = scheduler(reaction=react)
    async with running(svc, eventlog):
        forged = json.loads(Envelope(ev.JobSubmitted(job_id="j-x", spec={"name": "x"}), source="/gpuorch/scheduler").encode())
        forged["data"]["job_id"] = "../../../../x"  # would make the agent write its task directory outside its work dir
        await eventlog.js.publish("gpuorch.events.job.x", json.dumps(forged).encode())
        await eventlog.append(Envelope(ev.JobSubmitted(job_id="j-ok", spec={"name": "ok"})))
        await eventually(lambda: len(seen) == 1, what="the good event's reaction")
        assert svc.projection.seq == 2 and list(svc.projection.jobs) == ["j-ok"]
        assert [e.seq for e in seen] == [2]
        assert metric(svc, 'gpuorch_events_skipped_total{reason="malformed",service="scheduler"}') == 1


async def test_a_rejected_transition_is_folded_but_not_passed_to_the_reaction(eventlog: EventLog):
    from tests.builders import gpu_uuid, node

    seen: list[Envelope] = []

    async def react(env: Envelope) -> None:
        seen.append(env)

    def placed(gpu: int) -> Envelope:
        share = ev.GpuShare(uuid=gpu_uuid("n1", gpu))
        return Envelope(ev.JobPlaced(job_id="j-1", placements=(ev.TaskPlacement(task=0, node_id="n1", gpus=(share,)),)))

    svc = scheduler(reaction=react)
    async with running(svc, eventlog):
        await eventlog.append_many([
            Envelope(ev.NodeRegistered(node_id="n1", node=node("n1").gpus(2).build())),
            Envelope(ev.JobSubmitted(job_id="j-1", spec={"name": "one"})),
            Envelope(ev.JobQueued(job_id="j-1")),
            placed(0),
            placed(1),  # placed already: an agent reacting to it would start a second copy of the task
            Envelope(ev.JobCancelled(job_id="j-1")),
        ])
        await eventually(lambda: len(seen) == 5, what="five reactions")
        assert [e.data.TYPE for e in seen] == ["node.registered", "job.submitted", "job.queued", "job.placed", "job.cancelled"]
        assert svc.projection.seq == 6 and svc.projection.invalid_count == 1
        assert metric(svc, 'gpuorch_events_applied_total{service="scheduler"}') == 6  # folded, all of them
        assert svc.projection.jobs["j-1"].state == "cancelled"


def test_a_redelivered_event_is_reacted_to_again_unless_it_was_rejected():
    svc = scheduler()
    submitted = Envelope(ev.JobSubmitted(job_id="j-1", spec={"name": "one"}), seq=1)
    twice = Envelope(ev.JobSubmitted(job_id="j-1", spec={"name": "one"}), seq=2)
    assert svc._fold(submitted) is submitted and svc._fold(twice) is None
    assert svc._fold(submitted) is submitted, "a redelivery after a failed reaction runs the reaction again"
    assert svc._fold(twice) is None, "a rejected event stays rejected when it comes again"
    assert svc.projection.applied == 2 and svc.projection.seq == 2


async def test_reactions_at_once_run_beside_the_fold_and_each_settles_its_own_event(eventlog: EventLog):
    """A slow reaction holds neither the fold nor the other reactions (inventory's work writes), and every event
    is acknowledged once its own reaction is done; a failed one comes again."""
    import asyncio

    release, seen, failed_once = asyncio.Event(), [], set()

    async def react(env: Envelope) -> None:
        if env.data.job_id == "j-0":
            await release.wait()
        if env.data.job_id == "j-1" and "j-1" not in failed_once:
            failed_once.add("j-1")
            raise RuntimeError("the bus is away a moment")
        seen.append(env.data.job_id)

    svc = scheduler(reaction=react, reactions_at_once=8)
    async with running(svc, eventlog):
        await eventlog.append_many([Envelope(ev.JobSubmitted(job_id=f"j-{i}", spec=JobSpec(name="x", command=("true",))))
                                    for i in range(5)])
        await eventually(lambda: {"j-2", "j-3", "j-4"} <= set(seen), what="the later reactions, the first still running")
        assert "j-0" not in seen and svc.projection.seq >= 5, "the fold went on past the slow reaction"
        release.set()
        await eventually(lambda: {"j-0", "j-1"} <= set(seen), what="the slow and the retried reaction")
        consumer = f"svc-{svc.name}-{svc.instance}"

        async def settled() -> bool:
            info = await eventlog.js.consumer_info("GPUORCH", consumer)
            return info.num_ack_pending == 0 and info.num_pending == 0
        await until(settled, 10, "every event acknowledged")


async def test_a_timer_that_lets_a_cancellation_pass_is_cancelled_again_and_ends_with_its_service(eventlog: EventLog):
    """Python 3.11's wait_for (inside nats-py's requests) can return a reply that arrived with the cancellation and
    drop it: a timer that loops for ever then ran on, and every stop of the split scheduler waited 5 s for it."""
    cancels, started = [], asyncio.Event()

    async def loses_one_cancellation(svc: Service) -> None:
        started.set()
        while True:
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                cancels.append(1)
                if len(cancels) > 1:
                    raise
                asyncio.current_task().uncancel()  # as wait_for does when the reply wins

    svc = scheduler(timers=[loses_one_cancellation])
    async with running(svc, eventlog):
        await asyncio.wait_for(started.wait(), 10)
    assert len(cancels) == 2  # cancelled again, and it ended: before, it ran on and stop gave up on it after 5 s


def queued(svc: Service, jobs: int) -> Service:
    """``svc`` with ``jobs`` one-GPU jobs queued in its projection, at sequence 2 x ``jobs``."""
    spec = JobSpec(name="x", command=["true"], resources={"gpus": 1})
    for i in range(jobs):
        svc.projection.apply(Envelope(ev.JobSubmitted(job_id=f"j-{i:05d}", spec=spec), seq=2 * i + 1))
        svc.projection.apply(Envelope(ev.JobQueued(job_id=f"j-{i:05d}"), seq=2 * i + 2))
    return svc


async def turns_while_answering(svc: Service, path: str) -> tuple[object, int]:
    """(the answer to ``GET path`` of ``svc``'s ops routes, how many times the event loop turned meanwhile)."""
    import httpx
    from fastapi import FastAPI

    from shared.runtime import ops_router

    app = FastAPI()
    app.include_router(ops_router([svc]))
    turns = 0

    async def turning() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1
    ticker = asyncio.create_task(turning())
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gpuorch") as client:
            await asyncio.sleep(0)
            before = turns
            r = await client.get(path)
            return r, turns - before
    finally:
        ticker.cancel()


async def test_the_services_digests_are_made_off_the_event_loop():
    """/v1/services digests each service's whole state (0.6 s for 20,000 jobs): on the loop it held every request
    that long; it is made in a thread (while the folds are held), and the loop keeps turning meanwhile."""
    svc = queued(scheduler(), 5000)
    r, during = await turns_while_answering(svc, "/v1/services")
    assert r.status_code == 200 and r.json()[0]["seq"] == 10_000
    assert r.json()[0]["digest"] == svc.projection.digest(svc.state_keys)
    assert during > 10, f"the loop turned {during} times while the digest was made: it was made on the loop"


async def test_a_metrics_scrape_walks_the_jobs_off_the_event_loop():
    """A scrape's collectors walk every job (at 20,000 queued jobs 90-220 ms): made on the loop, each scrape held
    every request that long; it is made in a thread (while the folds are held), and the loop keeps turning."""
    from services.scheduler.metrics import SchedulerCollector

    svc = queued(scheduler(), 20_000)
    svc.metrics.own("scheduler-collector", lambda r: r.register(SchedulerCollector(lambda: svc.projection)))
    r, during = await turns_while_answering(svc, "/metrics")
    assert r.status_code == 200 and 'gpuorch_jobs_pending{priority="normal",queue="default"} 20000.0' in r.text
    assert during > 10, f"the loop turned {during} times while the collectors walked the jobs: it was on the loop"


async def test_a_service_that_has_not_caught_up_with_the_log_answers_503_starting_not_from_an_empty_projection(
        eventlog):
    """A service started again serves HTTP while it connects and replays: its routes answer 503 with Retry-After and
    x-gpuorch-starting until it is ready (a submission there failed 500 on a log not yet connected; a job read
    there would have been unknown). The ops routes answer meanwhile."""
    from shared.runtime import STARTING
    from tests.support import in_process_stack

    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, services):
        assert (await client.get("/v1/jobs")).status_code == 200
        services["scheduler"].ready.clear()
        r = await client.post("/v1/jobs", json={"name": "j", "resources": {"gpus": 0}, "command": ["true"]})
        assert r.status_code == 503 and r.headers[STARTING] == "scheduler" and r.headers["retry-after"] == "1", r.text
        assert "scheduler is starting" in r.json()["detail"]
        assert (await client.get("/v1/jobs")).status_code == 503
        assert (await client.get("/healthz")).status_code == 200
        services["scheduler"].ready.set()
        assert (await client.get("/v1/jobs")).status_code == 200
