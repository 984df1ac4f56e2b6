"""Agents' reports into the event log: the node named by the subject (the bus authenticated it) is the reporter.

An agent may not append to the log. It publishes what it has to say (registered,
a task started, a task exited) on ``gpuorch.agent.<node>.<kind>``, a subject only
that node's credentials may publish on, into the stream GPUORCH_AGENT. Inventory
reads that stream, keeps only the kinds an agent may report and only about its own
node, stamps the source (``/gpuorch/agent/<node>``) and the time (the server's, when
the report arrived), and appends the event. Everything else is dead-lettered with
the reason. Whether the task was placed on that node is the fold's check
(shared.cluster): the log is the judge, here and on every replay.
"""

from __future__ import annotations

import contextlib
import logging

from nats.aio.msg import Msg

from shared import events as ev
from shared.aio import Window
from shared.eventlog import AGENT_STREAM
from shared.events import Envelope, MalformedEvent, UnknownEventType, decode
from shared.natsauth import node_of_subject
from shared.runtime import Service
from shared.telemetry import processing

log = logging.getLogger("gpuorch.inventory.relay")

REPORTS = (ev.NodeRegistered, ev.JobTaskStarted, ev.JobTaskExited)


def report_error(node: str | None, env: Envelope) -> str | None:
    """Why this report may not enter the log (None: it may)."""
    e = env.data
    if node is None:
        return "not on an agent's subject"
    if not isinstance(e, REPORTS):
        return f"an agent may not report {e.TYPE}"
    if e.node_id != node or (isinstance(e, ev.NodeRegistered) and e.node.node_id != node):
        return f"agent {node} reported for node {e.node_id}"
    return None


def relayed(node: str, env: Envelope, msg: Msg, traceparent: str | None = None) -> Envelope:
    """The report as the log's event: the agent's trace context goes on (``traceparent``: the relay's own span)."""
    return Envelope(env.data, id=env.id, source=f"/gpuorch/agent/{node}", time=msg.metadata.timestamp,
                    traceparent=traceparent or env.traceparent)


RELAY_WINDOW = 256  # reports being appended at once: pipelined on the one connection, so stored in arrival order


async def relay(svc: Service) -> None:
    """A service timer: every inventory replica shares one durable consumer, so each report is appended once.
    Appends are pipelined (a window of RELAY_WINDOW): each report's append is sent as it arrives, without waiting
    for the previous one's acknowledgement (one at a time, the relay was the slowest stage from a task's exit to
    its job's end), and each report is acknowledged once its own append is."""
    assert svc.log is not None
    appending = Window(RELAY_WINDOW)

    async def append(node: str, env: Envelope, msg: Msg) -> None:
        assert svc.log is not None
        try:
            with processing(msg.subject, env.traceparent, "inventory-relay") as traceparent:
                await svc.log.append(relayed(node, env, msg, traceparent), timeout=5)
        except Exception as e:  # noqa: BLE001 - the log is away: the report stays in its stream and comes again
            log.warning("event=report_relay_failed subject=%s id=%s error=%r action=retry", msg.subject, env.id, e)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1)
            return
        await msg.ack()

    async def on_report(_: object, msg: Msg) -> None:
        node = node_of_subject(msg.subject, "gpuorch.agent")
        try:
            env = decode(msg.data)
        except (MalformedEvent, UnknownEventType) as e:
            why = f"undecodable: {e}"
        else:
            why = report_error(node, env)
        if why is not None:
            log.warning("event=report_refused subject=%s reason=%r", msg.subject, why)
            svc.metrics.skipped.labels(svc.name, "agent_report").inc()
            await svc.log.dead_letter(msg, "inventory-relay", why)
            return
        assert node is not None
        await appending.start(append, node, env, msg)  # started in arrival order: the appends go out in order

    # never given up on (max_deliver -1): an agent's report is relayed however long the log was away
    try:
        await svc.log.consume("inventory-relay", on_report, stop=svc.stop_event, stream=AGENT_STREAM,
                              subject="gpuorch.agent.>", max_deliver=-1)
    finally:
        await appending.drain(5)  # the appends under way settle their reports (an unsettled one comes again)
