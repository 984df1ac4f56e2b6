"""A gang that names no GPU model may be placed across models, as Slurm and Kubernetes do: a 2 x 8-GPU job ran one
task on H100s and one on L4s. Submitting one where the cluster has several models that could hold its tasks says
so, and how to pin one."""

from __future__ import annotations

from shared import events as ev
from shared.events import Envelope
from tests.builders import node
from tests.support import in_process_stack


def job(name: str, tasks: int, gpus: float, **gpu) -> dict:
    return {"name": name, "tasks": tasks, "resources": {"gpus": gpus}, "command": ["true"], "gpu": gpu}


def mixed(warnings: list[str]) -> list[str]:
    return [w for w in warnings if "different GPU models" in w]


async def test_a_gang_that_could_span_gpu_models_is_warned_with_the_models_and_how_to_pin_one(eventlog):
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        await eventlog.append_many([Envelope(ev.NodeRegistered(node_id=n.node_id, node=n)) for n in (
            node("h1").gpus(8, model="H100-80GB", memory_mib=81_559, cc="9.0").build(),
            node("l1").gpus(8, model="L4", memory_mib=23_034, cc="8.9").build(),
            node("a1").gpus(4, model="A100-40GB", memory_mib=40_960, cc="8.0").build())])
        r = await client.post("/v1/jobs?dry_run=true", json=job("probe", 1, 1))
        assert r.status_code == 200 and r.json()["refused"] is None, r.text  # every node is known

        async def warned(body: dict) -> list[str]:
            r = await client.post("/v1/jobs", json=body)
            assert r.status_code == 201, r.text
            return mixed(r.json()["warnings"])

        said = await warned(job("gang", 2, 8))
        assert said == ["its 2 tasks may be placed on different GPU models (H100-80GB, L4): pin one with "
                        "--model (gpu.models)"], said
        assert await warned(job("gang4", 2, 4)) == [
            "its 2 tasks may be placed on different GPU models (A100-40GB, H100-80GB, L4): pin one with "
            "--model (gpu.models)"]
        assert await warned(job("pinned", 2, 4, models=["H100-80GB"])) == []
        assert await warned(job("one-task", 1, 8)) == []
        assert await warned(job("cpu-gang", 2, 0)) == []
        assert await warned(job("big-memory", 2, 4, min_memory_mib=40_000)) == [
            "its 2 tasks may be placed on different GPU models (A100-40GB, H100-80GB): pin one with "
            "--model (gpu.models)"]
        assert await warned(job("hopper", 2, 4, min_compute_capability="9.0")) == []
        r = await client.post("/v1/jobs?dry_run=true", json=job("gang", 2, 8))
        assert mixed(r.json()["warnings"]), "a dry run says it too"
