"""Snapshots are a shortcut the log can always replace: one written by another version of the code, or one that
cannot be read, is ignored at start (a log line, a full replay), never misread and never fatal."""

from __future__ import annotations

import logging

import pytest
from pydantic_core import from_json, to_json

from bench.workload import workload
from services.scheduler.projection import SchedulerProjection
from shared.cluster import ClusterProjection
from shared.eventlog import EventLog, Undecodable
from shared.events import Envelope
from shared.projection import Projection, SnapshotUnusable
from shared.runtime import Service
from tests.support import eventually, running


def scheduler() -> Service:
    return Service("scheduler", SchedulerProjection())


async def replayed_from_scratch(log: EventLog) -> SchedulerProjection:
    proj = SchedulerProjection()
    async for rec in log.replay(1):
        proj.skip(rec.seq) if isinstance(rec, Undecodable) else proj.apply(rec)
    return proj


async def with_a_snapshot(log: EventLog, events: int = 300) -> int:
    """The workload's first ``events`` folded by a scheduler that snapshots on stop; the sequence it covers."""
    envs = list(workload(events + 100))
    first = scheduler()
    async with running(first, log):
        await log.append_many(envs[:events])
        await eventually(lambda: first.projection.seq >= events, what="the fold")
    snap = await log.load_snapshot("scheduler")
    assert snap is not None and snap[0] == events
    await log.append_many(envs[events:])  # a tail after the snapshot
    return len(envs)


def next_release(monkeypatch: pytest.MonkeyPatch, bump: bool = True) -> None:
    """SchedulerProjection as a later release writes it: it also counts the events it folded by type, a field an
    older snapshot lacks and ``load`` would take as empty; ``bump``: the release says so with its version."""
    def __init__(self) -> None:
        ClusterProjection.__init__(self)
        self.by_type: dict[str, int] = {}

    def apply(self, env: Envelope) -> bool:
        if not env.seq or env.seq > self.seq:
            self.by_type[env.type] = self.by_type.get(env.type, 0) + 1
        return ClusterProjection.apply(self, env)

    def state(self) -> dict:
        return {**ClusterProjection.state(self), "by_type": self.by_type}

    def load(self, state: dict) -> None:
        ClusterProjection.load(self, state)
        self.by_type = dict(state.get("by_type", {}))

    for name, fn in (("__init__", __init__), ("apply", apply), ("state", state), ("load", load)):
        monkeypatch.setattr(SchedulerProjection, name, fn)
    if bump:
        monkeypatch.setattr(SchedulerProjection, "SNAPSHOT_VERSION", 2, raising=False)


async def test_a_snapshot_of_another_version_is_ignored_and_the_log_replayed_to_the_same_digest(
        eventlog: EventLog, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    last = await with_a_snapshot(eventlog)
    next_release(monkeypatch)

    caplog.set_level(logging.WARNING, "gpuorch.runtime")
    upgraded = scheduler()
    async with running(upgraded, eventlog):
        assert upgraded.projection.seq == last
        scratch = await replayed_from_scratch(eventlog)
        assert upgraded.projection.digest() == scratch.digest()
        assert sum(upgraded.projection.by_type.values()) == last, "every event counted: none skipped by a snapshot"
    [line] = [r.getMessage() for r in caplog.records if "snapshot ignored" in r.getMessage()]
    assert "service=scheduler" in line and "action=full_replay" in line and "SchedulerProjection" in line


async def test_a_snapshot_of_this_version_is_restored_and_only_the_tail_replayed(eventlog: EventLog,
                                                                              caplog: pytest.LogCaptureFixture):
    last = await with_a_snapshot(eventlog)
    caplog.set_level(logging.INFO, "gpuorch.runtime")
    again = scheduler()
    async with running(again, eventlog):
        assert again.projection.seq == last
        assert again.projection.digest() == (await replayed_from_scratch(eventlog)).digest()
    assert any("restored=True" in r.getMessage() for r in caplog.records)
    assert not any("snapshot ignored" in r.getMessage() for r in caplog.records)


def current(**changes) -> bytes:
    """A snapshot document of this code's version with ``changes``."""
    doc = from_json(SchedulerProjection().snapshot())
    return to_json({**doc, **changes})


@pytest.mark.parametrize("blob", [
    pytest.param(b"{not json", id="not JSON"),
    pytest.param(b"[1, 2, 3]", id="JSON but no document"),
    pytest.param(b"", id="empty"),
    pytest.param(to_json({"seq": 5, "state": {}}), id="no version: older than versions"),
    pytest.param(current(state={"jobs": "x"}), id="this version, state of the wrong shape"),
    pytest.param(current(seq="five"), id="this version, a field of the wrong type"),
])
async def test_an_unreadable_snapshot_is_ignored_with_a_log_line_and_the_log_replayed(
        eventlog: EventLog, caplog: pytest.LogCaptureFixture, blob: bytes):
    envs = list(workload(50))
    await eventlog.append_many(envs)
    await eventlog.save_snapshot("scheduler", 40, blob)

    caplog.set_level(logging.WARNING, "gpuorch.runtime")
    svc = scheduler()
    async with running(svc, eventlog):
        assert svc.projection.seq == len(envs)
        assert svc.projection.digest() == (await replayed_from_scratch(eventlog)).digest()
    assert any("snapshot ignored" in r.getMessage() for r in caplog.records)


def test_a_refused_snapshot_leaves_the_projection_as_it_was():
    proj = SchedulerProjection()
    proj.apply(next(iter(workload(1))))
    before = proj.digest()

    for blob in (b"{", current(state={"jobs": "x"}), to_json({**from_json(current()), "version": {"Projection": 0}})):
        with pytest.raises(SnapshotUnusable):
            proj.restore(blob)
        assert proj.digest() == before and proj.seq == 0 and proj.applied == 1


def test_the_version_names_each_class_that_declares_one_and_the_events_the_code_reads():
    version = SchedulerProjection.snapshot_version()
    assert {k: v for k, v in version.items() if k != "events"} == {"Projection": 1, "ClusterProjection": 3}
    assert version["events"] == Projection.snapshot_version()["events"]
    assert from_json(SchedulerProjection().snapshot())["version"] == version
