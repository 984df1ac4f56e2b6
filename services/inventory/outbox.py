"""An agent's reports on their way to inventory: kept in order, retried until the bus acknowledges each.

A report (registration, task started, task exited) is never dropped and never blocks whoever made it:
``put`` queues it, ``deliver`` (one of the agent's timers) sends the queue oldest first, each attempt
bounded, and after a failure waits and tries again, however long the bus stays away. The outage is
logged once, when it starts, and once when the queue drains again.

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
        """Forever: send what is pending, in order; after a failure, wait (up to RETRY_MAX_S) and go on."""
        backoff = 0.1
        while True:
            await wait_event(self.wake, 1.0)
            self.wake.clear()
            while self.pending:
                if await self.send_one(evlog):
                    backoff = 0.1
                else:
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RETRY_MAX_S)

    async def flush(self, evlog: EventLog, timeout: float) -> bool:
        """Send everything pending now (the agent is stopping); False if some is left at the deadline."""
        deadline = time.monotonic() + timeout
        while self.pending and time.monotonic() < deadline:
            if not await self.send_one(evlog, min(SEND_TIMEOUT_S, max(0.5, deadline - time.monotonic()))):
                await asyncio.sleep(0.2)
        return not self.pending

    async def send_one(self, evlog: EventLog, timeout: float = SEND_TIMEOUT_S) -> bool:
        key, report = next(iter(self.pending.items()))
        try:
            await evlog.append(report.env, subject=report.subject, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - whatever the bus says, the report waits for the next try
            if self.down_since is None:
                self.down_since = time.monotonic()
                log.warning("event=reports_waiting node=%s pending=%d error=%r: retried until the bus acknowledges",
                            self.node_id, len(self.pending), e)
            return False
        del self.pending[key]
        if report.on_acked is not None:
            try:
                report.on_acked()
            except OSError as e:  # the record is lost, not the report: a restart would send it again, same id
                log.warning("event=report_record_failed node=%s id=%s error=%r", self.node_id, key, e)
        if self.down_since is not None:
            log.info("event=reports_delivered node=%s waited_s=%.1f pending=%d", self.node_id,
                     time.monotonic() - self.down_since, len(self.pending))
            self.down_since = None
        return True
