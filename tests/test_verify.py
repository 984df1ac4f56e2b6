"""`gpuorch events verify` tells the rejections the log is built to absorb from real invalid transitions."""

from __future__ import annotations

import asyncio
import json

from typer.testing import CliRunner

from services import cli
from shared import events as ev
from shared.cluster import agent_source
from shared.eventlog import EventLog
from shared.events import Envelope, GpuShare, TaskPlacement
from tests.builders import gpu_uuid, job, node

SCHEDULER = "/gpuorch/scheduler"


async def absorbable_log(url: str) -> None:
    """A poison message, an unknown event type, a stale leader's fenced decision, a task report from another node."""
    log = await EventLog.connect(url)
    try:
        await log.js.publish("gpuorch.events.job.j-poison", b"{not json")
        await log.js.publish("gpuorch.events.job.j-future", json.dumps(
            {"specversion": "1.0", "id": "u1", "source": "/future", "type": "io.gpuorch.job.teleported.v1",
             "time": "2026-01-01T00:00:00Z", "data": {}}).encode())
        placed = ev.JobPlaced(job_id="j-1", placements=(
            TaskPlacement(task=0, node_id="n1", gpus=(GpuShare(uuid=gpu_uuid("n1", 0)),)),))
        await log.append_many([
            Envelope(ev.NodeRegistered(node_id="n1", node=node("n1").gpus(2).build()), source=agent_source("n1")),
            Envelope(ev.LeaderElected(lease="scheduler", source=SCHEDULER, epoch=4, holder="old"), source=SCHEDULER),
            Envelope(ev.JobSubmitted(job_id="j-1", spec=job("one").gpus(1).build()), source=SCHEDULER),
            Envelope(ev.JobQueued(job_id="j-1"), source=SCHEDULER),
            Envelope(ev.LeaderElected(lease="scheduler", source=SCHEDULER, epoch=9, holder="new"), source=SCHEDULER),
            Envelope(placed, source=SCHEDULER, epoch=9),
            Envelope(ev.JobUnschedulable(job_id="j-1", reason="the old leader, late"), source=SCHEDULER, epoch=4),
            Envelope(ev.JobTaskStarted(job_id="j-1", task=0, node_id="n1", pid=7), source=agent_source("n2")),
            Envelope(ev.JobTaskStarted(job_id="j-1", task=0, node_id="n1", pid=7), source=agent_source("n1")),
        ])
    finally:
        await log.close()


async def append(url: str, *envs: Envelope) -> None:
    log = await EventLog.connect(url)
    try:
        await log.append_many(list(envs))
    finally:
        await log.close()


def verify(url: str, *args: str):
    return CliRunner().invoke(cli.app, ["events", "verify", "--nats", url, *args])


def test_verify_passes_a_log_with_only_skipped_fenced_and_refused_events_and_says_how_many(nats_url: str):
    asyncio.run(absorbable_log(nats_url))

    result = verify(nats_url)

    assert result.exit_code == 0, result.output
    assert "log verified: 2 skipped, 1 fenced, 1 refused, as expected" in result.output
    assert "fenced: seq=9 io.gpuorch.job.unschedulable.v1 job/j-1: epoch 4 is not the current term 9" in result.output
    assert "refused: seq=10 io.gpuorch.job.task_started.v1 job/j-1: task 0 on n1 reported by /gpuorch/agent/n2" in result.output
    [scheduler] = [r for r in json.loads(verify(nats_url, "--json").output) if r["service"] == "scheduler"]
    assert (scheduler["invalid_transitions"], scheduler["fenced"], scheduler["refused"], scheduler["skipped"]) == (0, 1, 1, 2)


def test_verify_fails_on_a_real_invalid_transition_among_the_expected_ones(nats_url: str):
    asyncio.run(absorbable_log(nats_url))
    asyncio.run(append(nats_url, Envelope(ev.JobQueued(job_id="j-never-submitted"), source=SCHEDULER)))

    result = verify(nats_url)

    assert result.exit_code == 1, result.output
    assert "invalid: seq=12 io.gpuorch.job.queued.v1 job/j-never-submitted" in result.output
    assert "1 invalid transition(s) found (and 2 skipped, 1 fenced, 1 refused)" in result.output


def test_a_cancellation_of_a_job_that_ended_meanwhile_is_late_not_invalid(nats_url: str):
    """A cancel appended after the caller saw the job running, folded after its task exited and it succeeded (or
    after another cancel): every cancel can lose that race, and `gpuorch cancel` over many jobs often does."""
    asyncio.run(absorbable_log(nats_url))
    asyncio.run(append(
        nats_url,
        Envelope(ev.JobTaskExited(job_id="j-1", task=0, node_id="n1", code=0), source=agent_source("n1")),
        Envelope(ev.JobSucceeded(job_id="j-1"), source=SCHEDULER),
        Envelope(ev.JobCancelled(job_id="j-1", reason="cancelled by alice"), source=SCHEDULER)))

    result = verify(nats_url)

    assert result.exit_code == 0, result.output
    assert "log verified: 2 skipped, 1 fenced, 1 refused, 1 late, as expected" in result.output, result.output
    assert "late: seq=14 io.gpuorch.job.cancelled.v1 job/j-1: job j-1 had already succeeded" in result.output



def test_a_late_cancellation_of_a_job_dropped_from_memory_is_late_too(nats_url: str, monkeypatch):
    """Only the last KEEP_FINISHED ended jobs are held: in a bulk cancel, a job that ends by itself before its own
    cancellation is folded can be dropped by the thousands of cancellations folded before it."""
    from shared import cluster

    monkeypatch.setattr(cluster, "KEEP_FINISHED", 1)
    asyncio.run(absorbable_log(nats_url))
    asyncio.run(append(
        nats_url,
        Envelope(ev.JobTaskExited(job_id="j-1", task=0, node_id="n1", code=0), source=agent_source("n1")),
        Envelope(ev.JobSucceeded(job_id="j-1"), source=SCHEDULER),
        Envelope(ev.JobSubmitted(job_id="j-2", spec=job("two").gpus(1).build()), source=SCHEDULER),
        Envelope(ev.JobCancelled(job_id="j-2", reason="cancelled by alice"), source=SCHEDULER),  # drops j-1
        Envelope(ev.JobCancelled(job_id="j-1", reason="cancelled by alice"), source=SCHEDULER)))

    result = verify(nats_url)

    assert result.exit_code == 0, result.output
    assert "late: seq=16 io.gpuorch.job.cancelled.v1 job/j-1: job j-1 is not held" in result.output, result.output


def test_a_reason_folded_after_its_job_moved_on_is_late_not_invalid(nats_url: str):
    """A cycle reads a job queued and gives it a reason; reasons go in batches without the job's sequence, so a
    cancellation (a bulk one, most often) can be folded first."""
    asyncio.run(absorbable_log(nats_url))
    asyncio.run(append(
        nats_url,
        Envelope(ev.JobSubmitted(job_id="j-2", spec=job("two").gpus(1).build()), source=SCHEDULER),
        Envelope(ev.JobQueued(job_id="j-2"), source=SCHEDULER),
        Envelope(ev.JobCancelled(job_id="j-2", reason="cancelled by alice"), source=SCHEDULER),
        Envelope(ev.JobUnschedulable(job_id="j-2", reason="needs 8 GPUs"), source=SCHEDULER, epoch=9)))

    result = verify(nats_url)

    assert result.exit_code == 0, result.output
    assert "late: seq=15 io.gpuorch.job.unschedulable.v1 job/j-2: job j-2 is cancelled: the reason came after" \
        in result.output, result.output
