"""A reaction that keeps failing is dead-lettered, whatever headers its event was appended with, and never
takes its process down."""

from __future__ import annotations

import asyncio
import time

from services.scheduler.projection import SchedulerProjection
from shared import events as ev
from shared.eventlog import EventLog
from shared.events import Envelope
from shared.runtime import Service
from tests.support import eventually, running


async def dead_letters(log: EventLog, service: str, n: int, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        dead = await log.dead_letters(service)
        if len(dead) >= n or time.monotonic() > deadline:
            return dead
        await asyncio.sleep(0.1)


async def test_an_event_appended_with_an_expected_sequence_is_dead_lettered_and_the_service_goes_on(eventlog: EventLog):
    async def react(env: Envelope) -> None:
        if isinstance(env.data, ev.JobCancelled) and env.data.job_id == "j-poison":
            raise RuntimeError("cannot stop j-poison")

    svc = Service("scheduler", SchedulerProjection(), reaction=react, max_deliver=2, instance="dlq")
    async with running(svc, eventlog):
        seq = await eventlog.append(Envelope(ev.JobSubmitted(job_id="j-poison", spec={"name": "p"})))
        # as the scheduler appends its decisions: against the job's last sequence
        await eventlog.append(Envelope(ev.JobCancelled(job_id="j-poison", reason="x")), expected_last_subject_seq=seq)
        [dead] = await dead_letters(eventlog, "scheduler", 1)
        await eventlog.append(Envelope(ev.JobSubmitted(job_id="j-next", spec={"name": "n"})))
        await eventually(lambda: "j-next" in svc.projection.jobs, what="the service to keep folding")
    assert dead["subject"] == "gpuorch.dlq.scheduler.job.j-poison"
    assert dead["headers"]["Gpuorch-Dlq-Reason"] == "RuntimeError: cannot stop j-poison"
    assert dead["headers"]["Gpuorch-Dlq-Seq"] == "2"
    assert not any(k.lower().startswith("nats-expected") for k in dead["headers"])
    assert dead["headers"]["ce-type"] == "io.gpuorch.job.cancelled.v1"  # the event's own headers travel with it


async def test_a_failing_dead_letter_terminates_the_message_and_the_service_goes_on(eventlog: EventLog, monkeypatch):
    async def react(env: Envelope) -> None:
        if getattr(env.data, "job_id", "") == "j-poison":
            raise RuntimeError("poison")

    async def broken(*a, **kw) -> None:
        raise ConnectionError("dead-letter stream unavailable")

    monkeypatch.setattr(eventlog, "dead_letter", broken)
    svc = Service("scheduler", SchedulerProjection(), reaction=react, max_deliver=2, instance="dlq")
    async with running(svc, eventlog):
        await eventlog.append(Envelope(ev.JobSubmitted(job_id="j-poison", spec={"name": "p"})))
        await eventlog.append(Envelope(ev.JobSubmitted(job_id="j-next", spec={"name": "n"})))
        await eventually(lambda: "j-next" in svc.projection.jobs, what="the service to keep folding")
        await asyncio.sleep(0.5)
        info = await eventlog.js.consumer_info("GPUORCH", "svc-scheduler-dlq")
        assert info.num_ack_pending == 0 and info.num_redelivered <= 1  # terminated, not redelivered forever
