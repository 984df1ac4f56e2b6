"""The JetStream event log against a real nats-server: dedupe, optimistic concurrency, replay."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from nats.js import api

from bench.workload import workload
from shared import events as ev
from shared.eventlog import SNAPSHOT_ENCODING, STREAM, ConcurrencyConflict, EventLog, Undecodable
from shared.events import Envelope
from tests.builders import node


async def test_the_same_event_appended_twice_is_stored_once(eventlog: EventLog):
    env = Envelope(ev.JobQueued(job_id="j-1"))
    first = await eventlog.append(env)
    again = await eventlog.append(env)
    assert first == again == 1
    assert await eventlog.last_seq() == 1
    assert [r.id for r in await eventlog.read()] == [env.id]


async def test_a_batched_append_with_a_repeated_id_stores_it_once(eventlog: EventLog):
    envs = list(workload(50))
    await eventlog.append_many(envs + envs[:10])
    assert await eventlog.last_seq() == len(envs)


async def test_two_writers_with_the_same_expected_sequence_only_one_wins(nats_url: str):
    a, b = await EventLog.connect(nats_url), await EventLog.connect(nats_url)
    try:
        seq = await a.append(Envelope(ev.JobQueued(job_id="j-9")))
        results = await asyncio.gather(
            a.append(Envelope(ev.JobCancelled(job_id="j-9", reason="a")), expected_last_subject_seq=seq),
            b.append(Envelope(ev.JobCancelled(job_id="j-9", reason="b")), expected_last_subject_seq=seq),
            return_exceptions=True,
        )
        assert sum(isinstance(r, int) for r in results) == 1
        assert sum(isinstance(r, ConcurrencyConflict) for r in results) == 1
        assert await a.subject_last_seq("gpuorch.events.job.j-9") == 2
    finally:
        await a.close()
        await b.close()


async def test_replay_reads_until_caught_up_and_filters_by_subject(eventlog: EventLog):
    envs = list(workload(300))
    await eventlog.append_many(envs)
    seqs = [r.seq async for r in eventlog.replay(1)]
    assert seqs == list(range(1, len(envs) + 1))
    tail = [r.seq async for r in eventlog.replay(250)]
    assert tail == list(range(250, len(envs) + 1))
    job = [r async for r in eventlog.replay(1, ["gpuorch.events.job.j00000003"])]
    assert [r.data.TYPE for r in job] == ["job.submitted", "job.queued", "job.placed", "job.task_started", "job.task_exited", "job.succeeded"]
    assert [r async for r in eventlog.replay(len(envs) + 1)] == []


async def test_the_stream_is_append_only(eventlog: EventLog):
    await eventlog.append(Envelope(ev.JobQueued(job_id="j")))
    info = await eventlog.js.stream_info(STREAM)
    assert info.config.deny_delete and info.config.deny_purge
    with pytest.raises(Exception):
        await eventlog.js.purge_stream(STREAM)
    with pytest.raises(Exception):
        await eventlog.js.delete_msg(STREAM, 1)
    assert await eventlog.last_seq() == 1


async def test_undecodable_messages_come_back_as_such_not_as_errors(eventlog: EventLog):
    await eventlog.js.publish("gpuorch.events.job.x", b"{not json")
    recs = [r async for r in eventlog.replay(1)]
    assert isinstance(recs[0], Undecodable) and not recs[0].unknown_type


async def test_snapshots_round_trip_large_states(eventlog: EventLog):
    blob = b"x" * 5_000_000
    await eventlog.save_snapshot("scheduler", 1234, blob)
    assert await eventlog.load_snapshot("scheduler") == (1234, blob)
    assert await eventlog.load_snapshot("nobody") is None


async def test_snapshots_are_stored_deflated_and_older_ones_still_read(eventlog: EventLog):
    """The object store reads back at about 20 MB/s: a snapshot is stored deflated (a restart read 15 MB in 0.8 s);
    one stored before that (no encoding header) reads as it is, and one that does not inflate reads as empty (the
    service replays the log instead)."""
    blob = b'{"jobs": [' + b'{"state": "queued"},' * 100_000 + b'{}]}'
    await eventlog.save_snapshot("scheduler", 7, blob)
    store = await eventlog._snapshots()
    assert (await store.get_info("scheduler")).size < len(blob) // 20
    assert await eventlog.load_snapshot("scheduler") == (7, blob)
    await store.put("old", b"plain", meta=api.ObjectMeta(name="old", headers={"Gpuorch-Seq": "3"}))
    assert await eventlog.load_snapshot("old") == (3, b"plain")
    await store.put("bad", b"not deflated", meta=api.ObjectMeta(name="bad", headers={
        "Gpuorch-Seq": "4", "Gpuorch-Encoding": SNAPSHOT_ENCODING}))
    assert await eventlog.load_snapshot("bad") == (4, b"")


async def test_a_raw_replay_decodes_to_the_same_records(eventlog: EventLog):
    await eventlog.append_many(list(workload(120)))
    decoded = [rec async for rec in eventlog.replay(1)]
    raw = [rec async for rec in eventlog.replay(1, raw=True)]
    assert [r.decoded() for r in raw] == decoded and len(decoded) > 100


async def test_an_append_many_cancelled_at_any_point_leaves_the_connection_working(eventlog: EventLog):
    """nats-py (2.16) sets the result of a PONG's future even when the flush that awaited it was cancelled: the
    InvalidStateError ends the client's read loop, and every later request on the connection times out. A
    scheduler stopping mid-append (its cycle cancelled) wedged the process's connection so (CI: the snapshot store
    'not ready after 60 s'). append_many awaits its acknowledgements, never a flush."""
    for step in range(30):
        envs = [Envelope(ev.NodeRegistered(node_id=f"c{step}-{i}", node=node(f"c{step}-{i}").gpus(1).build()))
                for i in range(20)]
        task = asyncio.create_task(eventlog.append_many(envs))
        for _ in range(step):  # cancelled at a different point each time
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    seq = await asyncio.wait_for(eventlog.append(Envelope(ev.NodeRegistered(node_id="after", node=node("after").gpus(1).build()))), 10)
    assert seq > 0
    assert await asyncio.wait_for(eventlog.last_seq(), 10) >= seq
