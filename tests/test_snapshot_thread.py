"""A snapshot is encoded in a thread (issue 15: on the event loop, one of 20,000 jobs held every request 0.5 to 1.8 s),
while every fold of the process waits: the thread reads the projection itself, so a fold during it would make a
snapshot whose state is not the state at its sequence. These tests park the thread and keep appending."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import threading
import time

import pytest
from pydantic_core import to_json

from bench.workload import workload
from services.autoscaler.projection import AutoscalerProjection
from services.health.projection import HealthProjection
from services.inventory.projection import InventoryProjection
from services.quota.projection import QuotaProjection
from services.scheduler.projection import SchedulerProjection
from shared import events as ev
from shared.eventlog import EventLog, Undecodable
from shared.events import Envelope
from shared.model import GpuAmount, QueueSpec
from shared.projection import CHUNK, encode_json
from shared.projection import Projection
from shared import runtime
from shared.runtime import Service, fold_once
from tests.support import eventually, running


class Recorded:
    """A snapshot store that keeps every snapshot saved, and has none to restore."""

    def __init__(self) -> None:
        self.saved: list[tuple[int, bytes]] = []

    async def load_snapshot(self, name: str) -> None:
        return None

    async def save_snapshot(self, name: str, seq: int, state: bytes) -> None:
        self.saved.append((seq, state))


def park_the_first_snapshot(monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Event, threading.Event, list[int]]:
    """The first ``state()`` read outside the event loop's thread (a snapshot's) waits for the test's word: (set
    once it waits, the word, the sequence the projection was at when it began)."""
    loop, parked, release, at = asyncio.get_running_loop(), asyncio.Event(), threading.Event(), []
    real = SchedulerProjection.state

    def state(self: SchedulerProjection) -> dict:
        if threading.current_thread() is not threading.main_thread() and not at:
            at.append(self.seq)
            loop.call_soon_threadsafe(parked.set)
            release.wait(30)
        return real(self)

    monkeypatch.setattr(SchedulerProjection, "state", state)
    return parked, release, at


async def replayed_to(log: EventLog, seq: int, kind: type[Projection] = SchedulerProjection) -> Projection:
    proj = kind()
    async for rec in log.replay(1):
        if rec.seq > seq:
            break
        proj.skip(rec.seq) if isinstance(rec, Undecodable) else proj.apply(rec)
    return proj


async def test_a_snapshot_taken_while_events_keep_arriving_restores_to_the_state_at_its_sequence(
        eventlog: EventLog, monkeypatch: pytest.MonkeyPatch):
    """Two services of one process share the projection (fold_once): while the one that took the snapshot waits
    for it, the other's consumer is handed the next events, and must not fold them."""
    envs = list(workload(600))
    parked, release, at = park_the_first_snapshot(monkeypatch)
    store = Recorded()
    svc, other = (Service(name, kind(), snapshot_every=100, snapshots=store)
                  for name, kind in (("scheduler", SchedulerProjection), ("quota", QuotaProjection)))
    fold_once([svc, other])
    kind = type(svc.projection)
    try:
        async with running(svc, eventlog), running(other, eventlog):
            await eventlog.append_many(envs[:150])
            await asyncio.wait_for(parked.wait(), 15)  # the thread reads the projection, and waits
            await eventlog.append_many(envs[150:])  # meanwhile the log moves on: the consumer is handed these
            # a fold now would change what the thread reads: give one the time to happen, then look
            with contextlib.suppress(AssertionError):
                await eventually(lambda: svc.projection.seq > at[0], timeout=1, what="a fold during the snapshot")
            assert svc.projection.seq == at[0], "no event folded while the snapshot's thread read the projection"
            assert not svc.fold.open.is_set()
            release.set()
            await eventually(lambda: svc.projection.seq == len(envs), what="the folds to resume")
            await eventually(lambda: len(store.saved) >= 1, what="the snapshot to be saved")
    finally:
        release.set()

    seq, blob = store.saved[0]
    assert seq == at[0] and 100 <= seq < len(envs)
    restored = kind()
    restored.restore(blob)
    expected = await replayed_to(eventlog, seq, kind)
    assert (restored.seq, restored.applied) == (seq, expected.applied)
    assert restored.digest() == expected.digest(), "the snapshot is the state at its sequence"
    last_seq, last = store.saved[-1]  # the one taken on the way out
    assert last_seq == len(envs)
    final = kind()
    final.restore(last)
    assert final.digest() == (await replayed_to(eventlog, last_seq, kind)).digest()


