"""Autoscaling on the real stack: a pool of simulated nodes grows for a gang and shrinks when idle;
only a provider an admin configured ever runs a command."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from pathlib import Path

import yaml

from services.autoscaler.service import Autoscaler
from shared.eventlog import EventLog
from tests.builders import job
from tests.support import in_process_stack, until


async def events_of(client, type_: str) -> list[dict]:
    return (await client.get("/v1/events", params={"type": type_, "limit": 1000})).json()


class Ahead:
    """The wall clock, moved ahead by hand: ``advance(s)`` makes every later reading ``s`` later."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


async def test_a_gang_makes_the_pool_provision_exactly_what_it_needs_and_idle_nodes_go_away(eventlog: EventLog, agents, tmp_path):
    clock = Ahead()
    autoscaler = {"autoscaler": lambda settings, metrics: Autoscaler(settings, metrics, clock=clock).svc}
    async with in_process_stack(eventlog, autoscaler, autoscale_interval_s=0.3,
                                data_dir=tmp_path / "d") as (client, services):
        agents("small")  # 4 T4s: the gang cannot run here
        await until(lambda: _nodes(client, 1), 30, "the static node")
        r = await client.put("/v1/pools/h100", json={"profile": "dgx-h100", "min_nodes": 0, "max_nodes": 4,
                                                     "provision_delay_s": 1, "idle_timeout_s": 2})
        assert r.status_code == 200, r.text
        spec = job("gang").gpus(8).tasks(2).build().model_copy(update={"command": ("sleep", "1")})
        sub = await client.post("/v1/jobs", json=spec.model_dump(mode="json"))
        assert sub.status_code == 201, sub.text
        job_id = sub.json()["id"]
        t0 = time.monotonic()
        await until(lambda: _state(client, job_id, "succeeded"), 60, "the gang to run on new nodes and succeed")
        requests = await events_of(client, "pool.scale_requested")
        assert [e["data"]["delta"] for e in requests] == [2], "exactly two nodes, asked once"
        provisioned = await events_of(client, "pool.node_provisioned")
        assert len(provisioned) == 2
        assert time.monotonic() - t0 >= 1, "not before the provision delay"
        placed = (await client.get(f"/v1/jobs/{job_id}")).json()["placement"]
        assert {p["node"] for p in placed} == {e["data"]["node_id"] for e in provisioned}

        await until(lambda: _pool_size(client, "h100", 0), 30, "idle pool nodes to be terminated")
        terminated = await events_of(client, "pool.node_terminated")
        assert len(terminated) == 2
        assert {n["id"] for n in (await client.get("/v1/nodes")).json()} == {"small"}

        await client.put("/v1/pools/h100", json={"profile": "dgx-h100", "min_nodes": 1, "max_nodes": 4,
                                                 "provision_delay_s": 0, "idle_timeout_s": 1})
        await until(lambda: _pool_size(client, "h100", 1), 30, "the pool to reach its minimum")
        await until(lambda: _nodes(client, 2), 30, "the minimum node to register")
        [kept] = next(p for p in (await client.get("/v1/pools")).json() if p["name"] == "h100")["nodes"]
        clock.advance(60)  # well past the idle timeout: the minimum stays
        await cycles_pass(client, 2)
        assert next(p for p in (await client.get("/v1/pools")).json() if p["name"] == "h100")["nodes"] == [kept]
        assert len(await events_of(client, "pool.node_terminated")) == 2, "the two before, and no other"


def provisioner(tmp_path: Path, marker: Path) -> Path:
    """A program that leaves a marker with the request it got and answers with a node id."""
    script = tmp_path / "provision"
    script.write_text(f"#!{sys.executable}\nimport json, pathlib, sys\nrequest = json.load(sys.stdin)\n"
                      f"pathlib.Path({str(marker)!r}).write_text(json.dumps(request))\n"
                      "print(json.dumps({'node_id': 'cloud-' + request['node_id']}))\n")
    script.chmod(0o755)
    return script


