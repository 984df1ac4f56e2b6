"""Leader election for singleton deciders: a lease in KV, renewed by revision, with an epoch.

A lease is no fence: two holders can overlap for a moment. Decisions therefore
carry ``epoch`` (the revision at which the holder acquired), and the holder
records its term in the log (``leader.elected``) before it decides: projections
count a decision only if its epoch is the term last elected for its source.
A holder that sees a later election for its source (another holder's, or a
forged one) renews its lease: if the lease is still its own it records its term
again, else it steps down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

from shared import events as ev
from shared.eventlog import LEASE_BUCKET, LEASE_TTL_S, Lease
from shared.events import Envelope
from shared.runtime import Projection, Service

log = logging.getLogger("gpuorch.leadership")
RENEW_S = 1.0  # renewing a KV key is cheap: a leader may miss two renewals before its lease lapses


class Leadership:
    def __init__(self, name: str, *, source: str, on_acquired: Callable[[], None] | None = None,
                 ttl_s: float = LEASE_TTL_S) -> None:
        """``source``: the decision source the lease vouches for (``/gpuorch/<service>``)."""
        self.name, self.source, self.on_acquired, self.ttl_s = name, source, on_acquired, ttl_s
        self.lease: Lease | None = None
        self.leader = asyncio.Event()
        self.elected_seq = 0  # where this holder's latest election is in the log

    @property
    def epoch(self) -> int | None:
        return self.lease.epoch if self.lease and self.leader.is_set() else None

    def foreign_election(self, proj: Projection) -> int | None:
        """The sequence of an election for our source that the projection folded after ours, with another epoch."""
        term = proj.terms.get(self.source)
        if self.leader.is_set() and term is not None and term.seq > self.elected_seq and term.epoch != self.epoch:
            return term.seq
        return None

    async def hold(self, svc: Service) -> None:
        """A service timer: acquire the lease when free (a standby tries every second, so it leads within about
        the TTL of its leader's death), renew it every second, keep its term in the log."""
        assert svc.log is not None
        kv = await svc.log.kv(LEASE_BUCKET, ttl=self.ttl_s)
        self.lease = Lease(kv, self.name, f"{socket.gethostname()}:{os.getpid()}:{svc.instance}")
        try:
            while True:
                foreign = self.foreign_election(svc.projection)
                try:
                    ok = await self.lease.acquire_or_renew()
                    # 1. a leader whose election is not in the log must not decide: it records its term first
                    # 2. renewed after a foreign election: still the holder, so it records its term again
                    if ok and (foreign is not None or not self.leader.is_set()):
                        await self.elect(svc, foreign)
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
                await asyncio.sleep(min(RENEW_S, self.ttl_s / 3))
        finally:
            self.leader.clear()
            await asyncio.shield(self.lease.release())  # held even while not leading if its election failed

    async def elect(self, svc: Service, foreign: int | None) -> None:
        """Append ``leader.elected`` for this holder's epoch (``foreign``: the sequence of the election it answers)."""
        assert svc.log is not None and self.lease is not None and self.lease.epoch is not None
        epoch = self.lease.epoch
        event = ev.LeaderElected(lease=self.name, source=self.source, epoch=epoch, holder=self.lease.holder)
        event_id = f"leader-{self.name}-{epoch}" if foreign is None else f"leader-{self.name}-{epoch}-{foreign}"
        self.elected_seq = await svc.log.append(Envelope(event, id=event_id, source=self.source))
        log.info("event=leader_elected lease=%s epoch=%d seq=%d answers=%s", self.name, epoch, self.elected_seq, foreign)
