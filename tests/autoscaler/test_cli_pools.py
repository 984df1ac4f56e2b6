"""`gpuorch pools` and `gpuorch deployments` on the real in-process stack: list, set (a pool keeps what is not
given), delete, and the reasons a person gets."""

from __future__ import annotations

import json

from shared.eventlog import EventLog
from tests.jobfiles.test_cli import answer_through, gpuorch
from tests.support import in_process_stack, until


async def test_pools_and_deployments_from_the_command_line(eventlog: EventLog, monkeypatch):
    async with in_process_stack(eventlog, autoscale_interval_s=0.2) as (client, _):
        answer_through(monkeypatch, client)
        code, out = await gpuorch("pools", "set", "t4", "--min", "1")
        assert code == 1 and "pool t4 is new: give --profile and --max" in " ".join(out.split()), out
        code, out = await gpuorch("pools", "set", "t4", "--profile", "t4-4x", "--max", "2", "--idle-timeout", "1m")
        assert code == 0 and "pool t4 created: t4-4x, 0-2 nodes" in out, out
        code, out = await gpuorch("pools", "set", "t4", "--max", "3", "--json")
        pool = json.loads(out)
        assert code == 0 and (pool["max_nodes"], pool["idle_timeout_s"], pool["profile"]) == (3, 60, "t4-4x"), \
            "what was not given stays as it was"
        code, out = await gpuorch("pools", "set", "t4", "--idle-timeout", "soon")
        assert code == 1 and "--idle-timeout 'soon': write a duration" in out, out
        for listing in (("pools",), ("pools", "list"), ("pools", "list", "--json")):  # `list` as `tokens list`
            code, out = await gpuorch(*listing)
            assert code == 0 and "t4" in out and ("0/0/3" in out or '"max_nodes": 3' in out), (listing, out)
        code, out = await gpuorch("pools", "delete", "t4")
        assert code == 0 and "pool t4 deleted" in out, out
        assert (await client.get("/v1/pools")).json() == []

        code, out = await gpuorch("deployments", "set", "web", "--min", "1", "--max", "3", "--per-replica", "5",
                                  "-g", "0.5", "-e", "MODE=fast", "--", "sleep", "600")
        assert code == 0 and "1-3 replicas of 0.5 GPU(s)" in out, out
        dep = (await client.get("/v1/deployments")).json()[0]
        assert dep["spec"]["job"]["env"] == {"MODE": "fast"} and dep["spec"]["target_pending_per_replica"] == 5

        async def replica():
            return [j for j in (await client.get("/v1/jobs", params={"name": "web"})).json()]
        await until(replica, 30, "the minimum replica")
        for listing in (("deployments",), ("deployments", "list")):
            code, out = await gpuorch(*listing)
            assert code == 0 and "1/1/3" in out and "sleep 600" in out, (listing, out)
        code, out = await gpuorch("deployments", "delete", "web")
        assert code == 0 and "its 1 replica(s) are being cancelled" in out, out
        code, out = await gpuorch("deployments", "delete", "web")
        assert code == 1 and "HTTP 404" in out, out
