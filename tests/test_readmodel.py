"""The SQL job history: exactly-once projection, on SQLite and (when GPUORCH_TEST_PG_URL is set) PostgreSQL."""

from __future__ import annotations

import os
from dataclasses import replace
import uuid

import pytest
from sqlalchemy import text

from bench.workload import workload
from shared.eventlog import EventLog
from shared.readmodel import JobHistory, engine_for
from tests.support import eventually


def backends():
    yield pytest.param("sqlite", id="sqlite")
    yield pytest.param("postgresql", id="postgresql", marks=pytest.mark.skipif(
        not os.environ.get("GPUORCH_TEST_PG_URL"), reason="GPUORCH_TEST_PG_URL not set"))


@pytest.fixture(params=list(backends()))
def history(request, tmp_path):
    if request.param == "sqlite":
        yield JobHistory(None, tmp_path)
        return
    url = os.environ["GPUORCH_TEST_PG_URL"]
    schema = f"t_{uuid.uuid4().hex[:10]}"  # an empty schema per test: isolation on a shared server
    admin = engine_for(url, tmp_path)
    with admin.begin() as c:
        c.execute(text(f"CREATE SCHEMA {schema}"))
    h = JobHistory(url + ("&" if "?" in url else "?") + f"options=-csearch_path%3D{schema}", tmp_path)
    try:
        yield h
    finally:
        h.engine.dispose()
        with admin.begin() as c:
            c.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


def test_a_batch_applied_twice_changes_nothing(history: JobHistory):
    envs = [replace(e, seq=i + 1) for i, e in enumerate(workload(200))]
    assert history.apply(envs[:120]) > 0
    assert history.apply(envs[:120]) == 0  # a redelivery: skipped by the cursor, in the same transaction
    history.apply(envs)
    assert history.cursor() == len(envs)
    done = history.get("j00000001")
    assert done.state == "succeeded" and done.nodes == "n0000" and done.ended_at is not None
    assert {r.state for r in history.list(state="running")} == {"running"}
    assert history.get("nope") is None


async def test_the_history_follows_the_log(eventlog: EventLog, tmp_path):
    import asyncio

    history = JobHistory(None, tmp_path)
    await eventlog.append_many(list(workload(300)))
    task = asyncio.create_task(history.follow(eventlog, interval_s=0.1))
    try:
        last = await eventlog.last_seq()
        await eventually(lambda: history.cursor() >= last - 10, what="the read model to catch up")
    finally:
        task.cancel()
    assert history.get("j00000002").state == "succeeded"


def test_rows_folded_over_many_batches_equal_one_batch(history: JobHistory, tmp_path):
    """Each batch inserts the rows it creates and updates the rows earlier batches stored (one statement each):
    folded seven events at a time, every row ends as folded at once."""
    envs = [replace(e, seq=i + 1) for i, e in enumerate(workload(300))]
    for i in range(0, len(envs), 7):
        history.apply(envs[i:i + 7])
    at_once = JobHistory(None, tmp_path / "at-once")
    at_once.apply(envs)
    ids = {e.data.job_id for e in envs if e.data.aggregate == "job"}
    assert len(ids) > 20
    for job_id in ids:
        assert history.get(job_id).model_dump() == at_once.get(job_id).model_dump(), job_id


def test_a_held_job_s_row_says_held_and_why_until_released():
    from shared import events as ev
    from shared.events import Envelope
    from shared.readmodel import fold_row
    from tests.builders import job

    row = fold_row(None, Envelope(ev.JobSubmitted(job_id="j-1", spec=job("a").gpus(1).build())))
    row = fold_row(row, Envelope(ev.JobHeld(job_id="j-1", reason="held by alice")))
    assert (row.state, row.reason) == ("held", "held by alice")
    row = fold_row(row, Envelope(ev.JobReleased(job_id="j-1")))
    assert (row.state, row.reason) == ("queued", "")
