"""Each node's work (services.inventory.work): inventory writes a node's share of the log for its agent, which
reads that and nothing else (bus traffic per agent grows with its own jobs, not with the cluster's)."""

from __future__ import annotations

import asyncio

import nats
import pytest

from services.inventory.agent import Agent
from services.inventory.work import (ENDED_TTL_S, NodeNotice, WorkOrder, WorkWriter, node_work, orders, work_reaction,
                                     work_subject)
from shared import events as ev
from shared.cluster import ClusterProjection
from shared.eventlog import WORK_STREAM, EventLog
from shared.events import Envelope
from shared.natsauth import agent_inbox
from shared.profiles import build as build_profile
from tests.builders import job
from tests.support import in_process_stack, nodes_up, running, until

SCHEDULER = "/gpuorch/scheduler"


def folded(*events: ev.Event) -> tuple[ClusterProjection, list[Envelope]]:
    proj, envs = ClusterProjection(), []
    for seq, e in enumerate(events, 1):
        env = Envelope(e, source=SCHEDULER, seq=seq)
        proj.apply(env)
        envs.append(env)
    return proj, envs


def gang_on(*nodes: str) -> ev.JobPlaced:
    return ev.JobPlaced(job_id="j-1", placements=tuple(ev.TaskPlacement(task=i, node_id=n) for i, n in enumerate(nodes)))


def registered(node: str) -> ev.NodeRegistered:
    info = build_profile("t4-4x", node)
    return ev.NodeRegistered(node_id=node, node=info.model_copy(update={"address": f"10.0.0.{node[-1]}"}))


def test_a_placement_is_one_order_per_node_with_what_its_agent_needs_and_nothing_for_other_nodes():
    spec = job("train").tasks(2).gpus(1).build()
    proj, envs = folded(registered("n1"), registered("n2"), registered("n3"),
                        ev.JobSubmitted(job_id="j-1", spec=spec, owner="alice"), ev.JobQueued(job_id="j-1"),
                        gang_on("n1", "n2"))
    words = orders(envs[-1], proj)
    assert [s for s, _, _ in words] == [work_subject("n1", "j-1"), work_subject("n2", "j-1")]
    order = words[0][1]
    assert isinstance(order, WorkOrder)
    assert (order.seq, order.attempt, order.owner, order.spec) == (6, 6, "alice", spec)
    assert order.addresses == {"n1": "10.0.0.1", "n2": "10.0.0.2"}, "the gang's addresses, for MASTER_ADDR"
    assert order.tasks_on("n2") == [1] and not order.ended and order.stop_grace_s is None
    assert all(ttl is None for _, _, ttl in words), "a running job's work never lapses"


def test_a_stop_carries_its_grace_and_an_end_lapses():
    proj, envs = folded(registered("n1"), ev.JobSubmitted(job_id="j-1", spec=job("x").build()),
                        ev.JobQueued(job_id="j-1"), gang_on("n1"), ev.JobPreempting(job_id="j-1", grace_s=30, reason="priority"),
                        ev.JobPreempted(job_id="j-1"))
    [(subject, stop, ttl)] = orders(envs[4], proj)
    assert subject == work_subject("n1", "j-1") and (stop.seq, stop.stop_grace_s, stop.ended, ttl) == (5, 30, False, None)
    [(_, end, ttl)] = orders(envs[5], proj)
    assert (end.seq, end.ended, ttl) == (6, True, ENDED_TTL_S)


def test_a_lost_node_gets_a_notice_and_events_about_no_node_make_no_work():
    proj, envs = folded(registered("n1"), ev.NodeLost(node_id="n1", reason="silent 60 s"),
                        ev.JobSubmitted(job_id="j-2", spec=job("x").build()), ev.JobQueued(job_id="j-2"))
    [(subject, notice, _)] = orders(envs[1], proj)
    assert subject == work_subject("n1") and isinstance(notice, NodeNotice) and notice.lost == "silent 60 s"
    assert orders(envs[2], proj) == [] and orders(envs[3], proj) == []


async def test_a_lagging_writer_never_replaces_a_later_word(eventlog: EventLog):
    writer, subject = WorkWriter(eventlog), work_subject("n1", "j-1")

    async def last() -> WorkOrder:
        return WorkOrder.model_validate_json((await eventlog.js.get_last_msg(WORK_STREAM, subject)).data)

    await writer.put(subject, WorkOrder(seq=10, job_id="j-1", attempt=10))
    await writer.put(subject, WorkOrder(seq=20, job_id="j-1", ended=True), ENDED_TTL_S)
    await writer.put(subject, WorkOrder(seq=10, job_id="j-1", attempt=10))  # an inventory replica behind, or a redelivery
    assert (await last()).seq == 20
    raw = await eventlog.js.get_last_msg(WORK_STREAM, subject)
    assert raw.headers and raw.headers.get("Nats-TTL") == f"{ENDED_TTL_S}s", "an ended job's word lapses"
    await writer.put(subject, WorkOrder(seq=30, job_id="j-1", attempt=30))  # placed again
    assert (await last()).attempt == 30
    other = WorkWriter(eventlog)  # a second inventory replica, ahead of this one
    await other.put(subject, WorkOrder(seq=50, job_id="j-1", ended=True))
    await writer.put(subject, WorkOrder(seq=40, job_id="j-1", stop_grace_s=5))  # its guess of the last word is stale
    assert (await last()).seq == 50
    info = await eventlog.js.stream_info(WORK_STREAM, subjects_filter=node_work("n1"))
    assert info.state.subjects == {subject: 1}, "one message per (node, job)"