async def autoscaler_cycles(client) -> int:
    m = re.search(r'gpuorch_cycle_seconds_count\{service="autoscaler"\} (\S+)', (await client.get("/metrics")).text)
    return int(float(m.group(1))) if m else 0


async def cycles_pass(client, n: int) -> None:
    start = await autoscaler_cycles(client)

    async def check():
        return await autoscaler_cycles(client) >= start + n
    await until(check, 20, f"{n} autoscaler cycles")


async def test_a_pool_request_that_names_a_command_is_refused_and_nothing_runs(eventlog: EventLog, tmp_path):
    marker = tmp_path / "ran"
    script = str(provisioner(tmp_path, marker))
    async with in_process_stack(eventlog, autoscale_interval_s=0.1, data_dir=tmp_path / "d") as (client, _):
        r = await client.put("/v1/pools/x", json={"profile": "dgx-h100", "min_nodes": 1, "max_nodes": 1, "provider": "command",
                                                  "provision_command": [script], "terminate_command": [script]})
        assert r.status_code == 422, r.text
        assert {"provision_command", "terminate_command"} <= {e["loc"][-1] for e in r.json()["detail"]}
        await cycles_pass(client, 3)
        assert not marker.exists()
        assert (await client.get("/v1/pools")).json() == []


async def test_a_forged_v1_pool_event_runs_nothing_and_the_pool_says_its_provider_is_not_configured(eventlog: EventLog, tmp_path):
    marker = tmp_path / "ran"
    script = str(provisioner(tmp_path, marker))
    forged = {"specversion": "1.0", "id": "forged-pool", "source": "/gpuorch/autoscaler", "type": "io.gpuorch.pool.defined.v1",
              "subject": "pool/evil", "time": "2026-01-01T00:00:00Z", "datacontenttype": "application/json",
              "data": {"pool": "evil", "profile": "dgx-h100", "min_nodes": 1, "max_nodes": 2, "provider": "command",
                       "provision_command": [script], "terminate_command": [script]}}
    async with in_process_stack(eventlog, autoscale_interval_s=0.1, data_dir=tmp_path / "d") as (client, _):
        await eventlog.js.publish("gpuorch.events.pool.evil", json.dumps(forged).encode(),
                                  headers={"Content-Type": "application/cloudevents+json"})

        async def pool_listed():
            return [p for p in (await client.get("/v1/pools")).json() if p["name"] == "evil"]
        [pool] = await until(pool_listed, 10, "the forged pool to be folded")
        await cycles_pass(client, 3)
        assert not marker.exists()
        assert pool["provider"] == "command"
        assert pool["provider_error"] == "provider 'command' is not configured on this server"
        assert script not in (await client.get("/v1/pools")).text
        assert await events_of(client, "pool.scale_requested") == []


async def test_a_provider_the_admin_configured_runs_its_command_when_the_pool_must_grow(eventlog: EventLog, tmp_path):
    marker = tmp_path / "ran"
    script = str(provisioner(tmp_path, marker))
    providers = tmp_path / "providers.yaml"
    providers.write_text(yaml.safe_dump({"providers": {"lab": {"kind": "command", "provision": [script],
                                                               "terminate": [script], "timeout_s": 30}}}))
    async with in_process_stack(eventlog, autoscale_interval_s=0.1, data_dir=tmp_path / "d", providers_file=providers) as (client, _):
        r = await client.put("/v1/pools/lab-h100", json={"profile": "dgx-h100", "min_nodes": 1, "max_nodes": 2, "provider": "nope"})
        assert r.status_code == 422 and "configured providers: simulated, lab" in r.text, r.text
        r = await client.put("/v1/pools/lab-h100", json={"profile": "dgx-h100", "min_nodes": 1, "max_nodes": 2, "provider": "lab"})
        assert r.status_code == 200, r.text

        async def provisioned():
            pool = (await client.get("/v1/pools")).json()[0]
            return pool if pool["nodes"] else None
        pool = await until(provisioned, 20, "the admin's provisioner to add a node")
        request = json.loads(marker.read_text())
        assert request["action"] == "provision" and request["pool"] == "lab-h100" and request["profile"] == "dgx-h100"
        assert pool["nodes"] == [f"cloud-{request['node_id']}"]
        assert pool["provider"] == "lab" and pool["provider_error"] is None
        assert script not in (await client.get("/v1/pools")).text



