"""POST /v1/jobs on the real stack takes Kubernetes-family manifests (YAML or JSON) and ?dry_run=true, which
answers what it would submit and where it would go now, appending nothing."""

from __future__ import annotations

import asyncio
import json

import yaml

from shared import events as ev
from shared.eventlog import EventLog
from shared.events import Envelope
from tests.builders import node
from tests.support import in_process_stack

YAML = {"content-type": "application/yaml"}
MANIFEST = """
apiVersion: v1
kind: ConfigMap
metadata: {name: settings}
---
apiVersion: batch/v1
kind: Job
metadata:
  name: finetune
  labels: {kueue.x-k8s.io/queue-name: nlp}
spec:
  parallelism: 2
  completions: 2
  template:
    spec:
      restartPolicy: Never
      priorityClassName: high-priority
      nodeSelector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}
      containers:
        - name: trainer
          image: nvcr.io/nvidia/pytorch:24.03-py3
          command: [python, finetune.py]
          env: [{name: EPOCHS, value: "3"}, {name: WANDB_API_KEY, value: "k-123"}]
          resources: {limits: {nvidia.com/gpu: 4}}
"""


async def quiet(eventlog: EventLog, for_s: float = 0.5) -> int:
    """The log's last sequence once the services have stopped appending on their own."""
    while True:
        seq = await eventlog.last_seq()
        await asyncio.sleep(for_s)
        if await eventlog.last_seq() == seq:
            return seq


async def setup(eventlog: EventLog, client) -> None:
    assert (await client.put("/v1/queues/research", json={"guaranteed": {"gpus": 8}})).status_code == 200
    assert (await client.put("/v1/queues/research.nlp", json={"guaranteed": {"gpus": 8}})).status_code == 200
    await eventlog.append_many([Envelope(ev.NodeRegistered(node_id=n.node_id, node=n)) for n in (
        node("h1").gpus(8, model="H100-80GB").build(), node("h2").gpus(8, model="H100-80GB").build())])


async def test_a_kubernetes_manifest_in_yaml_or_json_is_submitted_as_the_job_it_means_with_its_warnings(eventlog):
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        await setup(eventlog, client)
        r = await client.post("/v1/jobs", content=MANIFEST.encode(), headers=YAML)
        assert r.status_code == 201, r.text
        job = r.json()
        spec = job["spec"]
        assert (job["name"], job["queue"], job["priority"], job["tasks"], job["gpus_per_task"]) == (
            "finetune", "research.nlp", "high", 2, 4)
        assert spec["gpu"]["models"] == ["H100-80GB"] and spec["env"] == {"EPOCHS": "3"}
        assert "v1 ConfigMap settings: not a job or a queue: skipped" in job["warnings"]
        assert any("is not pulled" in w for w in job["warnings"])
        assert any("WANDB_API_KEY: named like secrets" in w for w in job["warnings"])

        as_json = yaml.safe_load_all(MANIFEST)
        r = await client.post("/v1/jobs", json=list(as_json)[1])
        assert r.status_code == 201 and r.json()["tasks"] == 2, r.text

        ours = "name: plain\nresources: {gpus: 1}\ncommand: [sleep, '1']\n"
        r = await client.post("/v1/jobs", content=ours.encode(), headers=YAML)
        assert r.status_code == 201 and r.json()["name"] == "plain" and r.json()["warnings"] == [], r.text


async def test_a_manifest_gpuorch_will_not_run_as_written_is_422_naming_the_field_and_appends_nothing(eventlog):
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        before = await quiet(eventlog)
        bad = MANIFEST.replace("parallelism: 2", "parallelism: 2\n  completions: 8").replace("  completions: 2\n", "")
        cases = [
            (bad, "spec.completions=8"),
            # two jobs are a batch, refused whole when one is (no queue nlp here)
            (MANIFEST + "\n---\n" + MANIFEST.split("---")[1].replace("finetune", "second"), "jobs[0]: unknown queue"),
            ("apiVersion: kubeflow.org/v2beta1\nkind: MPIJob\nmetadata: {name: m}\n", "gpuorch does not run MPIJob"),
            ("a: [unclosed", "not valid YAML"),
        ]
        for body, said in cases:
            r = await client.post("/v1/jobs", content=body.encode(), headers=YAML)
            assert r.status_code == 422 and said in r.json()["detail"], r.text
        r = await client.post("/v1/jobs", content=b"kind: Job\napiVersion: batch/v1\n\xff", headers=YAML)
        assert r.status_code == 400
        assert await eventlog.last_seq() == before


