"""The latest telemetry sample of every node, read from the telemetry stream (no API serves it: it stays off the log)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.dashboard.views import telemetry_of
from shared.natsauth import node_of_subject

if TYPE_CHECKING:
    from shared.eventlog import EventLog

log = logging.getLogger("gpuorch.dashboard")


class LatestTelemetry:
    """Node id -> mean utilization and hottest GPU of its last sample.

    A page never waits for telemetry: ``latest()`` answers what was read last and, when that is older than
    ``max_age_s``, reads again in the background (the next refresh of the page shows it). One read asks
    JetStream for the last message of each subject (``gpuorch.telemetry.<node>``): one message per node, however
    long the stream."""

    def __init__(self, get_log: Callable[[], "EventLog | None"], max_age_s: float = 3.0, timeout_s: float = 20.0) -> None:
        self.get_log, self.max_age_s, self.timeout_s = get_log, max_age_s, timeout_s
        self._at = -1e9
        self._latest: dict[str, dict[str, Any]] = {}
        self._reading: asyncio.Task | None = None

    def latest(self) -> dict[str, dict[str, Any]]:
        if time.monotonic() - self._at > self.max_age_s and (self._reading is None or self._reading.done()):
            self._reading = asyncio.create_task(self._refresh())
        return self._latest

    async def wait(self) -> dict[str, dict[str, Any]]:
        """The next read's answer (tests, the benchmark)."""
        self.latest()
        if self._reading is not None:
            await self._reading
        return self._latest

    async def _refresh(self) -> None:
        try:
            self._latest = await asyncio.wait_for(self._read(), self.timeout_s)
        except Exception as e:  # noqa: BLE001 - no telemetry is a blank column, never a broken page
            log.info("event=telemetry_unavailable error=%r", e)
        self._at = time.monotonic()

    async def _read(self) -> dict[str, dict[str, Any]]:
        from nats.js import api

        from shared.eventlog import TELEMETRY_STREAM

        evlog = self.get_log()
        if evlog is None:
            return {}
        sub = await evlog.js.subscribe("gpuorch.telemetry.*", stream=TELEMETRY_STREAM, ordered_consumer=True,
                                       config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT))
        out: dict[str, dict[str, Any]] = {}
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=0.2)
                except Exception:  # noqa: BLE001 - a timeout: nothing more pending
                    break
                try:
                    doc = json.loads(msg.data)
                    if node_of_subject(msg.subject, "gpuorch.telemetry") == doc["node_id"]:  # as health believes it
                        out[str(doc["node_id"])] = telemetry_of(doc)
                except (ValueError, KeyError, TypeError):
                    continue
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
        return out
