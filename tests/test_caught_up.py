"""Read-your-writes or a 503: an API that appended and cannot fold its own event in time says so, with the
reason, rather than answer from the state before it."""

from __future__ import annotations

import asyncio
import re

import pytest
from fastapi import FastAPI
from httpx import ASGITransport, AsyncClient

from services.scheduler.projection import SchedulerProjection
from shared import api_errors
from shared import events as ev
from shared.eventlog import EventLog
from shared.events import Envelope
from shared.model import QueueSpec
from shared.runtime import NotCaughtUp, Service
from tests.builders import job, node
from tests.support import eventually, in_process_stack


async def test_caught_up_returns_once_the_fold_reached_the_sequence_and_raises_after_the_timeout():
    svc = Service("scheduler", SchedulerProjection())
    svc.projection.seq = 7
    await svc.caught_up(7)
    await svc.caught_up(3)

    with pytest.raises(NotCaughtUp) as e:
        await svc.caught_up(9, timeout=0.05)
    assert str(e.value) == "the scheduler service has not caught up with the log (seq 7 < 9) within 0.05 s; retry"
    assert (e.value.folded, e.value.wanted) == (7, 9)

    svc.catch_up_timeout_s = 0.01
    with pytest.raises(NotCaughtUp, match=r"within 0.01 s; read it later$"):
        await svc.caught_up(8, advice="read it later")


async def test_a_service_that_has_not_caught_up_answers_503_with_the_reason_and_retry_after():
    app = FastAPI()
    api_errors.install(app)

    @app.get("/stale")
    async def stale() -> None:
        raise NotCaughtUp("quota", 3, 5, 2.0)

    async with AsyncClient(transport=ASGITransport(app=app), base_url="http://t") as client:
        r = await client.get("/stale")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json() == {"detail": "the quota service has not caught up with the log (seq 3 < 5) within 2 s; retry"}


async def first_record(log: EventLog, seq: int) -> Envelope:
    async for rec in log.replay(seq):
        return rec
    raise AssertionError(f"nothing at seq {seq}")


STALE = re.compile(r"the (\w+) service has not caught up with the log \(seq (\d+) < (\d+)\) within 0.2 s; (.*)")


async def test_an_api_that_appended_but_cannot_fold_its_event_answers_503_not_the_state_before(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, services):
        await eventlog.append(Envelope(ev.NodeRegistered(node_id="n1", node=node("n1").gpus(2).build())))
        scheduler, quota = services["scheduler"], services["quota"]
        await eventually(lambda: "n1" in scheduler.projection.nodes, what="the scheduler to know n1")
        gate, holding = asyncio.Event(), set()

        def hold(svc: Service) -> None:
            async def held(env: Envelope) -> None:  # a reaction that does not end: the fold stops behind it
                holding.add(svc.name)
                await gate.wait()
            svc.reaction, svc.catch_up_timeout_s = held, 0.2
            svc.reactions_at_once = 1  # one at a time, as the fold's own step: a reaction that hangs holds the fold

        # the services of a process fold one projection: any of those with a consumer may fold next (the others
        # ride on their folds)
        consumers = {name for name, svc in services.items() if not svc.rides_along()}
        for svc in services.values():
            hold(svc)
        try:
            await eventlog.append(Envelope(ev.QueueDefined(path="other", spec=QueueSpec())))
            await eventually(lambda: holding == consumers, what="every fold to stop")

            r = await client.put("/v1/queues/research", json={"guaranteed": {"gpus": 1}})
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            service, folded, wanted, advice = STALE.fullmatch(r.json()["detail"]).groups()
            assert (service, int(folded), advice) == ("quota", quota.projection.seq, "retry")
            assert (await first_record(eventlog, int(wanted))).data == ev.QueueDefined(
                path="research", spec=QueueSpec(guaranteed={"gpus": 1})), "it waited for its own event"
            assert "research" not in quota.projection.queues, "and answered nothing from the state before it"

            r = await client.post("/v1/jobs", json=job("train").gpus(1).build().model_dump(mode="json"))
            assert r.status_code == 503, r.text
            service, folded, wanted, advice = STALE.fullmatch(r.json()["detail"]).groups()
            queued = (await first_record(eventlog, int(wanted))).data
            assert (service, int(folded), type(queued)) == ("scheduler", scheduler.projection.seq, ev.JobQueued)
            assert advice == (f"job {queued.job_id} is recorded: read it with GET /v1/jobs/{queued.job_id} rather than "
                              "submitting it again")
        finally:
            gate.set()
        await eventually(lambda: queued.job_id in scheduler.projection.jobs, what="the scheduler to catch up")
        assert (await client.get(f"/v1/jobs/{queued.job_id}")).status_code == 200
