"""An agent's reports on their way to inventory: kept in order, retried until the bus acknowledges each.

A report (registration, task started, task exited) is never dropped and never blocks whoever made it:
``put`` queues it, ``deliver`` (one of the agent's timers) sends the queue oldest first, each attempt
bounded, and after a failure waits and tries again, however long the bus stays away. The outage is
logged once, when it starts, and once when the queue drains again.

Reports go out pipelined, up to WINDOW at once (one write to the bus, then their acknowledgements): one at a
time, each waiting for the last one's, the agent spent a third of its CPU writing to its socket. Order holds
where it matters: a batch never holds two reports of one task (its exit goes only once its start is
acknowledged; another task's reports do not wait for it), and a registration goes alone, after everything queued
before it and before anything after.

What must outlive the agent process stays on disk: a task's ``reported`` record is written only when
its exit is acknowledged (``on_acked``), so a restarted agent reports again, under the same id, what
was not acknowledged, and the stream's duplicate window stores it once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.aio import wait_event
from shared.eventlog import EventLog
from shared.events import Envelope

log = logging.getLogger("gpuorch.agent")

SEND_TIMEOUT_S = 5.0
RETRY_MAX_S = 2.0
WINDOW = 32  # reports sent before their acknowledgements are awaited
DISCONNECTED_POLL_S = 0.1  # how often a disconnected outbox looks whether the bus is back (a flag, no traffic)


@dataclass
class Report:
    env: Envelope
    subject: str
    on_acked: Callable[[], None] | None = None


class Outbox:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.pending: dict[str, Report] = {}  # by event id, oldest first: a report queued twice is sent once
        self.wake = asyncio.Event()
        self.down_since: float | None = None

    def put(self, report: Report) -> None:
        self.pending.setdefault(report.env.id, report)
        self.wake.set()

    async def deliver(self, evlog: EventLog) -> None:
        """Forever: send what is pending, in order; after a failure, wait (up to RETRY_MAX_S) and go on. While the
        connection to the bus is away, nothing is sent: nats-py reconnects by itself, and a window of appends each
        retrying every 0.1 s would only pile up publishes for the server's return."""
        backoff = 0.1
        while True:
            await wait_event(self.wake, 1.0)
            self.wake.clear()
            while self.pending:
                if not evlog.nc.is_connected:
                    self.waiting("disconnected")
                    await asyncio.sleep(DISCONNECTED_POLL_S)
                elif await self.send_batch(evlog):
                    backoff = 0.1
                else:
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RETRY_MAX_S)

    def waiting(self, why: object) -> None:
        """The outage is logged once, when it starts."""
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning("event=reports_waiting node=%s pending=%d error=%r: retried until the bus acknowledges",
                        self.node_id, len(self.pending), why)

    async def flush(self, evlog: EventLog, timeout: float) -> bool:
        """Send everything pending now (the agent is stopping); False if some is left at the deadline."""
        deadline = time.monotonic() + timeout
        while self.pending and time.monotonic() < deadline:
            if not await self.send_batch(evlog, min(SEND_TIMEOUT_S, max(0.5, deadline - time.monotonic()))):
                await asyncio.sleep(0.2)
        return not self.pending

    def batch(self) -> list[tuple[str, Report]]:
        """The oldest reports that may go out together: at most WINDOW, at most one per task (its oldest), a
        registration (a report of no task) alone: what was queued before it goes first, what after it, after."""
        out: list[tuple[str, Report]] = []
        tasks: set[tuple[str, int, int]] = set()
        for key, report in self.pending.items():
            task = _task_of(report.env)
            if task is None:
                return out or [(key, report)]
            if len(out) >= WINDOW:
                break
            if task in tasks:
                continue  # its task's earlier report first: a later batch
            tasks.add(task)
            out.append((key, report))
        return out

    async def send_batch(self, evlog: EventLog, timeout: float = SEND_TIMEOUT_S) -> bool:
        """Send ``batch()``; False if any of it failed (that one stays pending, the acknowledged ones do not)."""
        batch = self.batch()
        results = await asyncio.gather(*(evlog.append(r.env, subject=r.subject, timeout=timeout) for _, r in batch),
                                       return_exceptions=True)
        failed = None
        for (key, report), result in zip(batch, results):
            if isinstance(result, BaseException):  # whatever the bus says, the report waits for the next try
                failed = failed or result
                continue
            del self.pending[key]
            if report.on_acked is not None:
                try:
                    report.on_acked()
                except OSError as e:  # the record is lost, not the report: a restart would send it again, same id
                    log.warning("event=report_record_failed node=%s id=%s error=%r", self.node_id, key, e)
        if failed is not None:
            self.waiting(failed)
            return False
        if self.down_since is not None:
            log.info("event=reports_delivered node=%s waited_s=%.1f pending=%d", self.node_id,
                     time.monotonic() - self.down_since, len(self.pending))
            self.down_since = None
        return True


def _task_of(env: Envelope) -> tuple[str, int, int] | None:
    """The task a report is about (job, attempt, task), None for a registration."""
    e = env.data
    task = getattr(e, "task", None)
    return None if task is None else (e.job_id, e.attempt, task)
