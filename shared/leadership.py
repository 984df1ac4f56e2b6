"""Leader election for singleton deciders: a lease in KV, renewed by revision, with an epoch.

A lease is no fence: two holders can overlap for a moment. Decisions therefore
carry ``epoch`` (the revision at which the holder acquired), and projections
ignore decisions from an older epoch than one they have seen.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

from shared.eventlog import LEASE_BUCKET, Lease
from shared.runtime import Service

log = logging.getLogger("gpuorch.leadership")
LEASE_TTL_S = 10.0


class Leadership:
    def __init__(self, name: str, on_acquired: Callable[[], None] | None = None, ttl_s: float = LEASE_TTL_S) -> None:
        self.name, self.on_acquired, self.ttl_s = name, on_acquired, ttl_s
        self.lease: Lease | None = None
        self.leader = asyncio.Event()

    @property
    def epoch(self) -> int | None:
        return self.lease.epoch if self.lease and self.leader.is_set() else None

    async def hold(self, svc: Service) -> None:
        """A service timer: acquire the lease when free, renew it every third of its TTL."""
        assert svc.log is not None
        kv = await svc.log.kv(LEASE_BUCKET, ttl=self.ttl_s)
        self.lease = Lease(kv, self.name, f"{socket.gethostname()}:{os.getpid()}:{svc.instance}")
        try:
            while True:
                try:
                    ok = await self.lease.acquire_or_renew()
                except Exception as e:  # noqa: BLE001 - NATS away: not leader until it answers
                    log.warning("lease=%s error=%r", self.name, e)
                    ok = False
                if ok and not self.leader.is_set():
                    log.info("event=leader_acquired lease=%s epoch=%s", self.name, self.lease.epoch)
                    self.leader.set()
                    if self.on_acquired:
                        self.on_acquired()
                elif not ok and self.leader.is_set():
                    log.warning("event=leader_lost lease=%s", self.name)
                    self.leader.clear()
                await asyncio.sleep(self.ttl_s / 3)
        finally:
            if self.leader.is_set():
                self.leader.clear()
                await asyncio.shield(self.lease.release())