async def _nodes(client, n: int) -> bool:
    return len((await client.get("/v1/nodes")).json()) >= n


async def _state(client, job_id: str, state: str) -> bool:
    j = (await client.get(f"/v1/jobs/{job_id}")).json()
    assert j["state"] not in ("failed", "cancelled"), j
    return j["state"] == state


async def _pool_size(client, pool: str, n: int) -> bool:
    p = next(p for p in (await client.get("/v1/pools")).json() if p["name"] == pool)
    return len(p["nodes"]) == n and p["in_flight"] == 0


async def test_a_deployment_follows_its_demand_and_deleting_it_stops_its_replicas_and_nothing_else(
        eventlog: EventLog, agents, tmp_path):
    """Replicas follow the posted queue length; DELETE /v1/deployments/NAME cancels them (running and waiting), and
    not a job of another owner that names the deployment in its environment. A pool is deleted only once it has
    no node. (Neither could be deleted before: a deployment could only be scaled down to one replica.)"""
    from tests.support import as_user, nodes_up

    async with in_process_stack(eventlog, autoscale_interval_s=0.2, data_dir=tmp_path / "d") as (client, _):
        agents("n1")  # 4 GPUs: three replicas run, the fourth waits
        await nodes_up(client, 1)
        r = await client.put("/v1/deployments/chat", json={
            "command": ["sleep", "600"], "resources": {"gpus": 1}, "min_replicas": 1, "max_replicas": 5,
            "target_pending_per_replica": 10, "stabilization_s": 0})
        assert r.status_code == 200, r.text
        bob = await as_user(client, "bob")
        lookalike = await bob.post("/v1/jobs", json={"name": "mine", "command": ["sleep", "600"],
                                                     "env": {"GPUORCH_DEPLOYMENT": "chat"}})
        assert lookalike.status_code == 201, lookalike.text

        async def replicas(n: int, state: str | None = None):
            jobs = [j for j in (await client.get("/v1/jobs", params={"name": "chat", "all": "true"})).json()
                    if state is None or j["state"] == state]
            return jobs if len(jobs) == n else None

        await until(lambda: replicas(1, "running"), 30, "the minimum replica")
        assert (await client.post("/v1/deployments/chat/metrics", json={"pending_requests": 35})).status_code == 200
        await until(lambda: replicas(4), 30, "four replicas for 35 waiting requests")
        await until(lambda: replicas(3, "running"), 30, "three running on the node's four GPUs")

        r = await client.delete("/v1/deployments/chat")
        assert r.status_code == 200 and r.json()["replicas"] == 4, r.text
        await until(lambda: replicas(4, "cancelled"), 30, "every replica cancelled")
        assert (await client.get("/v1/deployments")).json() == []
        assert (await client.get(f"/v1/jobs/{lookalike.json()['id']}")).json()["state"] in ("queued", "running"), \
            "another owner's job that names the deployment is not a replica"
        assert (await client.delete("/v1/deployments/chat")).status_code == 404
        assert (await bob.delete("/v1/deployments/chat")).status_code == 403

        pool = {"profile": "t4-4x", "min_nodes": 1, "max_nodes": 1, "provision_delay_s": 0, "idle_timeout_s": 1}
        assert (await client.put("/v1/pools/t4", json=pool)).status_code == 200
        await until(lambda: _pool_nodes(client, "t4", 1), 30, "the pool's minimum node")
        r = await client.delete("/v1/pools/t4")
        assert r.status_code == 409 and "set its min_nodes and max_nodes to 0" in r.json()["detail"], r.text
        assert (await client.put("/v1/pools/t4", json={**pool, "min_nodes": 0, "max_nodes": 0})).status_code == 200
        await until(lambda: _pool_nodes(client, "t4", 0), 30, "the idle node to go")
        assert (await client.delete("/v1/pools/t4")).status_code == 200
        assert (await client.get("/v1/pools")).json() == []