async def test_each_agent_reads_the_work_of_its_own_node_only(eventlog: EventLog, tmp_path):
    a, b = (Agent(build_profile("t4-4x", n), tmp_path / n, heartbeat_s=0.3, telemetry_s=60) for n in ("n1", "n2"))
    async with in_process_stack(eventlog) as (client, _), running(a.svc, eventlog), running(b.svc, eventlog):
        await nodes_up(client, 2)
        ids = []
        for i in range(6):  # 4 GPUs a node, each held 3 s: some land on each (jobs of `true` may all end on one)
            r = await client.post("/v1/jobs", json={"name": f"w{i}", "command": ["sleep", "3"], "resources": {"gpus": 1}})
            ids.append(r.json()["id"])

        async def all_done():
            jobs = [(await client.get(f"/v1/jobs/{i}")).json() for i in ids]
            return jobs if all(j["state"] == "succeeded" for j in jobs) else None
        await until(all_done, 30, "every job to succeed")
        on = {n: {d.name for d in (agent.work_dir / "jobs").iterdir()} for n, agent in (("n1", a), ("n2", b))}
        assert on["n1"] and on["n2"] and not on["n1"] & on["n2"] and on["n1"] | on["n2"] == set(ids), on
        # a job's end reaches the API first: its word's end is written after, and read by its agent after that
        await until(lambda: _true(set(a.orders) == on["n1"] and set(b.orders) == on["n2"] and
                                  all(w.ended for w in [*a.orders.values(), *b.orders.values()])), 10,
                    "each agent to read its node's ended words")


async def _true(value: bool) -> bool:
    return value


async def test_an_agent_may_follow_its_own_nodes_work_and_neither_another_nodes_nor_the_log(secured):
    server, creds = secured
    control = creds.control()
    log = await EventLog.connect(server.url, user=control.name, password=control.password)
    await WorkWriter(log).put(work_subject("n1", "j-1"), WorkOrder(seq=1, job_id="j-1", attempt=1))
    errors: list[str] = []

    async def record(e: Exception) -> None:
        errors.append(str(e))
    user = creds.agent("n1")
    nc = await nats.connect(server.url, user=user.name, password=user.password, inbox_prefix=agent_inbox("n1"),
                            error_cb=record, allow_reconnect=False)
    js = nc.jetstream(timeout=1)
    try:
        mine = await js.add_consumer(WORK_STREAM, name="mine", filter_subject=node_work("n1"))
        assert mine.num_pending == 1
        for stream, filter_subject in ((WORK_STREAM, node_work("n2")), (WORK_STREAM, "gpuorch.work.>"),
                                       ("GPUORCH", "gpuorch.events.>")):
            with pytest.raises((nats.errors.Error, asyncio.TimeoutError)):
                await js.add_consumer(stream, name="theirs", filter_subject=filter_subject)
        with pytest.raises((nats.errors.Error, asyncio.TimeoutError)):
            await js.publish(work_subject("n1", "j-2"), WorkOrder(seq=9, job_id="j-2", attempt=9).model_dump_json().encode(),
                             timeout=1)
        info = await log.js.stream_info(WORK_STREAM, subjects_filter="gpuorch.work.>")
        assert info.state.subjects == {work_subject("n1", "j-1"): 1}, "its agent wrote itself no work"
    finally:
        await nc.close()
        await log.close()


async def test_an_end_reaches_every_node_holding_the_job_though_the_fold_shows_it_elsewhere_now(eventlog: EventLog):
    """In one process the shared projection may be past the event a reaction handles: the job was requeued and
    placed on another node since. The node of the first placement must still hear that it ended."""
    import types

    proj, envs = folded(registered("n1"), registered("n2"), ev.JobSubmitted(job_id="j-1", spec=job("x").build()),
                        ev.JobQueued(job_id="j-1"), gang_on("n1"), ev.JobRequeued(job_id="j-1", reason="node lost"),
                        gang_on("n2"))
    first, requeued = envs[4], envs[5]
    react = work_reaction(types.SimpleNamespace(projection=proj, log=eventlog))
    await react(first)
    await react(requeued)  # the fold is at the second placement already
    last = WorkOrder.model_validate_json((await eventlog.js.get_last_msg(WORK_STREAM, work_subject("n1", "j-1"))).data)
    assert (last.seq, last.ended) == (requeued.seq, True), "n1 heard of the end"
    await react(envs[6])
    last = WorkOrder.model_validate_json((await eventlog.js.get_last_msg(WORK_STREAM, work_subject("n2", "j-1"))).data)
    assert (last.attempt, last.ended) == (envs[6].seq, False), "the second placement stands on n2"