async def test_a_dry_run_answers_the_spec_warnings_and_placement_now_and_appends_nothing(eventlog):
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        await setup(eventlog, client)
        before = await quiet(eventlog)

        r = await client.post("/v1/jobs?dry_run=true", content=MANIFEST.encode(), headers=YAML)
        assert r.status_code == 200, r.text
        plan = r.json()
        assert plan["dry_run"] is True and plan["refused"] is None and plan["placed_now"] is True
        assert plan["spec"]["tasks"] == 2 and plan["spec"]["queue"] == "research.nlp"
        assert plan["spec"]["secret_env"] == {"WANDB_API_KEY": "<redacted>"} and "k-123" not in json.dumps(plan)
        assert len(plan["placement"]) == 2 and {p["node"] for p in plan["placement"]} <= {"h1", "h2"}
        assert any("not pulled" in w for w in plan["warnings"])

        spread = {"name": "two-nodes", "tasks": 2, "tasks_per_node": 1, "resources": {"gpus": 8}, "command": ["true"]}
        plan = (await client.post("/v1/jobs?dry_run=true", json=spread)).json()
        assert sorted(p["node"] for p in plan["placement"]) == ["h1", "h2"]

        too_big = {"name": "big", "tasks": 3, "tasks_per_node": 1, "resources": {"gpus": 8}, "command": ["true"]}
        plan = (await client.post("/v1/jobs?dry_run=true", json=too_big)).json()
        assert plan["refused"]["status"] == 422 and "no node could ever run this job" in plan["refused"]["detail"]

        unknown = {"name": "lost", "queue": "nowhere", "resources": {"gpus": 1}, "command": ["true"]}
        plan = (await client.post("/v1/jobs?dry_run=true", json=unknown)).json()
        assert plan["refused"] == {"status": 422, "detail": plan["refused"]["detail"]}
        assert "unknown queue 'nowhere'" in plan["refused"]["detail"]

        assert await eventlog.last_seq() == before, "a dry run appended to the log"

        placed = await client.post("/v1/jobs", json={**spread, "name": "holder"})
        assert placed.status_code == 201
        await quiet(eventlog)
        before = await eventlog.last_seq()
        plan = (await client.post("/v1/jobs?dry_run=true", json=spread)).json()
        assert plan["placed_now"] is False and "1 on each of 2 nodes" in plan["reason"], plan
        assert await eventlog.last_seq() == before


SBATCH = """#!/bin/bash
#SBATCH --job-name=sweep
#SBATCH --gres=gpu:2
#SBATCH --time=00:10:00
#SBATCH --export=HOME
srun python train.py
"""


async def test_an_sbatch_script_posted_as_a_shell_script_is_submitted_as_the_job_it_means(eventlog):
    """curl --data-binary @job.sbatch -H 'Content-Type: text/x-shellscript': the script, translated on the server as
    `gpuorch submit job.sbatch` does, with its warnings; the server's environment never reaches the job."""
    async with in_process_stack(eventlog) as (client, _):
        await setup(eventlog, client)
        for mime in ("text/x-shellscript", "application/x-sh"):
            r = await client.post("/v1/jobs", content=SBATCH, headers={"content-type": mime})
            assert r.status_code == 201, r.text
            job = r.json()
            assert (job["name"], job["spec"]["resources"]["gpus"], job["spec"]["time_limit_s"]) == ("sweep", 2, 600)
            assert job["spec"]["command"][:2] == ["/bin/bash", "-c"] and "srun python train.py" in job["spec"]["command"][2]
            assert job["spec"]["env"] == {} and any("HOME is not set" in w for w in job["warnings"]), job["warnings"]
        r = await client.post("/v1/jobs", content="just words\n", headers={"content-type": "text/x-shellscript"})
        assert r.status_code == 422 and "#!" in r.json()["detail"], r.text


async def test_a_body_of_a_content_type_the_route_does_not_read_is_415_saying_which_it_reads(eventlog):
    """`curl -d '{...}'` sends application/x-www-form-urlencoded: the JSON was answered 422 'Input should be a
    valid dictionary', echoing the JSON it had not read. Now 415, naming the header to send; nothing appended."""
    async with in_process_stack(eventlog) as (client, _):
        await setup(eventlog, client)
        before = await quiet(eventlog)
        body = json.dumps({"name": "x", "command": ["true"]})
        for mime in ("application/x-www-form-urlencoded", "text/plain"):
            r = await client.post("/v1/jobs", content=body, headers={"content-type": mime})
            assert r.status_code == 415, r.text
            detail = r.json()["detail"]
            assert mime in detail and "Content-Type: application/json" in detail and "text/x-shellscript" in detail
            r = await client.put("/v1/queues/vision", content=json.dumps({"guaranteed": {"gpus": 1}}),
                                 headers={"content-type": mime})
            assert r.status_code == 415 and "Content-Type: application/json" in r.json()["detail"], r.text
        assert await eventlog.last_seq() == before
        r = await client.post("/v1/jobs", content=body, headers={"content-type": "application/json; charset=utf-8"})
        assert r.status_code == 201, r.text