async def test_the_folds_wait_for_the_snapshots_thread_even_when_the_snapshot_is_cancelled(
        monkeypatch: pytest.MonkeyPatch):
    """A stop that cancels a service waiting for its snapshot does not let a fold run under the thread."""
    parked, release, _ = park_the_first_snapshot(monkeypatch)
    svc = Service("scheduler", SchedulerProjection())
    for env in workload(50):
        svc.projection.apply(env)
    task = asyncio.create_task(svc._snapshot_in_thread())
    try:
        await asyncio.wait_for(parked.wait(), 15)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert not svc.fold.open.is_set(), "the thread still reads the projection: the folds still wait"
        release.set()
        await asyncio.wait_for(svc.fold.open.wait(), 15)
    finally:
        release.set()


def test_the_snapshot_is_written_in_pieces_byte_for_byte_as_one_call_would():
    proj = SchedulerProjection()
    for env in workload(3000):
        proj.apply(env)
    assert len(proj.jobs) > CHUNK
    doc = {"seq": proj.seq, "state": proj.state()}
    assert encode_json(doc) == to_json(doc)
    for value in ({}, [], {"a": {}}, list(range(CHUNK * 2 + 1)), {str(i): [i] for i in range(CHUNK + 1)},
                  {1: "int keys", 2: {"x": 1}}, {"é\"\n": ["ü", None, 1.5, True]}, (1, 2), "s", 3):
        assert encode_json(value) == to_json(value), value


@pytest.mark.parametrize("kind", [SchedulerProjection, QuotaProjection, HealthProjection, AutoscalerProjection,
                                  InventoryProjection])
async def test_a_snapshot_document_shares_nothing_that_later_folds_change(eventlog: EventLog,
                                                                         kind: type[Projection]):
    """The folds resume once the document is copied out, before it is encoded: encoded after more folds (jobs
    moving, a node cordoned and drained, another decider's term, an invalid event), it is still the snapshot of its
    sequence."""
    envs = list(workload(400))
    node_id = next(e.data.node_id for e in envs if isinstance(e.data, ev.NodeRegistered))
    more = [Envelope(ev.QueueDefined(path="research", spec=QueueSpec(guaranteed=GpuAmount(gpus=2)))),
            Envelope(ev.PoolDefined(pool="spare", profile="t4-4x", max_nodes=2)),
            Envelope(ev.LeaderElected(lease="scheduler", source="/gpuorch/scheduler", epoch=3, holder="s"),
                     source="/gpuorch/scheduler", epoch=3),
            Envelope(ev.NodeCordoned(node_id=node_id)), Envelope(ev.NodeDrainRequested(node_id=node_id)),
            Envelope(ev.LeaderElected(lease="health", source="/gpuorch/health", epoch=4, holder="h"),
                     source="/gpuorch/health", epoch=4),
            Envelope(ev.JobSucceeded(job_id="j-never-submitted"))]  # invalid: counted
    await eventlog.append_many(envs[:200] + more[:3])
    proj = kind()
    async for rec in eventlog.replay(1):
        proj.skip(rec.seq) if isinstance(rec, Undecodable) else proj.apply(rec)
    then = proj.snapshot()
    doc = proj.snapshot_document()
    last = await eventlog.append_many(envs[200:] + more[3:])
    async for rec in eventlog.replay(proj.seq + 1):
        proj.skip(rec.seq) if isinstance(rec, Undecodable) else proj.apply(rec)
    assert proj.seq == last[-1] and proj.snapshot() != then  # the folds changed the projection
    assert encode_json(doc) == then


