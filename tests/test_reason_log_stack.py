"""On the real stack: a job waiting through 100 cycles whose reason's words change every cycle appends at most
two reason events, and the API shows the latest words."""

from __future__ import annotations

from services.scheduler.core import Plan
from shared.eventlog import EventLog
from tests.builders import job, node
from tests.support import in_process_stack, until
from tests.test_scheduler_stack import job_state, register, submit


async def reasons_logged(log: EventLog, job_id: str) -> list[str]:
    return [r.data.reason async for r in log.replay(1, [f"gpuorch.events.job.{job_id}"])
            if r.data.TYPE == "job.unschedulable"]


async def test_a_job_waiting_through_100_cycles_appends_at_most_two_reasons(eventlog: EventLog):
    async with in_process_stack(eventlog, cycle_interval_s=3600) as (client, services):
        scheduler = services["scheduler"].reaction.__self__
        await register(eventlog, node("n1").gpus(8).build())
        await submit(client, job("blocker").gpus(4).build())
        big = await submit(client, job("big").gpus(8).build())

        async def told():  # the real cycle said why it waits
            j = await job_state(client, big)
            return j if j["reason"] else None
        first = (await until(told, 10, "a reason for the big job"))["reason"]
        assert "needs 8 GPUs" in first

        now = scheduler.clock()
        for i in range(100):  # other jobs come and go: the words change every cycle, the kind does not
            await scheduler.commit(Plan("fgd", unschedulable={big: f"needs 8 GPUs; largest free block is {i % 7} on "
                                                                  f"n{i % 3}"}), now + i)
        logged = await reasons_logged(eventlog, big)
        assert len(logged) <= 2 and logged[0] == first, logged
        assert (await job_state(client, big))["reason"] == "needs 8 GPUs; largest free block is 1 on n0"

        await scheduler.commit(Plan("fgd", unschedulable={big: "needs 8 GPUs; default at its limit of 4 GPUs"}), now + 101)
        assert (await reasons_logged(eventlog, big))[-1] == "needs 8 GPUs; default at its limit of 4 GPUs"
        # the same kind again, its words changed, once the refresh interval has passed: logged once more
        later = now + 101 + scheduler.settings.reason_refresh_s
        await scheduler.commit(Plan("fgd", unschedulable={big: "needs 8 GPUs; default at its limit of 6 GPUs"}), later)
        await scheduler.commit(Plan("fgd", unschedulable={big: "needs 8 GPUs; default at its limit of 7 GPUs"}), later + 1)
        assert (await reasons_logged(eventlog, big))[-1] == "needs 8 GPUs; default at its limit of 6 GPUs"
