"""The agent's outbox sends its reports pipelined, and keeps the order that matters: a task's exit only after its
start is acknowledged, a registration alone, after what was queued before it. Against a real nats-server."""

from __future__ import annotations

import asyncio

from shared import events as ev
from shared.eventlog import AGENT_STREAM, EventLog
from shared.events import Envelope
from shared.model import NodeInfo
from shared.natsauth import report_subject
from shared.natsd import NatsServer
from shared.profiles import build
from services.inventory.outbox import WINDOW, Outbox, Report
from tests.support import until

NODE = "n1"


def started(job: str, task: int = 0, subject: str | None = None) -> Report:
    e = ev.JobTaskStarted(job_id=job, task=task, node_id=NODE, pid=100 + task, attempt=1)
    return Report(Envelope(e, id=f"{job}-{task}-started"), subject or report_subject(NODE, "task_started"))


def exited(job: str, task: int = 0) -> Report:
    e = ev.JobTaskExited(job_id=job, task=task, node_id=NODE, code=0, attempt=1)
    return Report(Envelope(e, id=f"{job}-{task}-exited"), report_subject(NODE, "task_exited"))


def registered() -> Report:
    node: NodeInfo = build("t4-4x", NODE)
    return Report(Envelope(ev.NodeRegistered(node_id=NODE, node=node), id="reg"), report_subject(NODE, "node_registered"))


def queue(*reports: Report) -> Outbox:
    box = Outbox(NODE)
    for r in reports:
        box.put(r)
    return box


def ids(batch: list[tuple[str, Report]]) -> list[str]:
    return [key for key, _ in batch]


def test_a_batch_holds_one_report_per_task_and_a_registration_alone() -> None:
    box = queue(started("a"), started("b"), exited("a"), started("c"))
    assert ids(box.batch()) == ["a-0-started", "b-0-started", "c-0-started"], \
        "a's exit waits for its start's acknowledgement; c's start does not wait for a's exit"
    box = queue(started("a"), started("a", task=1), registered(), started("b"))
    assert ids(box.batch()) == ["a-0-started", "a-0-started".replace("-0-", "-1-")], "tasks of one job are apart"
    del box.pending["a-0-started"], box.pending["a-1-started"]
    assert ids(box.batch()) == ["reg"], "a registration goes alone"
    del box.pending["reg"]
    assert ids(box.batch()) == ["b-0-started"]
    box = queue(*(started(f"j{i}") for i in range(WINDOW + 5)))
    assert len(box.batch()) == WINDOW


async def _stored(log: EventLog) -> list[str]:
    info = await log.js.stream_info(AGENT_STREAM)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await log.js.get_msg(AGENT_STREAM, seq)
        out.append(msg.headers["Nats-Msg-Id"])
    return out


async def test_a_window_of_reports_is_acknowledged_in_one_send_in_order(eventlog: EventLog) -> None:
    box = queue(*(started(f"j{i}") for i in range(WINDOW + 3)))
    acked: list[str] = []
    for key, r in box.pending.items():
        r.on_acked = (lambda k: lambda: acked.append(k))(key)
    assert await box.send_batch(eventlog)
    assert len(acked) == WINDOW and len(box.pending) == 3, "one send: a whole window acknowledged"
    assert await box.send_batch(eventlog)
    assert not box.pending
    assert await _stored(eventlog) == [f"j{i}-0-started" for i in range(WINDOW + 3)], "stored in the queue's order"


async def test_a_report_that_fails_stays_with_what_follows_it_for_its_task(eventlog: EventLog) -> None:
    """A start that the bus refuses (no stream takes its subject) keeps its task's exit queued behind it; the
    other tasks' reports are acknowledged and leave the queue, in batches that pass over the held task."""
    box = queue(started("a", subject="gpuorch.nowhere.n1"), started("b"), exited("a"), exited("b"))
    assert not await box.send_batch(eventlog, timeout=0.3)
    assert list(box.pending) == ["a-0-started", "a-0-exited", "b-0-exited"]
    assert await _stored(eventlog) == ["b-0-started"], "a's exit was not sent before its start"
    assert not await box.send_batch(eventlog, timeout=0.3)  # a's start fails again, a's exit waits, b's exit goes
    assert list(box.pending) == ["a-0-started", "a-0-exited"]
    assert await _stored(eventlog) == ["b-0-started", "b-0-exited"]


async def test_nothing_is_sent_while_the_bus_is_away_and_everything_goes_in_order_once_it_is_back(
        nats_server: NatsServer) -> None:
    """A stopped nats-server: the outbox sends nothing (each append of a window would retry every 0.1 s, and the
    publishes would pile up for the server's return), then sends all of it once the connection is back."""
    log = await EventLog.connect(nats_server.url)
    box = queue(*(started(f"j{i}") for i in range(5)))
    tried: list[str] = []
    append = log.append

    async def counted(env: Envelope, **kw: object) -> int:  # our own client, counted; the bus is real
        tried.append(env.id)
        return await append(env, **kw)

    log.append = counted  # type: ignore[method-assign]
    deliver = None
    try:
        nats_server.stop()

        async def away() -> bool:
            return not log.nc.is_connected

        await until(away, 10, "the client to see the server gone")
        deliver = asyncio.create_task(box.deliver(log))
        await asyncio.sleep(1.0)  # ten of its looks at the connection: what it does while the bus is away
        assert tried == [] and len(box.pending) == 5, tried
        nats_server.start()

        async def drained() -> bool:
            return not box.pending

        await until(drained, 30, "the reports to be acknowledged")
        assert await _stored(log) == [f"j{i}-0-started" for i in range(5)]
        assert tried == [f"j{i}-0-started" for i in range(5)], "each sent once: no publishes piled up"
    finally:
        if deliver is not None:
            deliver.cancel()
        await log.close()
