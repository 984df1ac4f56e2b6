"""Health in process on a real nats-server, nodes and telemetry written as agents would: lost nodes, drains, faults."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from services import cli
from services.health.rules import HealthPolicy
from services.health.service import Health
from shared import events as ev
from shared.eventlog import EventLog
from shared.events import Envelope
from shared.settings import Settings
from tests.builders import job, node, reported
from tests.jobfiles.test_cli import gpuorch, through_response
from tests.health.test_health_stack import history, job_when, kind, nodes_up, submit, until
from shared.runtime import Service
from tests.support import Clock, eventually, in_process_stack, running


async def register(log: EventLog, *nodes) -> None:
    await log.append_many([Envelope(ev.NodeRegistered(node_id=n.node_id, node=n)) for n in nodes])


def with_agent(n):
    """A node whose agent is expected to heartbeat (agents always report their URL)."""
    return n.model_copy(update={"agent_url": f"http://127.0.0.1:1/{n.node_id}"})


async def _true(value: bool) -> bool:
    return value


async def node_state(client: httpx.AsyncClient, node_id: str) -> str:
    return (await client.get(f"/v1/nodes/{node_id}")).json()["state"]


async def publish_until(log: EventLog, subject: str, body: dict, check, what: str, timeout: float = 10.0) -> None:
    """Telemetry is read from "now" on: publish (a fresh sample each time) until the effect shows."""
    async def attempt():
        await log.nc.publish(subject, json.dumps({**body, "t": time.time()}).encode())
        return await check()
    await until(attempt, timeout, what)


def sample(node_id: str, **by_index: dict) -> dict:
    gpus = [{"uuid": f"GPU-{node_id}-{i}", "index": i, "temperature_c": 40, "ecc_uncorrected": 0, **v} for i, v in by_index.items()]
    return {"node_id": node_id, "gpus": gpus}


async def test_a_silent_node_is_lost_when_its_timeout_has_passed_on_the_heartbeat_clock_and_not_before(
        eventlog: EventLog):
    beats = Clock()
    health = Health(Settings(heartbeat_timeout_s=30), monotonic=beats)
    async with running(health.svc, eventlog):
        await eventually(lambda: health.leader.is_set() and health.kv is not None, what="health to lead and watch")
        await register(eventlog, with_agent(node("n1").gpus(2).build()))
        await eventually(lambda: "n1" in health.proj.nodes, what="health to fold the registration")
        assert await health.find_lost_nodes() == 0, "noticing the registration counts as a beat"
        beats.advance(29.5)
        assert await health.find_lost_nodes() == 0, "within its timeout"
        beats.advance(1.0)
        assert await health.find_lost_nodes() > 0
        await eventually(lambda: health.proj.nodes["n1"].lost, what="node.lost to be folded")
        assert health.proj.nodes["n1"].lost


def health_on_a_clock():
    """A health service whose heartbeat clock the test advances: (the clock, the services built, the builder)."""
    beats = Clock()
    made: list[Health] = []

    def health_on(settings: Settings, metrics) -> Service:
        made.append(Health(settings, metrics, monotonic=beats))
        return made[0].svc

    return beats, made, health_on


async def test_a_node_that_stops_beating_is_lost_and_its_jobs_requeue_while_retries_last(eventlog: EventLog):
    beats, made, health_on = health_on_a_clock()

    async with in_process_stack(eventlog, build={"health": health_on}) as (client, _):
        [health] = made
        await register(eventlog, with_agent(node("n1").gpus(8).build()))
        once = await submit(client, job("once").gpus(4).build())
        twice = await submit(client, job("twice").gpus(4).build().model_copy(update={"max_retries": 1}))
        for j in (once, twice):
            await job_when(client, j, lambda v: v["state"] == "placed", "placement on n1")
            await eventlog.append(reported(ev.JobTaskStarted(job_id=j, task=0, node_id="n1")))  # as its agent would
            await job_when(client, j, lambda v: v["state"] == "running", "its task to start")
        await register(eventlog, node("n2").gpus(8).build())  # no agent: never watched
        await eventually(lambda: "n1" in health.heartbeats.noticed, what="health to watch n1")
        beats.advance(Settings().heartbeat_timeout_s + 1)  # and n1 never beat
        health.wake.set()

        failed = await job_when(client, once, lambda v: v["state"] == "failed", "the job without retries to fail", 10)
        assert failed["reason"] == "node lost: n1"
        moved = await job_when(client, twice, lambda v: v["state"] == "placed" and v["placement"][0]["node"] == "n2",
                               "the job with a retry to be placed on n2", 10)
        assert moved["preemptions"] == 0
        [requeued] = [e for e in await history(client, f"job/{twice}") if kind(e) == "requeued"]
        assert requeued["data"]["reason"] == "node lost: n1 (retry 1 of 1)"
        assert (await node_state(client, "n1"), await node_state(client, "n2")) == ("lost", "allocated")
        lost = [e for e in await history(client, "node/n1") if kind(e) == "lost"]
        assert len(lost) == 1 and "no heartbeat" in lost[0]["data"]["reason"] and lost[0]["gpuorchepoch"]


async def test_a_job_placed_on_a_node_that_is_lost_before_its_task_starts_is_requeued_without_using_a_retry(
        eventlog: EventLog):
    """The node died silently: it looked free, the job was placed there, and its agent never started the task. The
    job never ran: it goes back to the queue (its max_retries is 0) and its retries stay at 0."""
    beats, made, health_on = health_on_a_clock()

    async with in_process_stack(eventlog, build={"health": health_on}) as (client, _):
        [health] = made
        await register(eventlog, with_agent(node("n1").gpus(8).build()))
        never = await submit(client, job("never-started").gpus(4).build())
        await job_when(client, never, lambda v: v["state"] == "placed", "placement on n1")
        await register(eventlog, node("n2").gpus(8).build())
        await eventually(lambda: "n1" in health.heartbeats.noticed, what="health to watch n1")
        beats.advance(Settings().heartbeat_timeout_s + 1)
        health.wake.set()

        moved = await job_when(client, never, lambda v: v["state"] == "placed" and v["placement"][0]["node"] == "n2",
                               "the job to be placed again, on n2", 10)
        assert moved["retries"] == 0
        [requeued] = [e for e in await history(client, f"job/{never}") if kind(e) == "requeued"]
        assert requeued["data"]["reason"] == "node lost before its tasks started: n1"


async def test_a_job_whose_nodes_are_lost_before_it_starts_goes_back_free_twice_then_fails_as_a_lost_run(
        eventlog: EventLog):
    """A job whose start takes its node down (a poison job) would otherwise go round every node for free: here it is
    placed on n1, n2 and n3 in turn, each lost before its task started; the third loss is a lost run's, and the job
    has no retries (max_retries 0): it fails."""
    beats, made, health_on = health_on_a_clock()

    async with in_process_stack(eventlog, build={"health": health_on}) as (client, _):
        [health] = made
        poison = await submit(client, job("poison").gpus(4).build())
        for n in ("n1", "n2", "n3"):
            await register(eventlog, with_agent(node(n).gpus(8).build()))
            await job_when(client, poison, lambda v, n=n: v["state"] == "placed" and v["placement"][0]["node"] == n,
                           f"placement on {n}")
            await eventually(lambda n=n: n in health.heartbeats.noticed, what=f"health to watch {n}")
            beats.advance(Settings().heartbeat_timeout_s + 1)  # and it never beats
            health.wake.set()
            await job_when(client, poison, lambda v: v["state"] in ("queued", "failed"), f"{n} to be lost", 10)

        failed = await job_when(client, poison, lambda v: v["state"] == "failed", "the job to fail")
        assert failed["reason"] == "node lost before its tasks started: n3, the 3rd time (2 free requeues used)"
        assert (failed["retries"], failed["lost_before_start"]) == (0, 2)
        requeued = [e["data"] for e in await history(client, f"job/{poison}") if kind(e) == "requeued"]
        assert [(r["reason"], r["interrupted"]) for r in requeued] == [
            ("node lost before its tasks started: n1", True), ("node lost before its tasks started: n2", True)]


async def test_an_operator_drain_preempts_with_its_grace_then_the_node_is_drained_and_resumes(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, _):
        await register(eventlog, node("n1").gpus(8).build())
        job_id = await submit(client, job("work").gpus(2).build())
        await job_when(client, job_id, lambda v: v["state"] == "placed", "placement")

        r = await client.post("/v1/nodes/n1/drain", json={"grace_s": 7, "reason": "maintenance"})
        assert r.status_code == 200, r.text
        await job_when(client, job_id, lambda v: v["state"] == "preempting", "the drain to preempt the job")
        [pre] = [e["data"] for e in await history(client, f"job/{job_id}") if kind(e) == "preempting"]
        assert (pre["grace_s"], pre["reason"]) == (7, "node n1 draining: maintenance")
        assert await node_state(client, "n1") == "draining"

        await eventlog.append(reported(ev.JobTaskExited(job_id=job_id, task=0, node_id="n1", signal=15)))  # as its agent would
        await job_when(client, job_id, lambda v: v["state"] == "queued", "the job to go back to the queue")

        async def drained():
            return await node_state(client, "n1") == "cordoned"
        await until(drained, 10, "node.drained")

        assert (await client.post("/v1/nodes/n1/resume")).status_code == 200
        await job_when(client, job_id, lambda v: v["state"] == "placed", "the job to be placed again after resume")
        assert (await client.post("/v1/nodes/nope/cordon")).status_code == 404


async def test_gpuorch_drain_takes_its_grace_as_a_duration_as_every_other_option_does(eventlog: EventLog, monkeypatch):
    async with in_process_stack(eventlog) as (client, _):
        await register(eventlog, node("n1").gpus(8).build(), node("n2").gpus(8).build())
        monkeypatch.setattr(cli, "api_response", through_response(client, asyncio.get_running_loop()))
        code, out = await gpuorch("drain", "n1", "--grace", "2m")
        assert code == 0, out
        [drain] = [e["data"] for e in await history(client, "node/n1") if kind(e) == "drain_requested"]
        assert drain["grace_s"] == 120
        code, out = await gpuorch("drain", "n2", "--grace", "soon")
        assert code == 1 and "--grace 'soon': write a duration" in out, out
        code, out = await gpuorch("drain", "n2", "--grace", "45")
        assert code == 0, out
        assert [e["data"]["grace_s"] for e in await history(client, "node/n2") if kind(e) == "drain_requested"] == [45]


async def test_telemetry_marks_uncorrectable_ecc_and_heat_but_not_an_application_xid(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, services):
        await register(eventlog, node("n1").gpus(4).build(), node("n2").gpus(4).build())
        await until(lambda: _true(len(services["health"].projection.nodes) == 2), 5, "health to know the nodes")
        await nodes_up(client, 2)

        async def gpu(node_id: str, index: int) -> dict:
            return (await client.get(f"/v1/nodes/{node_id}")).json()["gpus"][index]

        async def ecc_marked():
            return (await gpu("n1", 1))["health"] == "unhealthy"
        await eventlog.nc.publish("gpuorch.telemetry.n1.xid",
                                  json.dumps({"node_id": "n1", "gpu_uuid": "GPU-n1-0", "xid": 13, "t": time.time()}).encode())
        await publish_until(eventlog, "gpuorch.telemetry.n1", sample("n1", **{"1": {"ecc_uncorrected": 2}}), ecc_marked,
                            "the ECC fault")
        assert (await gpu("n1", 1))["health_reason"] == "ecc: 2 uncorrectable ECC errors"
        assert (await gpu("n1", 0))["health"] == "healthy", "XID 13 is the application's"

        async def hot_marked():
            return (await gpu("n2", 2))["health"] == "unhealthy"
        await publish_until(eventlog, "gpuorch.telemetry.n2", sample("n2", **{"2": {"temperature_c": 97}}), hot_marked,
                            "the thermal fault")

        async def settled():
            return await node_state(client, "n1") == "cordoned"  # drained: nothing ran there
        await until(settled, 10, "n1 to be drained")
        assert await node_state(client, "n2") == "cordoned"
        n1 = [kind(e) for e in await history(client, "node/n1")]
        n2 = [kind(e) for e in await history(client, "node/n2")]
        assert n1 == ["registered", "unhealthy", "cordoned", "drain_requested", "drained"]
        assert n2 == ["registered", "unhealthy", "cordoned"], "heat cordons; by default it does not drain"


async def test_auto_resume_brings_back_a_node_that_stayed_healthy_for_m_seconds(eventlog: EventLog):
    health = Health(Settings(), policy=HealthPolicy(auto_resume_after_s=1.0, hot_samples=2))
    async with running(health.svc, eventlog):
        await register(eventlog, node("n1").gpus(2).build())
        nodes = health.svc.projection.nodes

        async def cordoned():
            return "n1" in nodes and nodes["n1"].cordoned
        await publish_until(eventlog, "gpuorch.telemetry.n1", sample("n1", **{"0": {"temperature_c": 99}}), cordoned,
                            "the thermal cordon")

        async def resumed():
            return not nodes["n1"].cordoned and not nodes["n1"].unhealthy
        await publish_until(eventlog, "gpuorch.telemetry.n1", sample("n1", **{"0": {"temperature_c": 50}}), resumed,
                            "the auto-resume", timeout=10)
        assert "n1" not in health.svc.projection.manual