async def _pool_nodes(client, pool: str, n: int) -> bool:
    pools = {p["name"]: p for p in (await client.get("/v1/pools")).json()}
    return pool in pools and len(pools[pool]["nodes"]) == n and pools[pool]["in_flight"] == 0


async def test_a_pool_node_lost_for_long_is_terminated_and_replaced(eventlog: EventLog, tmp_path):
    """A pool at its min whose node dies (its agent killed: no heartbeat) used to keep the lost node for ever,
    counted toward its min: it never bought another. Now the node is terminated after pool_lost_node_s and
    the pool buys a replacement."""
    import os
    import signal

    async with in_process_stack(eventlog, autoscale_interval_s=0.2, heartbeat_timeout_s=1.5, pool_lost_node_s=1,
                                data_dir=tmp_path / "d") as (client, _):
        r = await client.put("/v1/pools/t4", json={"profile": "t4-4x", "min_nodes": 1, "max_nodes": 2})
        assert r.status_code == 200, r.text

        async def pool_nodes() -> list[str] | None:
            nodes = {n["id"]: n for n in (await client.get("/v1/nodes")).json()}
            pool = (await client.get("/v1/pools")).json()[0]["nodes"]
            return pool if pool and all(nodes.get(n, {}).get("state") == "idle" for n in pool) else None

        [first] = await until(pool_nodes, 30, "the pool's minimum node")
        pid = int((tmp_path / "d" / "pools" / first / "pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        replaced = await until(lambda: _replaced(pool_nodes, first), 60, "a new node in place of the lost one")
        assert len(replaced) == 1 and replaced != [first]
        terminated = [e["data"]["node_id"] for e in await events_of(client, "pool.node_terminated")]
        assert terminated == [first]


async def _replaced(pool_nodes, first: str) -> list[str] | None:
    nodes = await pool_nodes()
    return nodes if nodes and first not in nodes else None


async def test_a_deployments_posted_load_outlives_an_autoscaler_restart(eventlog: EventLog, tmp_path):
    """The queue length a server posts is kept in a bucket, not in the autoscaler's memory: a restarted autoscaler
    (or another replica of it, which would have missed the post) still reads it, so the replicas stay. It used to
    read 0 after a restart and cut the replicas down to the minimum until the next post."""
    spec = {"command": ["sleep", "600"], "resources": {"gpus": 1}, "min_replicas": 1, "max_replicas": 5,
            "target_pending_per_replica": 10, "stabilization_s": 0}

    async def replicas(client, n: int):
        jobs = (await client.get("/v1/jobs", params={"name": "chat"})).json()
        return jobs if len(jobs) == n else None

    async with in_process_stack(eventlog, autoscale_interval_s=0.2, data_dir=tmp_path / "d") as (client, _):
        assert (await client.put("/v1/deployments/chat", json=spec)).status_code == 200
        assert (await client.post("/v1/deployments/chat/metrics", json={"pending_requests": 35})).status_code == 200
        await until(lambda: replicas(client, 4), 30, "four replicas for 35 waiting requests")
    async with in_process_stack(eventlog, autoscale_interval_s=0.2, data_dir=tmp_path / "d") as (client, _):
        [dep] = (await client.get("/v1/deployments")).json()
        assert dep["pending_requests"] == 35
        for _ in range(10):  # ten scaling passes: none scales down
            await asyncio.sleep(0.2)
            assert await replicas(client, 4), "the replicas were cut on a restart"
