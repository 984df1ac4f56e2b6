"""The bus trusts no stranger: credentials at connect, subject permissions per agent, reports checked by inventory."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import pytest

from services.stack import build_service
from shared import events as ev
from shared.eventlog import EventLog
from shared.events import Envelope
from shared.model import NodeInfo
from shared.natsauth import Credentials, agent_inbox, report_subject, telemetry_subject
from shared.natsd import NatsServer
from shared.settings import Settings
from tests.support import eventually, running


async def _quiet(e: Exception) -> None:
    pass


async def agent_client(server: NatsServer, creds: Credentials, node: str, errors: list) -> nats.NATS:
    user = creds.agent(node)

    async def record(e: Exception) -> None:
        errors.append(str(e))

    return await nats.connect(server.url, user=user.name, password=user.password, inbox_prefix=agent_inbox(node),
                              error_cb=record, allow_reconnect=False)


async def control_log(server: NatsServer, creds: Credentials) -> EventLog:
    c = creds.control()
    return await EventLog.connect(server.url, user=c.name, password=c.password)


async def test_a_client_without_credentials_is_refused_at_connect(secured):
    server, creds = secured
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(server.url, allow_reconnect=False, error_cb=_quiet, connect_timeout=2)
    with pytest.raises(PermissionError, match="refused a client without credentials"):
        await EventLog.connect(server.url)
    with pytest.raises(PermissionError, match="refused user 'control'"):
        await EventLog.connect(server.url, user="control", password="guessed")


async def test_an_agent_cannot_append_to_the_log_or_speak_for_another_node(secured):
    server, creds = secured
    log = await control_log(server, creds)
    errors: list[str] = []
    nc = await agent_client(server, creds, "n1", errors)
    js = nc.jetstream(timeout=1)
    forged = Envelope(ev.JobSucceeded(job_id="j-1"), source="/gpuorch/scheduler").encode()
    try:
        with pytest.raises((nats.errors.Error, asyncio.TimeoutError)):
            await js.publish("gpuorch.events.job.j-1", forged, timeout=1)
        with pytest.raises((nats.errors.Error, asyncio.TimeoutError)):
            await js.publish(report_subject("n2", "task_exited"), forged, timeout=1)
        with pytest.raises((nats.errors.Error, asyncio.TimeoutError)):
            await js.publish(telemetry_subject("n2", xid=True), b"{}", timeout=1)
        with pytest.raises((nats.errors.Error, asyncio.TimeoutError)):  # the API tokens
            await js.key_value("gpuorch_tokens")
        await nc.flush()
        await eventually(lambda: len(errors) >= 4, what="the server's permission violations")
        assert all("permissions violation" in e.lower() for e in errors), errors
        assert await log.last_seq() == 0  # nothing reached the log
        await js.publish(telemetry_subject("n1"), b"{}", timeout=2)  # its own subjects it may use
    finally:
        await nc.close()
        await log.close()


async def test_inventory_appends_an_agents_reports_about_itself_and_dead_letters_the_rest(secured, tmp_path: Path):
    server, creds = secured
    log = await control_log(server, creds)
    inventory = build_service("inventory", Settings(data_dir=tmp_path / "data"))
    errors: list[str] = []
    nc = await agent_client(server, creds, "n1", errors)
    js = nc.jetstream()
    node = NodeInfo(node_id="n1", hostname="n1")
    try:
        async with running(inventory, log):
            mine = Envelope(ev.NodeRegistered(node_id="n1", node=node), id="reg-n1", source="/gpuorch/scheduler")
            theirs = Envelope(ev.NodeRegistered(node_id="n2", node=node.model_copy(update={"node_id": "n2"})), id="reg-n2")
            verdict = Envelope(ev.JobSucceeded(job_id="j-1"), id="forged-verdict")
            for env in (theirs, verdict, mine):
                await js.publish(report_subject("n1", env.data.TYPE.split(".")[1]), env.encode(), timeout=2)
            await js.publish(report_subject("n1", "junk"), b"\x00not json", timeout=2)
            await eventually(lambda: "n1" in inventory.projection.nodes, what="n1's own registration")
            stored = [r async for r in log.replay(1)]
            assert [(r.data.TYPE, r.source) for r in stored] == [("node.registered", "/gpuorch/agent/n1")]
            assert "n2" not in inventory.projection.nodes

            async def refused() -> list[str]:
                return sorted(d["headers"]["Gpuorch-Dlq-Reason"] for d in await log.dead_letters())

            async def three() -> bool:
                return len(await refused()) == 3

            deadline = asyncio.get_running_loop().time() + 10
            while not await three():
                assert asyncio.get_running_loop().time() < deadline, await refused()
                await asyncio.sleep(0.05)
            reasons = await refused()
            assert reasons[0] == "agent n1 reported for node n2"
            assert reasons[1] == "an agent may not report job.succeeded"
            assert reasons[2].startswith("undecodable")
    finally:
        await nc.close()
        await log.close()
