"""Job files as people already write them: the API's own JSON/YAML, sbatch scripts, Kubernetes-family manifests.

    load_text(text, "train.sbatch", ctx) -> Loaded(jobs, queues, notes)

Used by `gpuorch submit -f`, `gpuorch queues apply -f` and POST /v1/jobs (a manifest body). Pure: no I/O
beyond what a caller passes in (Context: the site map, the cluster's queues and GPU models).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from services.jobfiles import kube, queues
from services.jobfiles.common import (
    Context, JobFileError, Loaded, NotSupportedYet, QueueDef, SiteMap, Translated, load_site_map,
)
from services.jobfiles.sbatch import from_sbatch

__all__ = ["Context", "JobFileError", "Loaded", "NotSupportedYet", "QueueDef", "SiteMap", "Translated",
           "from_sbatch", "is_manifest", "is_sbatch", "load_file", "load_job_file", "load_site_map", "load_text", "parse_documents"]

# kinds that run something gpuorch cannot run from a manifest yet: refused rather than skipped
WORKLOADS = {"MPIJob", "TFJob", "XGBoostJob", "PaddleJob", "JAXJob", "MXJob", "RayJob", "RayCluster", "RayService",
             "JobSet", "TrainJob", "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "ReplicationController",
             "CronJob", "LeaderWorkerSet", "Notebook", "Workload", "InferenceService"}
# queue kinds of other groups than the ones read (a gpuorch/v1 Queue, say): skipped, naming what is read
QUEUE_KINDS = {"Queue", "ClusterQueue", "LocalQueue", "Cohort"}
INSTEAD = {"MPIJob": "a PyTorchJob or a batch/v1 Job whose pods run mpirun's ranks",
           "TFJob": "a batch/v1 Job with parallelism (every pod gets RANK and WORLD_SIZE)",
           "CronJob": "a batch/v1 Job, submitted on your schedule",
           "Deployment": "an inference deployment (PUT /v1/deployments/NAME)",
           "StatefulSet": "an inference deployment (PUT /v1/deployments/NAME)",
           "InferenceService": "an inference deployment (PUT /v1/deployments/NAME)"}


def is_sbatch(text: str) -> bool:
    return text.startswith("#!") or any(line.startswith("#SBATCH") for line in text.splitlines())


def is_manifest(doc: Any) -> bool:
    return isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc


def parse_documents(text: str, name: str, as_json: bool = False) -> list[Any]:
    """Every document of a YAML stream (JSON is YAML), a kind: List's items in place."""
    try:
        docs = [json.loads(text)] if as_json else list(yaml.safe_load_all(text))
    except (ValueError, yaml.YAMLError) as e:
        raise JobFileError(f"{name} is not valid {'JSON' if as_json else 'YAML'}: {e}") from None
    out = []
    for doc in docs:
        if is_manifest(doc) and doc["kind"] == "List":
            out += [d for d in doc.get("items") or [] if d is not None]
        elif doc is not None:
            out.append(doc)
    return out


def _group(api_version: str) -> str:
    return api_version.split("/")[0] if "/" in api_version else ""


def load_text(text: str, name: str = "job file", ctx: Context = Context(), as_json: bool = False) -> Loaded:
    if not as_json and is_sbatch(text):
        return Loaded(jobs=(from_sbatch(text, Path(name).name, ctx),))
    docs = parse_documents(text, name, as_json)
    if not docs:
        raise JobFileError(f"{name} holds no document")
    return load_documents(docs, name, ctx)


def load_documents(docs: list[Any], name: str, ctx: Context = Context()) -> Loaded:
    jobs: list[Translated] = []
    found: list[queues._Queue] = []
    notes: list[str] = []
    groups: dict[str, dict[str, Any]] = {}
    grouped: dict[str, list[dict[str, Any]]] = {}
    pods: list[dict[str, Any]] = []
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise JobFileError(f"{name}: document {i + 1} is a {type(doc).__name__}, not a job (a mapping)")
        if not is_manifest(doc):
            if "apiVersion" in doc or "kind" in doc:
                raise JobFileError(f"{name}: document {i + 1} has {'apiVersion' if 'apiVersion' in doc else 'kind'} "
                                   "but no " + ("kind" if "apiVersion" in doc else "apiVersion") + ": write both")
            jobs.append(Translated(doc, (), f"job {doc.get('name', i + 1)}"))
            continue
        kind, group = str(doc["kind"]), _group(str(doc["apiVersion"]))
        meta = doc.get("metadata") or {}
        what = f"{doc['apiVersion']} {kind} {meta.get('name', '')}".rstrip()
        if kind == "Job" and group == "batch":
            jobs.append(kube.batch_job(doc, ctx))
        elif kind == "PyTorchJob" and group == "kubeflow.org":
            jobs.append(kube.pytorch_job(doc, ctx))
        elif kind == "Job" and group == "batch.volcano.sh":
            jobs.append(kube.volcano_job(doc, ctx))
        elif kind == "PodGroup" and group in ("scheduling.run.ai", "scheduling.volcano.sh"):
            groups[str(meta.get("name"))] = doc
        elif kind == "Pod" and group == "":
            annotations = meta.get("annotations") or {}
            owner = annotations.get("pod-group-name") or annotations.get("scheduling.k8s.io/group-name")
            if owner:
                grouped.setdefault(str(owner), []).append(doc)
            else:
                pods.append(doc)
        elif kind == "Queue" and group == "scheduling.run.ai":
            found.append(queues.kai_queue(doc))
        elif kind == "Queue" and group == "scheduling.volcano.sh":
            found.append(queues.volcano_queue(doc))
        elif kind in ("ClusterQueue", "Cohort") and group == "kueue.x-k8s.io":
            found.append(queues.kueue_cluster_queue(doc, kind))
        elif kind == "LocalQueue" and group == "kueue.x-k8s.io":
            found.append(queues.kueue_local_queue(doc))
        elif kind in WORKLOADS:
            instead = INSTEAD.get(kind, "a batch/v1 Job, a PyTorchJob or a Volcano Job")
            raise JobFileError(f"{name}: {what}: gpuorch does not run {kind} yet: write it as {instead}")
        elif kind in QUEUE_KINDS:
            notes.append(f"{what}: not a queue gpuorch reads (KAI scheduling.run.ai Queue, Volcano "
                         "scheduling.volcano.sh Queue, Kueue ClusterQueue, LocalQueue or Cohort; or gpuorch queues "
                         "set): skipped")
        else:
            notes.append(f"{what}: not a job or a queue: skipped")
    for owner, members in grouped.items():
        jobs.append(kube.pod_group(groups.pop(owner, None), members, ctx))
    for pg in groups:
        notes.append(f"PodGroup {pg}: no pod in this file names it: skipped")
    jobs += [kube.pod_group(None, [p], ctx) for p in pods]
    return Loaded(tuple(jobs), tuple(queues.queue_defs(found, ctx)), tuple(notes))


def load_file(path: Path, ctx: Context = Context()) -> Loaded:
    try:
        text = path.read_text()
    except OSError as e:
        raise JobFileError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise JobFileError(f"{path} is not text (UTF-8)") from None
    return load_text(text, str(path), ctx, as_json=path.suffix == ".json")


def load_job_file(path: Path, ctx: Context = Context()) -> dict[str, Any]:
    """The one job a file holds, as POST /v1/jobs takes it (simulation traces read job files this way)."""
    loaded = load_file(path, ctx)
    if len(loaded.jobs) != 1:
        raise JobFileError(f"{path} holds {len(loaded.jobs)} jobs; one is expected here")
    return dict(loaded.jobs[0].job)
