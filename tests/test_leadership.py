"""Leader terms come from the log's elections: a forged epoch or election never stops the real leader for good."""

from __future__ import annotations

from pathlib import Path

from services.scheduler.service import Scheduler
from shared import events as ev
from shared.cluster import ClusterProjection
from shared.eventlog import LEASE_BUCKET, EventLog, Lease
from shared.events import Envelope
from shared.leadership import Leadership
from shared.runtime import Service
from shared.settings import Settings
from tests.builders import job, node
from tests.support import eventually, running

SCHEDULER = "/gpuorch/scheduler"


def leader(ttl_s: float = 0.9) -> tuple[Service, Leadership]:
    leadership = Leadership("scheduler", source=SCHEDULER, ttl_s=ttl_s)
    return Service("scheduler", ClusterProjection(), timers=[leadership.hold], instance="a"), leadership


def term(svc: Service) -> int | None:
    t = svc.projection.terms.get(SCHEDULER)
    return None if t is None else t.epoch


async def elections(log: EventLog) -> list[Envelope]:
    return [r async for r in log.replay(1) if isinstance(r, Envelope) and isinstance(r.data, ev.LeaderElected)]


async def test_a_leader_records_its_election_in_the_log_before_it_decides(eventlog: EventLog):
    svc, leadership = leader()
    log_at_acquire: list[int] = []
    leadership.on_acquired = lambda: log_at_acquire.append(leadership.elected_seq)
    async with running(svc, eventlog):
        await eventually(leadership.leader.is_set, what="the lease")
        [e] = await elections(eventlog)
        assert e.id == f"leader-scheduler-{leadership.epoch}" and e.source == SCHEDULER
        assert (e.data.lease, e.data.source, e.data.epoch) == ("scheduler", SCHEDULER, leadership.epoch)
        assert log_at_acquire == [e.seq]  # appended before it called itself leader
        await eventually(lambda: term(svc) == leadership.epoch, what="the projection to fold the election")


async def test_a_leader_that_sees_a_forged_election_records_its_term_again(eventlog: EventLog):
    svc, leadership = leader()
    async with running(svc, eventlog):
        await eventually(lambda: leadership.leader.is_set() and term(svc) == leadership.epoch, what="the first term")
        forged = await eventlog.append(Envelope(ev.LeaderElected(lease="scheduler", source=SCHEDULER, epoch=10**15,
                                                                 holder="mallory"), source=SCHEDULER))
        await eventually(lambda: svc.projection.seq > forged and term(svc) == leadership.epoch, timeout=5,
                         what="the leader to record its term again")
        assert leadership.leader.is_set()
        assert [e.id for e in await elections(eventlog)][-1] == f"leader-scheduler-{leadership.epoch}-{forged}"


async def test_a_leader_whose_lease_was_taken_steps_down_when_it_sees_the_new_election(eventlog: EventLog):
    svc, leadership = leader(ttl_s=3)
    async with running(svc, eventlog):
        await eventually(leadership.leader.is_set, what="the lease")
        kv = await eventlog.kv(LEASE_BUCKET)
        await kv.delete("scheduler")  # the lease lapsed, and another holder took it
        other = Lease(kv, "scheduler", "other")
        assert await other.acquire_or_renew()
        await eventlog.append(Envelope(ev.LeaderElected(lease="scheduler", source=SCHEDULER, epoch=other.epoch,
                                                        holder="other"), source=SCHEDULER))
        await eventually(lambda: not leadership.leader.is_set(), timeout=5, what="the old leader to step down")
        assert term(svc) == other.epoch


async def test_a_forged_decision_with_a_huge_epoch_stops_no_placement_even_after_a_restart(eventlog: EventLog, tmp_path: Path):
    settings = Settings(data_dir=tmp_path, cycle_interval_s=0.2, debounce_s=0.01, instance="s1")
    await eventlog.append(Envelope(ev.NodeRegistered(node_id="n1", node=node("n1").gpus(2).build())))

    async def submit(job_id: str, *forged: Envelope) -> None:  # as the API appends a submission: the scheduler's source, no epoch
        await eventlog.append_many([Envelope(ev.JobSubmitted(job_id=job_id, spec=job(job_id).gpus(1).build()), source=SCHEDULER),
                                    Envelope(ev.JobQueued(job_id=job_id), source=SCHEDULER), *forged])

    def placed(s: Scheduler, job_id: str) -> bool:
        return job_id in s.proj.jobs and s.proj.jobs[job_id].state == "placed"

    first = Scheduler(settings)
    async with running(first.svc, eventlog):
        await eventually(first.leadership.leader.is_set, what="the lease")
        epoch = first.leadership.epoch
        # on the job's own subject: the leader's placement, appended against the job's last sequence, must not conflict
        await submit("a", Envelope(ev.JobUnschedulable(job_id="a", reason="forged"), source=SCHEDULER, epoch=10**15))
        await eventually(lambda: placed(first, "a"), what="the first job's placement")
    second = Scheduler(settings)  # a restart: snapshot, then the tail
    async with running(second.svc, eventlog):
        await submit("b")
        await eventually(lambda: placed(second, "b"), what="a placement after the restart")
    assert [t.split(": ", 1)[1] for t in second.proj.invalid_transitions] == [
        f"epoch {10**15} is not the current term {epoch} of {SCHEDULER}"]
