"""MIG on simulated nodes: `gpuorch agent --mig GPU=PROFILE*N` and `gpuorch up --nodes PROFILE+mig:N` lay out
slices as nvidia-smi would; a job asking for a slice gets one (CUDA_VISIBLE_DEVICES is its MIG uuid), and
`gpuorch nodes` counts whole GPUs and free slices apart. (There was no way to try MIG on a simulated stack.)"""

from __future__ import annotations

import pytest

from services.stack_procs import node_ids, parse_nodes
from shared.eventlog import EventLog
from shared.profiles import default_mig, parse_mig
from tests.jobfiles.test_cli import answer_through, gpuorch
from tests.support import AgentProc, in_process_stack, nodes_up, until


def test_mig_layouts_as_written_and_their_mistakes():
    assert parse_mig(["7=1g.10gb*7", "0=3g.40gb, 2g.20gb,1g.10gb*2"]) == {
        7: ["1g.10gb"] * 7, 0: ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]}
    for bad, why in (("7", "GPU=PROFILE"), ("x=1g.10gb", "GPU=PROFILE"), ("7=", "GPU=PROFILE"),
                     ("7=1g.10gb*8", "1 to 7 times"), ("7=1g.10gb*x", "1 to 7 times")):
        with pytest.raises(ValueError, match=why):
            parse_mig([bad])
    assert default_mig("dgx-h100") == {7: ["1g.10gb"] * 7}
    assert parse_nodes("dgx-h100+mig:2,l4-8x") == [("dgx-h100+mig", 2), ("l4-8x", 1)]
    assert node_ids(parse_nodes("dgx-h100+mig:2")) == ["dgx-h100-mig-0", "dgx-h100-mig-1"]
    with pytest.raises(SystemExit, match="L4 GPUs, which have no MIG"):
        parse_nodes("l4-8x+mig:1")


async def test_a_slice_job_runs_on_a_mig_slice_of_a_simulated_node_and_nodes_counts_slices(
        eventlog: EventLog, nats_url: str, tmp_path, monkeypatch):
    agent = AgentProc(nats_url, "m1", tmp_path / "m1", "dgx-h100", args=("--mig", "7=1g.10gb*7")).start()
    try:
        async with in_process_stack(eventlog) as (client, _):
            answer_through(monkeypatch, client)
            await nodes_up(client, 1)
            r = await client.post("/v1/jobs", json={"name": "slice", "gpu": {"mig": "1g.10gb"},
                                                    "command": ["sh", "-c", "echo $CUDA_VISIBLE_DEVICES; sleep 30"]})
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]

            async def running():
                job = (await client.get(f"/v1/jobs/{job_id}")).json()
                log = (await client.get(f"/v1/jobs/{job_id}/logs")).json()["data"] if job["state"] == "running" else ""
                return log if log.startswith("MIG-") else None
            uuid = (await until(running, 30, "the job to run on a slice")).strip()
            gpu7 = (await client.get("/v1/nodes/m1")).json()["gpus"][7]
            assert gpu7["mig_enabled"] and [m["allocated"] for m in gpu7["mig_slices"] if m["uuid"] == uuid] == [True]
            code, out = await gpuorch("nodes")
            row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["m1"])
            assert code == 0 and row[3:5] == ["7/7", "6/7"], out  # seven whole GPUs free; six of seven slices
            code, out = await gpuorch("jobs")
            assert "1x1g.10gb" in out, out
            code, out = await gpuorch("show", job_id)
            assert "tasks:       1 x 1g.10gb, topology any" in out, out
    finally:
        agent.stop_everything()
