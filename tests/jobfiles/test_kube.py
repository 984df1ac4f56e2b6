"""Kubernetes-family job manifests read as their controllers mean them, one rule per test (README: "Coming from
Kubernetes")."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest
import yaml

from services.jobfiles import Context, JobFileError, Loaded, SiteMap, load_text
from services.scheduler.api import JobRequest


def job_yaml(pod_spec: dict[str, Any] | None = None, spec: dict[str, Any] | None = None,
             labels: dict[str, str] | None = None, container: dict[str, Any] | None = None,
             template_meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """A batch/v1 Job with one container running python train.py."""
    c = {"name": "main", "image": "python:3.11", "command": ["python", "train.py"], **(container or {})}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "train", "labels": labels or {}},
            "spec": {**(spec or {}), "template": {"metadata": template_meta or {},
                                                  "spec": {"restartPolicy": "Never", "containers": [c],
                                                           **(pod_spec or {})}}}}


def load(*docs: dict[str, Any] | str, ctx: Context = Context()) -> Loaded:
    return load_text("---\n".join(d if isinstance(d, str) else yaml.safe_dump(d) for d in docs), "m.yaml", ctx)


def one(*docs: dict[str, Any] | str, ctx: Context = Context()) -> JobRequest:
    loaded = load(*docs, ctx=ctx)
    assert len(loaded.jobs) == 1
    return JobRequest.model_validate(loaded.jobs[0].job)


def refusal(*docs: dict[str, Any]) -> str:
    with pytest.raises(JobFileError) as e:
        load(*docs)
    return str(e.value)


def run(argv: list[str] | tuple[str, ...], **env: str) -> str:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=20,
                          env={"PATH": os.environ["PATH"], **env}).stdout


def test_a_single_job_manifest_is_a_job_and_its_apiversion_no_extra_input():
    j = one(job_yaml(container={"resources": {"limits": {"nvidia.com/gpu": 2}}}))
    assert (j.name, j.tasks, j.resources.gpus, j.command) == ("train", 1, 2, ("python", "train.py"))


def test_a_suspended_job_is_submitted_held_as_kueue_keeps_it_until_admitted():
    assert one(job_yaml(spec={"suspend": True})).hold is True
    assert one(job_yaml(spec={"suspend": False})).hold is False
    assert not any("suspend" in w for w in load(job_yaml(spec={"suspend": True})).jobs[0].warnings)


def test_a_multi_document_file_is_read_whole_and_kinds_that_are_no_job_or_queue_are_skipped_with_a_note():
    loaded = load({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"}}, job_yaml(),
                  {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "ResourceFlavor", "metadata": {"name": "a100"}})
    assert [t.job["name"] for t in loaded.jobs] == ["train"]
    assert loaded.notes == ("v1 ConfigMap cfg: not a job or a queue: skipped",
                            "kueue.x-k8s.io/v1beta1 ResourceFlavor a100: not a job or a queue: skipped")


def test_parallelism_is_the_gang_and_completions_other_than_parallelism_are_refused():
    assert one(job_yaml(spec={"parallelism": 4, "completions": 4})).tasks == 4
    message = refusal(job_yaml(spec={"parallelism": 2, "completions": 10}))
    assert "spec.completions=10" in message and "write completions: 2" in message


def test_command_and_args_run_together_with_dollar_paren_variables_from_the_container_env():
    j = one(job_yaml(container={"args": ["--lr", "$(LR)", "$$(LITERAL)"], "env": [{"name": "LR", "value": "3e-4"}]}))
    assert j.command == ("python", "train.py", "--lr", "3e-4", "$(LITERAL)") and j.env == {"LR": "3e-4"}


def test_a_container_without_command_is_refused_as_its_image_entrypoint_is_unknown_here():
    message = refusal(job_yaml(container={"command": None, "args": ["--epochs", "1"]}))
    assert "containers[main].command" in message and "write command:" in message


def test_gpus_come_from_the_limits_and_cpu_and_memory_from_the_requests():
    j = one(job_yaml(container={"resources": {"requests": {"cpu": "1500m", "memory": "3Gi"},
                                              "limits": {"cpu": 8, "memory": "16Gi", "nvidia.com/gpu": "4"}}}))
    assert (j.resources.gpus, j.resources.cpu_milli, j.resources.memory_mib) == (4, 1500, 3072)


def test_a_pod_without_gpus_is_a_cpu_job():
    assert one(job_yaml()).resources.gpus == 0


@pytest.mark.parametrize("product,model,mig", [("NVIDIA-A100-SXM4-80GB", "A100-SXM4-80GB", None),
                                               ("NVIDIA-H100-80GB-HBM3", "H100-80GB", None), ("Tesla-T4", "T4", None),
                                               ("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", "A100-SXM4-40GB", "1g.5gb")])
def test_the_gpu_product_label_is_a_model_filter_as_nvml_discovery_names_models(product: str, model: str, mig):
    j = one(job_yaml(pod_spec={"nodeSelector": {"nvidia.com/gpu.product": product}},
                     container={"resources": {"limits": {"nvidia.com/gpu": 1}}}))
    assert (j.gpu.models, j.gpu.mig) == ((model,), mig)


def test_other_node_selector_labels_are_the_jobs_node_selector():
    j = one(job_yaml(pod_spec={"nodeSelector": {"pool": "spot", "nvidia.com/gpu.product": "NVIDIA-L4"}},
                     container={"resources": {"limits": {"nvidia.com/gpu": 1}}}))
    assert (j.node_selector, j.gpu.models) == ({"pool": "spot"}, ("L4",))


def test_required_node_affinity_on_the_gpu_product_is_a_model_filter():
    aff = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In",
                               "values": ["NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB"]}]}]}}}
    j = one(job_yaml(pod_spec={"affinity": aff}, container={"resources": {"limits": {"nvidia.com/gpu": 8}}}))
    assert j.gpu.models == ("H100-80GB", "A100-SXM4-80GB")


def test_pod_anti_affinity_on_the_hostname_is_one_task_per_node():
    aff = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"app": "x"}}, "topologyKey": "kubernetes.io/hostname"}]}}
    j = one(job_yaml(spec={"parallelism": 3, "completions": 3}, pod_spec={"affinity": aff}))
    assert (j.tasks, j.tasks_per_node) == (3, 1)


def test_the_shortest_active_deadline_is_the_time_limit():
    assert one(job_yaml(spec={"activeDeadlineSeconds": 600})).time_limit_s == 600
    assert one(job_yaml(spec={"activeDeadlineSeconds": 600}, pod_spec={"activeDeadlineSeconds": 300})).time_limit_s == 300


@pytest.mark.parametrize("label", ["kueue.x-k8s.io/queue-name", "kai.scheduler/queue", "runai/queue"])
def test_the_queue_label_of_kueue_kai_or_run_ai_is_the_queue(label: str):
    assert one(job_yaml(labels={label: "team-a"})).queue == "team-a"
    assert one(job_yaml(template_meta={"labels": {label: "team-b"}})).queue == "team-b"


def test_a_queue_label_naming_a_leaf_is_the_known_path_ending_in_it():
    ctx = Context(queues=("default", "research.team-a.training"))
    assert one(job_yaml(labels={"kueue.x-k8s.io/queue-name": "training"}), ctx=ctx).queue == "research.team-a.training"


@pytest.mark.parametrize("name,priority", [("high-priority", "high"), ("low-priority", "low"), ("train", "low"),
                                           ("inference", "high"), ("system-cluster-critical", "critical"),
                                           ("batch-tier-3", "normal")])
def test_the_priority_class_is_a_priority_by_its_words(name: str, priority: str):
    assert one(job_yaml(pod_spec={"priorityClassName": name})).priority == priority


def test_a_site_maps_its_own_priority_class_names_and_kueues_workload_priority_label():
    ctx = Context(site=SiteMap(priority_classes={"gold": "critical"}))
    assert one(job_yaml(pod_spec={"priorityClassName": "gold"}), ctx=ctx).priority == "critical"
    assert one(job_yaml(labels={"kueue.x-k8s.io/priority-class": "gold"}), ctx=ctx).priority == "critical"


def pytorch_job(master_cmd: list[str], worker_cmd: list[str], workers: int = 2, gpus: int = 1) -> dict[str, Any]:
    def replica(cmd: list[str], n: int) -> dict[str, Any]:
        return {"replicas": n, "template": {"spec": {"containers": [{
            "name": "pytorch", "image": "pytorch", "command": cmd, "resources": {"limits": {"nvidia.com/gpu": gpus}}}]}}}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "ddp"},
            "spec": {"nprocPerNode": "1", "runPolicy": {"schedulingPolicy": {"queue": "nlp", "priorityClass": "high"}},
                     "pytorchReplicaSpecs": {"Master": replica(master_cmd, 1), "Worker": replica(worker_cmd, workers)}}}


def test_a_pytorchjob_is_one_gang_of_master_and_workers_with_the_torchrun_environment():
    cmd = ["sh", "-c", 'echo "$PET_NNODES $PET_NODE_RANK $PET_NPROC_PER_NODE"']
    j = one(pytorch_job(cmd, cmd, workers=3))
    assert (j.tasks, j.resources.gpus, j.queue, j.priority) == (4, 1, "nlp", "high")
    assert run(j.command, WORLD_SIZE="4", RANK="2", MASTER_ADDR="n1", MASTER_PORT="1") == "4 2 1\n"


def test_pytorchjob_roles_that_run_different_commands_pick_theirs_by_rank():
    j = one(pytorch_job(["echo", "master"], ["echo", "worker"], workers=2))
    assert [run(j.command, RANK=str(r), WORLD_SIZE="3") for r in range(3)] == ["master\n", "worker\n", "worker\n"]


def volcano_job(tasks: list[tuple[str, int, dict[str, Any], list[str]]], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "metadata": {"name": "vc"},
            "spec": {"minAvailable": 1, "queue": "vision", **spec, "tasks": [
                {"name": n, "replicas": r, "template": {"spec": {"containers": [
                    {"name": "c", "image": "x", "command": cmd, "resources": {"limits": res}}]}}}
                for n, r, res, cmd in tasks]}}


def test_a_volcano_job_is_one_gang_of_its_tasks_with_vk_task_index_from_the_env_plugin():
    j = one(volcano_job([("ps", 1, {"nvidia.com/gpu": 1}, ["sh", "-c", 'echo "ps $VK_TASK_INDEX"']),
                         ("worker", 2, {"nvidia.com/gpu": 1}, ["sh", "-c", 'echo "worker $VK_TASK_INDEX"'])],
                        plugins={"env": []}, priorityClassName="low-priority"))
    assert (j.tasks, j.queue, j.priority) == (3, "vision", "low")
    assert [run(j.command, RANK=str(r)) for r in range(3)] == ["ps 0\n", "worker 0\n", "worker 1\n"]


def test_volcano_tasks_asking_for_different_resources_are_refused_as_a_gang_is_uniform_here():
    message = refusal(volcano_job([("ps", 1, {"cpu": 4}, ["ps"]), ("worker", 2, {"nvidia.com/gpu": 1}, ["w"])]))
    assert "ps and worker ask for different resources" in message and "give them the same resources" in message


def test_an_indexed_job_gets_its_completion_index_from_its_rank():
    j = one(job_yaml(spec={"parallelism": 2, "completions": 2, "completionMode": "Indexed"},
                     container={"command": ["sh", "-c", "echo index $JOB_COMPLETION_INDEX"]}))
    assert run(j.command, RANK="1") == "index 1\n"


def pod(name: str, group: str | None = None, gpus: int = 1) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "annotations": {"pod-group-name": group} if group else {}},
            "spec": {"containers": [{"name": "c", "image": "x", "command": ["python", "bench.py"],
                                     "resources": {"limits": {"nvidia.com/gpu": gpus}}}]}}


def test_a_kai_podgroup_gathers_the_pods_that_name_it_into_one_gang_and_a_bare_pod_is_a_job_of_its_own():
    group = {"apiVersion": "scheduling.run.ai/v2alpha2", "kind": "PodGroup", "metadata": {"name": "pg"},
             "spec": {"minMember": 2, "queue": "team-c"}}
    loaded = load(group, pod("a", "pg"), pod("b", "pg"), pod("solo"))
    jobs = [JobRequest.model_validate(t.job) for t in loaded.jobs]
    assert [(j.name, j.tasks, j.queue) for j in jobs] == [("pg", 2, "team-c"), ("solo", 1, "default")]


def test_a_kai_gpu_fraction_is_a_shared_gpu_and_a_mig_resource_a_slice():
    assert one(job_yaml(template_meta={"annotations": {"gpu-fraction": "0.25"}})).resources.gpus == 0.25
    j = one(job_yaml(container={"resources": {"limits": {"nvidia.com/mig-2g.20gb": 1}}}))
    assert (j.gpu.mig, j.resources.gpus) == ("2g.20gb", 1)


@pytest.mark.parametrize("change,named", [
    ({"container": {"env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}},
     "env[TOKEN].valueFrom"),
    ({"container": {"envFrom": [{"secretRef": {"name": "s"}}]}}, "envFrom"),
    ({"pod_spec": {"initContainers": [{"name": "fetch", "image": "busybox"}]}}, "initContainers (fetch)"),
    ({"pod_spec": {"containers": [{"name": "a", "command": ["a"]}, {"name": "log", "command": ["b"]}]}},
     "containers (a, log)"),
    ({"pod_spec": {"nodeName": "gpu-07"}}, "nodeName"),
    ({"container": {"resources": {"limits": {"amd.com/gpu": 1}}}}, "amd.com/gpu"),
])
def test_what_would_change_what_runs_is_refused_naming_the_field_and_what_to_write(change, named: str):
    message = refusal(job_yaml(**change))
    assert named in message and any(w in message for w in ("write", "keep", "drop", "ask for", "do their work"))


def test_a_kind_gpuorch_cannot_run_yet_is_refused_saying_what_to_write_instead():
    message = refusal({"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": {"name": "m"}})
    assert "MPIJob" in message and "write it as" in message


def test_the_image_and_volumes_are_warnings():
    t = load(job_yaml(pod_spec={"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}}]},
                      container={"volumeMounts": [{"name": "data", "mountPath": "/data"}]})).jobs[0]
    assert any("image python:3.11 is not pulled" in w for w in t.warnings)
    assert any("volumes (data) are not mounted" in w for w in t.warnings)


def test_a_json_manifest_and_a_kind_list_are_read_too():
    import json

    assert JobRequest.model_validate(load_text(json.dumps(job_yaml()), "j.json", as_json=True).jobs[0].job).name == "train"
    items = {"apiVersion": "v1", "kind": "List", "items": [job_yaml(), {**job_yaml(), "metadata": {"name": "b"}}]}
    assert [t.job["name"] for t in load(items).jobs] == ["train", "b"]


def test_the_working_dir_is_where_the_command_runs(tmp_path):
    j = one(job_yaml(container={"command": ["pwd"], "workingDir": str(tmp_path)}))
    assert run(j.command) == f"{tmp_path}\n"


def test_our_own_job_yaml_is_read_as_it_is():
    j = one("name: mine\ntasks: 2\nresources: {gpus: 1}\ncommand: [python, x.py]\n")
    assert (j.name, j.tasks) == ("mine", 2)