async def test_reads_that_keep_overlapping_do_not_hold_the_folds(eventlog: EventLog):
    """Readers that keep coming (clients polling GET /v1/queues, each read in a thread while the folds wait) never
    leave the projection unread for a moment; a fold that arrives among them gets its turn before any new reader,
    rather than when the reads stop (seen: 32 clients polling /v1/queues held every POST 0.1-0.7 s, /v1/services
    1.8-2 s). Eight readers on the executor's six threads: some is always queued, so the readers never drop to
    none by themselves."""
    svc = Service("scheduler", SchedulerProjection())
    envs = list(workload(40))
    storm, reads = True, [0]

    async def reader() -> None:
        while storm:
            await svc.read_in_thread(lambda: time.sleep(0.02))
            reads[0] += 1
    async with running(svc, eventlog):
        await eventlog.append_many(envs[:20])
        await eventually(lambda: svc.projection.seq == 20, what="the first events folded")
        readers = [asyncio.create_task(reader()) for _ in range(8)]
        try:
            await eventually(lambda: reads[0] >= 16, what="the reads to overlap")
            assert svc.fold.readers > 0 and not svc.fold.open.is_set()
            await eventlog.append_many(envs[20:])
            await eventually(lambda: svc.projection.seq == len(envs), timeout=5,
                             what="the folds, while the reads keep overlapping")
            assert not any(r.done() for r in readers), "the reads went on all along"
            seen = reads[0]
            await eventually(lambda: reads[0] >= seen + 16, what="the reads to go on after the folds")
        finally:
            storm = False
            await asyncio.gather(*readers)


KINDS = (("scheduler", SchedulerProjection), ("quota", QuotaProjection), ("inventory", InventoryProjection),
         ("autoscaler", AutoscalerProjection), ("health", HealthProjection))


def oracle_digest(proj: Projection, keys: frozenset[str] | None) -> str:
    """The digest as one canonical JSON of the whole body (how it was made before it came in parts)."""
    state = proj.state()
    body = {"applied": proj.applied, "invalid": proj.invalid_count,
            "state": state if keys is None else {k: v for k, v in state.items() if k in keys}}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def test_a_digest_made_of_parts_is_the_digest_of_the_whole():
    services = [Service(name, kind()) for name, kind in KINDS]
    fold_once(services)
    proj = services[0].projection
    for i, env in enumerate(workload(3000), 1):
        proj.apply(env)
        if i % 700 == 0:
            for s in services:
                assert proj.digest(s.state_keys) == oracle_digest(proj, s.state_keys), (s.name, i)
    assert len({proj.digest(s.state_keys) for s in services}) == 3, "the services' views differ"
    assert proj.digest() == oracle_digest(proj, None)
    assert SchedulerProjection().digest() == oracle_digest(SchedulerProjection(), None)


async def test_the_services_digests_are_encoded_while_the_folds_go_on_and_are_of_the_position_they_name(
        eventlog: EventLog, monkeypatch: pytest.MonkeyPatch):
    """GET /v1/services (``statuses``): the folds wait only while the state is copied out; its encoding, once for
    every service of the projection, waits here for the test while events are folded; each digest is then the
    state's at the sequence its status names, not at the one the projection has moved to."""
    envs = list(workload(400))
    loop, parked, release = asyncio.get_running_loop(), asyncio.Event(), threading.Event()
    encoded = []

    def parts(doc: dict) -> dict:
        encoded.append(True)
        loop.call_soon_threadsafe(parked.set)
        release.wait(30)
        return real(doc)
    real = runtime.digest_parts
    monkeypatch.setattr(runtime, "digest_parts", parts)
    hashes = []
    real_hash = runtime.state_digest
    monkeypatch.setattr(runtime, "state_digest", lambda *a: hashes.append(True) or real_hash(*a))
    services = [Service(name, kind()) for name, kind in KINDS]
    fold_once(services)
    try:
        async with contextlib.AsyncExitStack() as stack:
            for s in services:
                await stack.enter_async_context(running(s, eventlog))
            await eventlog.append_many(envs[:200])
            await eventually(lambda: services[0].projection.seq == 200, what="the first events folded")
            answer = asyncio.create_task(runtime.statuses(services))
            await asyncio.wait_for(parked.wait(), 15)
            await eventlog.append_many(envs[200:])
            await eventually(lambda: services[0].projection.seq == len(envs), what="folds while the digests encode")
            release.set()
            got = await asyncio.wait_for(answer, 15)
            now = await runtime.statuses(services)  # the projection moved: encoded again, then kept
            assert len(hashes) == 10
            assert await runtime.statuses(services) == now and len(hashes) == 10, "kept while nothing moved"
            assert len(encoded) == 2 and {s["seq"] for s in now} == {len(envs)}
    finally:
        release.set()
    at = await replayed_to(eventlog, 200, type(services[0].projection))
    assert len(got) == 5 and [g["seq"] for g in got] == [200] * 5
    assert [g["digest"] for g in got] == [oracle_digest(at, s.state_keys) for s in services]
