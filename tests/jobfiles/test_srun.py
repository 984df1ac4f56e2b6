"""gpuorch's srun: a Slurm script's srun lines run their program once in each task."""

from __future__ import annotations

import json

from tests.jobfiles.test_cli import answer_through, gpuorch
from tests.support import in_process_stack, nodes_up, until


async def test_an_sbatch_scripts_srun_lines_run_their_program_once_in_each_task(eventlog, agents, monkeypatch,
                                                                                 tmp_path):
    """Slurm scripts start their tasks with srun. gpuorch starts the tasks itself and each runs the script, so its
    srun (first on every task's PATH) runs the program once, in that task, its options ignored but -D/--chdir:
    the script runs unchanged. There was no srun: such a script failed with 'srun: not found' (127)."""
    agents("a", "b", profile="t4-4x")
    script = tmp_path / "srun.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gres=gpu:1\n"
                      "srun -n 2 --ntasks-per-node=1 --cpu-bind cores -l sh -c 'echo rank $SLURM_PROCID of $SLURM_NTASKS'\n"
                      "srun --chdir=/ pwd\n")
    async with in_process_stack(eventlog) as (client, _):
        answer_through(monkeypatch, client)
        await nodes_up(client, 2)
        code, out = await gpuorch("submit", "-f", str(script), "--json")
        assert code == 0 and "srun lines run their program once in each task" in " ".join(out.split()), out
        job_id = json.loads(out[out.index("{"):])["id"]

        async def ended():
            job = (await client.get(f"/v1/jobs/{job_id}")).json()
            return job if job["state"] in ("succeeded", "failed") else None
        job = await until(ended, 60, "the job to end")
        assert job["state"] == "succeeded", job
        logs = [(await client.get(f"/v1/jobs/{job_id}/logs", params={"task": t})).json()["data"] for t in (0, 1)]
        assert logs == ["rank 0 of 2\n/\n", "rank 1 of 2\n/\n"], logs
