"""/v1/usage on the real stack: jobs held for known times, a window that cuts an hour, the exact figure."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime

from shared import events as ev
from shared.eventlog import EventLog
from shared.events import Envelope, GpuShare, TaskPlacement
from tests.builders import gpu_uuid, job, node
from tests.support import eventually, in_process_stack

HOUR = 3600.0


def at(t: float, event: ev.Event) -> Envelope:
    return Envelope(event, time=datetime.fromtimestamp(t, UTC))


def held(job_id: str, gpus: int, first_gpu: int, placed: float, ended: float | None) -> list[Envelope]:
    """A job in queue research placed on n1 at ``placed``, succeeded at ``ended`` (None: still running)."""
    spec = job(job_id).gpus(gpus).queue("research").build()
    shares = tuple(GpuShare(uuid=gpu_uuid("n1", first_gpu + g)) for g in range(gpus))
    out = [at(placed, ev.JobSubmitted(job_id=job_id, spec=spec)), at(placed, ev.JobQueued(job_id=job_id)),
           at(placed, ev.JobPlaced(job_id=job_id, placements=(TaskPlacement(task=0, node_id="n1", gpus=shares),)))]
    if ended is not None:
        out.append(at(ended, ev.JobSucceeded(job_id=job_id)))
    return out


async def test_usage_for_a_window_that_cuts_an_hour_counts_exactly_the_gpu_seconds_held_in_it(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, services):
        assert (await client.put("/v1/queues/research", json={})).status_code == 200
        hour = math.floor(time.time() / HOUR) * HOUR - 3 * HOUR  # three hours ago, on the hour
        # a cordoned node: the scheduler places nothing of its own; the log holds placements at known times
        await eventlog.append_many([Envelope(ev.NodeRegistered(node_id="n1", node=node("n1").gpus(8).build())),
                                    Envelope(ev.NodeCordoned(node_id="n1"))])
        seqs = await eventlog.append_many([
            *held("j-short", 1, 0, hour + 600, hour + 781.8),  # 0.0505 GPU-hours, in the first hour
            *held("j-long", 2, 1, hour + 3000, hour + HOUR + 1200),  # across the first hour boundary
            *held("j-running", 1, 3, hour + 2 * HOUR + 900, None),
        ])
        quota = services["quota"].projection
        await eventually(lambda: quota.seq >= seqs[-1], what="quota to fold the jobs")
        assert quota.jobs["j-running"].state == "placed" and quota.jobs["j-long"].state == "succeeded"

        async def usage(**params) -> dict:
            r = await client.get("/v1/usage", params=params)
            assert r.status_code == 200, r.text
            return r.json()

        # [hour+700, hour+1h10m): 81.8 s of the short job, 2 x 1200 s of the long one
        got = await usage(since=str(hour + 700), until=str(hour + HOUR + 600))
        assert got["queues"]["research"]["gpu_hours"] == round((81.8 + 2 * 1200) / 3600, 4)
        assert got["queues"]["research"]["gpu_seconds"] == 2481.8

        # ISO 8601: [hour+55m, hour+2h30m) cuts the long job's first hour, its end, and the running job's start
        iso = lambda t: datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")  # noqa: E731
        got = await usage(since=iso(hour + 3300), until=iso(hour + 2 * HOUR + 1800))
        assert got["queues"]["research"]["gpu_seconds"] == 2 * 1500 + 900

        # a duration: the last 30 minutes hold the running job alone, up to now
        before = time.time()
        got = await usage(since="30m")
        after = time.time()
        secs = got["queues"]["research"]["gpu_seconds"]
        assert 1800 - 0.2 <= secs <= 1800 + (after - before) + 0.2
        assert got["until"] - got["since"] == 1800

        bad = await client.get("/v1/usage", params={"since": "yesterday"})
        assert bad.status_code == 422 and "ISO 8601" in bad.json()["detail"] and "30m" in bad.json()["detail"]
