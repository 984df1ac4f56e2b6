"""A standby leads within seconds of its leader's death (a SIGKILL: no release), on a real nats-server."""

from __future__ import annotations

import asyncio
import time

from shared.eventlog import LEASE_BUCKET, LEASE_TTL_S, EventLog
from shared.leadership import Leadership
from shared.runtime import Projection, Service
from tests.support import eventually

SOURCE = "/gpuorch/scheduler"


def holder(log: EventLog, instance: str) -> tuple[Service, Leadership]:
    svc = Service("scheduler", Projection(), instance=instance)
    svc.log = log  # the lease needs the log and the projection only: no consumer, no replay
    return svc, Leadership("scheduler", source=SOURCE)


async def test_a_standby_leads_within_five_seconds_of_its_leaders_sigkill(nats_url: str):
    a_log, b_log = await EventLog.connect(nats_url), await EventLog.connect(nats_url)
    a_svc, a = holder(a_log, "a")
    b_svc, b = holder(b_log, "b")
    a_task = asyncio.create_task(a.hold(a_svc))
    try:
        await eventually(a.leader.is_set, what="the first holder to lead")
        b_task = asyncio.create_task(b.hold(b_svc))
        await asyncio.sleep(2.5)  # the standby has tried and failed a few times; the leader renewed
        assert a.leader.is_set() and not b.leader.is_set()

        async def no_release() -> None:  # SIGKILL: the process never gets to give the lease back
            pass

        a.lease.release = no_release  # type: ignore[method-assign]
        await a_log.nc.close()  # nor to say anything else
        a_task.cancel()
        died = time.monotonic()
        await eventually(b.leader.is_set, timeout=15, what="the standby to lead")
        took = time.monotonic() - died
        print(f"takeover after SIGKILL: {took:.2f} s (lease TTL {LEASE_TTL_S:g} s, renewed every second)")
        assert took < 5.0, f"the standby took {took:.2f} s"
        assert b.epoch is not None and b.epoch > (a.lease.epoch or 0)
        b_task.cancel()
        await asyncio.gather(b_task, return_exceptions=True)
    finally:
        a_task.cancel()
        await asyncio.gather(a_task, return_exceptions=True)
        await a_log.close()
        await b_log.close()


async def test_a_lease_bucket_made_with_the_old_ttl_gets_the_new_one(nats_url: str):
    import nats

    nc = await nats.connect(nats_url)
    await nc.jetstream().create_key_value(bucket=LEASE_BUCKET, ttl=10, history=1)
    await nc.close()
    log = await EventLog.connect(nats_url)
    try:
        assert (await log.js.stream_info(f"KV_{LEASE_BUCKET}")).config.max_age == LEASE_TTL_S
    finally:
        await log.close()
