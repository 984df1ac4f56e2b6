"""`gpuorch submit -f`, `--dry-run` and `gpuorch queues set|delete|apply` on the real in-process stack."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from typer.testing import CliRunner

from services import cli
from tests.support import in_process_stack, nodes_up, until

INPUTS = Path(__file__).resolve().parents[1] / "data" / "inputs"


def through(client, loop: asyncio.AbstractEventLoop):
    """cli.api, answered by the in-process stack's ASGI app (the CLI runs in a thread beside the stack's loop)."""
    respond = through_response(client, loop)
    return lambda method, url, path, **kw: respond(method, url, path, **kw).json()


def through_response(client, loop: asyncio.AbstractEventLoop):
    """cli.api_response (which cli.api calls), answered as ``through`` answers: for commands that read headers."""
    def api_response(method: str, url: str, path: str, key: str | None = None, **kw):
        if key is not None:  # a submission's Idempotency-Key, as cli.api_response sends it
            kw["headers"] = {**kw.get("headers", {}), "idempotency-key": key}
        resp = asyncio.run_coroutine_threadsafe(client.request(method, path, **kw), loop).result(30)
        if resp.status_code >= 400:
            cli.fail(f"{resp.json().get('detail')} (HTTP {resp.status_code})")
        return resp
    return api_response


def answer_through(monkeypatch, client) -> None:
    """Every CLI call (``api``, and ``api_response``, which submit calls for the headers) answered by the stack."""
    loop = asyncio.get_running_loop()
    monkeypatch.setattr(cli, "api", through(client, loop))
    monkeypatch.setattr(cli, "api_response", through_response(client, loop))


async def gpuorch(*args: str) -> tuple[int, str]:
    res = await asyncio.to_thread(CliRunner().invoke, cli.app, list(args))
    return res.exit_code, res.output


async def test_submit_f_of_an_sbatch_two_node_by_eight_gpu_job_runs_its_tasks_on_two_distinct_nodes(
        eventlog, agents, monkeypatch):
    agents("a", "b", profile="dgx-h100")
    async with in_process_stack(eventlog) as (client, _):
        answer_through(monkeypatch, client)
        await nodes_up(client, 2)

        code, out = await gpuorch("submit", "-f", str(INPUTS / "two_nodes_eight_gpus.sh"), "--json")
        assert code == 0, out
        submitted = json.loads(out[out.index("{"):])
        assert submitted["tasks"] == 2 and submitted["spec"]["tasks_per_node"] == 1

        async def ended():
            job = (await client.get(f"/v1/jobs/{submitted['id']}")).json()
            return job if job["state"] in ("succeeded", "failed") else None
        job = await until(ended, 60, "the job to end")
        assert job["state"] == "succeeded", job
        assert sorted(p["node"] for p in job["placement"]) == ["a", "b"]
        assert all(len(p["gpus"]) == 8 for p in job["placement"])
        logs = [(await client.get(f"/v1/jobs/{job['id']}/logs", params={"task": t})).json()["data"] for t in (0, 1)]
        assert [log.split(" (")[0] for log in logs] == ["task 0 of 2 on node 0 of 2", "task 1 of 2 on node 1 of 2"], \
            "each task sees its own SLURM_PROCID and SLURM_NODEID, as srun would give it"
        assert [log.split(") ")[0].split("(")[1] for log in logs] == [
            "torchrun: rank 0, node rank 0", "torchrun: rank 1, node rank 1"], logs


async def test_dry_run_and_queue_commands_from_the_command_line(eventlog, monkeypatch, tmp_path):
    from shared import events as ev
    from shared.events import Envelope
    from tests.builders import node

    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        answer_through(monkeypatch, client)
        await eventlog.append_many([Envelope(ev.NodeRegistered(node_id=f"n{i}", node=node(f"n{i}").gpus(8, model="H100-80GB").build()))
                                    for i in range(2)])

        code, out = await gpuorch("queues", "apply", "-f", str(INPUTS / "kueue_cluster_queues.yaml"))
        assert code == 0, out
        queues = {q["path"]: q for q in (await client.get("/v1/queues")).json()}
        assert queues["research.team-a"]["limit"] == {"gpus": 12.0}
        assert queues["research.team-a.training"]["guaranteed"] == {"gpus": 0.0}
        code, out = await gpuorch("queues", "apply", str(INPUTS / "kueue_cluster_queues.yaml"))  # as kubectl apply -f
        # the cohort's queue "research" is made only while missing: a queue the cluster has stays as it is
        assert code == 0 and out.count("unchanged") == 3 and "queue research " not in out, out

        code, out = await gpuorch("queues", "apply", str(INPUTS / "kueue_cluster_queues.yaml"), "-f", "other.yaml")
        assert code == 1 and "name one file" in out, out
        native = tmp_path / "native.yaml"
        native.write_text("apiVersion: gpuorch/v1\nkind: Queue\nmetadata: {name: research}\nspec: {guarantee: 8}\n")
        code, out = await gpuorch("queues", "apply", str(native))
        assert code == 1 and "not a queue gpuorch reads" in out and "gpuorch queues set" in " ".join(out.split()), out
        code, out = await gpuorch("queues", "set", "research.team-b", "--limit", "10", "--weight", "3")
        assert code == 0 and "updated" in out, out
        team_b = next(q for q in (await client.get("/v1/queues")).json() if q["path"] == "research.team-b")
        assert (team_b["guaranteed"], team_b["limit"], team_b["weight"]) == ({"gpus": 8.0}, {"gpus": 10.0}, 3.0)
        code, out = await gpuorch("queues", "set", "scratch", "--guarantee", "0")
        assert code == 0 and "created" in out, out
        code, out = await gpuorch("queues", "set", "scratch", "--guaranteed", "1")  # as the API's field and the table
        assert code == 0 and "guaranteed 1 GPU," in out, out
        # who may submit there, from the CLI as from the API; the rest of the queue stays as it was
        code, out = await gpuorch("queues", "set", "scratch", "--groups", "nlp, vision", "--group-access", "read",
                                  "--max-priority", "normal", "--weight", "2")
        assert code == 0 and "groups nlp,vision (each other's jobs: read)" in " ".join(out.split()), out
        scratch = next(q for q in (await client.get("/v1/queues")).json() if q["path"] == "scratch")
        assert (scratch["groups"], scratch["group_access"], scratch["max_priority"], scratch["weight"]) == \
            (["nlp", "vision"], "read", "normal", 2.0)
        code, out = await gpuorch("queues", "set", "scratch", "--groups", "none")
        scratch = next(q for q in (await client.get("/v1/queues")).json() if q["path"] == "scratch")
        assert code == 0 and scratch["groups"] == [] and scratch["weight"] == 2.0, out
        code, out = await gpuorch("queues", "set", "scratch", "--group-access", "write")
        assert code == 1 and "HTTP 422" in out and "group_access" in out, out
        code, out = await gpuorch("queues", "delete", "scratch")
        assert code == 0 and "deleted" in out, out
        assert "scratch" not in {q["path"] for q in (await client.get("/v1/queues")).json()}

        before = await eventlog.last_seq()
        manifest = tmp_path / "job.yaml"
        manifest.write_text((INPUTS / "job_single_gpu.yaml").read_text().replace("team-a-queue", "training")
                            .replace("NVIDIA-A100-SXM4-80GB", "NVIDIA-H100-80GB-HBM3"))
        code, out = await gpuorch("submit", "-f", str(manifest), "--dry-run")
        assert code == 0, out
        assert "would be submitted to queue research.team-a.training" in out
        assert "it would be placed now" in out and "warning:" in out, out
        code, out = await gpuorch("submit", "-f", str(INPUTS / "megatron_multinode.sbatch"), "--dry-run", "-q",
                                  "research.team-b")
        assert code == 1 and "it would be refused (HTTP 422)" in out, out
        assert await eventlog.last_seq() == before, "a dry run appended to the log"
        # its #SBATCH --partition=h100 names no queue here: refused before sending, saying how to name one
        code, out = await gpuorch("submit", "-f", str(INPUTS / "megatron_multinode.sbatch"))
        said = " ".join(out.split())
        assert code == 1 and "queue 'h100', which is not a queue here" in said and "pass -q QUEUE" in said, out
        assert "GPUORCH_JOBFILE_MAP" in said and "research.team-a.training" in said, out
        assert await eventlog.last_seq() == before

        code, out = await gpuorch("submit", "-f", str(INPUTS / "array_sweep.sh"))
        said = " ".join(out.split())
        assert code == 0 and "10 jobs" in said and "at most 2 at once" in said, out
        sweep = said.split("submitted array ")[1].split()[0]
        assert len((await client.get("/v1/jobs", params={"array": sweep})).json()) == 10
        code, out = await gpuorch("submit", "--array", "1-3%1", "--dependency", f"afterok:{sweep},singleton",
                                  "--name", "merge", "--json", "--", "true")
        assert code == 0, out
        merge = json.loads(out[out.index("{"):])
        assert merge["count"] == 3 and merge["max_running"] == 1
        spec = (await client.get(f"/v1/jobs/{merge['jobs'][0]}")).json()["spec"]
        assert spec["dependencies"] == [{"kind": "afterok", "job": sweep}] and spec["singleton"], spec
        code, out = await gpuorch("submit", "-f", str(INPUTS / "dependent_eval.sh"))
        assert code == 1 and "gpuorch job id" in " ".join(out.split()), out
        code, out = await gpuorch("submit", "--array", "0-99999", "--", "true")
        assert code == 1 and "more than 10000 jobs" in " ".join(out.split()), out


async def test_submit_of_a_job_file_by_its_name_alone_submits_the_file_as_sbatch_does(eventlog, monkeypatch, tmp_path):
    """`gpuorch submit job.sbatch`, as `sbatch job.sbatch`: the script's directives and body make the job. It used to
    become a job whose command was the file's name, which then failed on its node with exit 127 (no such file)."""
    from shared import events as ev
    from shared.events import Envelope
    from tests.builders import node

    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        answer_through(monkeypatch, client)
        await eventlog.append(Envelope(ev.NodeRegistered(node_id="n0", node=node("n0").gpus(8, model="H100-80GB")
                                                         .build())))
        script = tmp_path / "job.sbatch"
        script.write_text("#!/bin/bash\n#SBATCH --job-name=train\n#SBATCH --gres=gpu:2\n#SBATCH --array=0-3\n"
                          "echo hello $SLURM_ARRAY_TASK_ID\n")
        monkeypatch.chdir(tmp_path)
        code, out = await gpuorch("submit", "job.sbatch", "--json")
        assert code == 0, out
        said = " ".join(out.split())
        assert "note: job.sbatch is a job file here, read as -f job.sbatch would read it" in said, out
        assert "gpuorch submit -- bash job.sbatch" in said, out
        array = json.loads(out[out.index("{"):])
        assert array["count"] == 4 and array["name"] == "train", array
        jobs = (await client.get("/v1/jobs", params={"array": array["id"]})).json()
        assert len(jobs) == 4 and {j["spec"]["resources"]["gpus"] for j in jobs} == {2.0}, jobs
        assert all(j["spec"]["command"][:2] == ["/bin/bash", "-c"] and "echo hello" in j["spec"]["command"][2]
                   for j in jobs), jobs[0]["spec"]["command"]  # the script's body, not its name

        # a manifest by its name alone too; a file with arguments after it stays a command (a script on the nodes)
        manifest = tmp_path / "job.yaml"
        manifest.write_text("name: one\ncommand: [\"true\"]\n")
        code, out = await gpuorch("submit", "job.yaml", "--json")
        assert code == 0 and json.loads(out[out.index("{"):])["name"] == "one", out
        code, out = await gpuorch("submit", "--json", "--", "job.sbatch", "--lr", "3")
        assert code == 0 and json.loads(out[out.index("{"):])["spec"]["command"] == ["job.sbatch", "--lr", "3"], out


def test_the_token_option_is_read_wherever_it_is_written_but_never_from_a_jobs_command():
    """`gpuorch jobs --token T` answered "No such option: --token": typer reads it before the command only."""
    assert cli.token_first(["jobs", "--token", "T", "-a"]) == ["--token", "T", "jobs", "-a"]
    assert cli.token_first(["jobs", "--token=T"]) == ["--token=T", "jobs"]
    assert cli.token_first(["--token", "T", "jobs"]) == ["--token", "T", "jobs"]
    assert cli.token_first(["submit", "--", "app", "--token", "X"]) == ["submit", "--", "app", "--token", "X"]


async def test_a_commands_own_option_before_the_double_dash_is_refused_saying_where_it_goes():
    code, out = await gpuorch("submit", "python", "train.py", "--lr", "3")
    said = " ".join(out.replace("│", " ").split())
    assert code == 2 and "No such option: --lr (a command's own options go after --" in said, out

