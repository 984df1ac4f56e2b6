"""On a fresh 3-node JetStream cluster (real nats-server processes), the stack at replicas=3 creates every stream,
bucket, object store and durable consumer at R3 without timing out while the cluster elects its leaders, agents'
consumers included; with one node killed, appends go on."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services import cli
from shared import events as ev
from shared.eventlog import STREAM, WORK_STREAM, EventLog
from shared.events import Envelope
from shared.natsd import NatsCluster, find_binary, free_port
from services.stack import SERVICES, api_auth, build_service
from shared.runtime import Metrics
from shared.settings import Settings
from tests.support import AgentProc, until

pytestmark = pytest.mark.slow


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    try:
        find_binary()
    except FileNotFoundError:
        pytest.skip("no nats-server binary")
    cluster = NatsCluster(tmp_path / "cluster").start()
    try:
        yield cluster
    finally:
        cluster.stop()


async def durable_replicas(log: EventLog, stream: str = STREAM) -> dict[str, int]:
    return {c.name: c.config.num_replicas for c in await log.js.consumers_info(stream) if c.config.durable_name}


async def test_the_stack_at_three_replicas_makes_everything_r3_on_a_fresh_cluster_and_survives_a_node(
        nats_cluster: NatsCluster, tmp_path: Path):
    t0 = time.monotonic()
    log = await EventLog.connect(nats_cluster.url, replicas=3)  # at once: the cluster is still electing its leaders
    print(f"streams created {time.monotonic() - t0:.1f} s after the servers listened")
    settings = Settings(data_dir=tmp_path / "d", replicas=3, cycle_interval_s=0.3)
    services = {n: build_service(n, settings, Metrics()) for n in SERVICES}
    tasks = [asyncio.create_task(s.run(log)) for s in services.values()]  # all at once, as `gpuorch up` starts them
    agent = AgentProc(nats_cluster.url, "n1", tmp_path / "agents" / "n1", args=("--replicas", "3"))
    try:
        await api_auth(settings, log, bootstrap=True)  # the token bucket
        await until(lambda: _all_ready(services, tasks), 60, "every service to be ready")
        print(f"every service ready {time.monotonic() - t0:.1f} s after the servers listened")
        agent.work.mkdir(parents=True)
        agent.start()

        async def agent_consumer() -> dict[str, int] | None:  # it follows its node's work, not the log
            found = await durable_replicas(log, WORK_STREAM)
            return found if any(name.startswith("agent-n1-") for name in found) else None

        assert set((await until(agent_consumer, 30, "the agent's durable consumer")).values()) == {3}
        consumers = await durable_replicas(log)
        await services["scheduler"].save_snapshot()  # the object store is made on the first snapshot
        host = socket.gethostname().replace(".", "_")
        assert {f"svc-{s}-{host}" for s in services} <= set(consumers), consumers
        assert set(consumers.values()) == {3}, consumers
        streams = {s.config.name: s.config.num_replicas for s in await log.js.streams_info()}
        for name in ("GPUORCH", "GPUORCH_DLQ", "GPUORCH_TELEMETRY", "GPUORCH_AGENT", "GPUORCH_WORK", "KV_gpuorch_heartbeats",
                     "KV_gpuorch_leases", "KV_gpuorch_instances", "KV_gpuorch_tokens", "OBJ_gpuorch-snapshots"):
            assert streams.get(name) == 3, (name, streams)

        leader = (await log.js.stream_info(STREAM)).cluster.leader
        nats_cluster.kill(int(leader.removeprefix("n")))
        t1 = time.monotonic()
        seq = await log.append(Envelope(ev.JobQueued(job_id="after-the-kill")))
        print(f"an append after killing the stream leader {leader}: {time.monotonic() - t1:.1f} s")
        assert seq > 0 and (await log.subject_last_seq("gpuorch.events.job.after-the-kill")) == seq
    finally:
        agent.stop_everything()
        for s in services.values():
            s.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        await log.nc.close()  # not drain(): with a node gone, the health service's leftover watchers take 30 s


async def _all_ready(services: dict, tasks: list[asyncio.Task]) -> bool:
    for t in tasks:
        if t.done():
            t.result()  # a service that crashed (a timeout while the cluster elects) fails the test with its error
    return all(s.ready.is_set() for s in services.values())


def test_up_refuses_replicas_without_a_cluster_to_hold_them():
    result = CliRunner().invoke(cli.app, ["up", "--replicas", "3", "--port", str(free_port())])
    assert result.exit_code == 1
    assert "--replicas 3 needs a JetStream cluster" in result.output


async def test_replicas_above_one_on_a_single_server_say_why(nats_url: str):
    with pytest.raises(RuntimeError, match="3 replicas need a JetStream cluster"):
        await asyncio.wait_for(EventLog.connect(nats_url, replicas=3), 30)
