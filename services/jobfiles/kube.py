"""Kubernetes-family job manifests -> jobs POST /v1/jobs takes (README: "Coming from Kubernetes").

batch/v1 Job, Kubeflow PyTorchJob, Volcano Job, and Pods grouped by a KAI or Volcano PodGroup. Every pod is a
task of one gang; the pods of a job must ask for the same resources (a gang here is uniform), and where roles
run different commands each task picks its own by RANK. gpuorch runs commands on the node, not images.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from services.jobfiles import gpus
from services.jobfiles.common import (
    Context, JobFileError, Notes, Translated, job_name, k8s_cpu_milli, k8s_memory_mib, k8s_quantity, priority_of,
    queue_path, whole_gpus,
)

QUEUE_LABELS = ("kueue.x-k8s.io/queue-name", "kai.scheduler/queue", "runai/queue", "scheduling.volcano.sh/queue-name")
GPU = "nvidia.com/gpu"
PRODUCT = "nvidia.com/gpu.product"
HOSTNAME = "kubernetes.io/hostname"
SILENT_POD = {"containers", "restartPolicy", "schedulerName", "tolerations", "serviceAccountName", "serviceAccount",
              "hostNetwork", "hostIPC", "hostPID", "dnsPolicy", "dnsConfig", "securityContext", "imagePullSecrets",
              "terminationGracePeriodSeconds", "subdomain", "hostname", "shareProcessNamespace", "runtimeClassName",
              "enableServiceLinks", "preemptionPolicy", "automountServiceAccountToken", "priority", "overhead",
              "nodeSelector", "affinity", "priorityClassName", "activeDeadlineSeconds", "volumes", "setHostnameAsFQDN"}
SILENT_CONTAINER = {"name", "image", "imagePullPolicy", "resources", "command", "args", "env", "workingDir",
                    "securityContext", "ports", "terminationMessagePath", "terminationMessagePolicy", "stdin",
                    "stdinOnce", "tty", "volumeMounts", "livenessProbe", "readinessProbe", "startupProbe", "lifecycle",
                    "resizePolicy"}
SILENT_RESOURCES = {"cpu", "memory", "ephemeral-storage", GPU}


@dataclass
class Pod:
    """One pod template, as a task: what it runs and what it needs."""

    argv: list[str]
    env: dict[str, str]
    gpus: float = 0
    cpu_milli: int = 0
    memory_mib: int = 0
    models: tuple[str, ...] = ()
    mig: str | None = None
    min_cc: str | None = None
    min_memory_mib: int = 0
    node_selector: dict[str, str] = field(default_factory=dict)
    priority_class: str | None = None
    deadline_s: int | None = None
    one_per_node: bool = False
    labels: dict[str, str] = field(default_factory=dict)

    def needs(self) -> tuple:
        return (self.gpus, self.cpu_milli, self.memory_mib, self.models, self.mig, self.min_cc, self.min_memory_mib,
                tuple(sorted(self.node_selector.items())), self.one_per_node)


def _map(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise JobFileError(f"{where}: expected a mapping, not {type(value).__name__}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise JobFileError(f"{where}: expected a list, not {type(value).__name__}")
    return value


def _count(value: Any, where: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise JobFileError(f"{where}: {value!r} is not a whole number")
    return value


def _expand(text: str, env: dict[str, str], where: str, notes: Notes) -> str:
    """Kubernetes' $(VAR) in command and args, from the container's env; $$(VAR) is a literal $(VAR)."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0).startswith("$$"):
            return m.group(0)[1:]
        if m.group(1) in env:
            return env[m.group(1)]
        notes.add(f"{where}: $({m.group(1)}) is not set in the container's env: left as written")
        return m.group(0)
    return re.sub(r"\$?\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)


def _selector(sel: dict[str, Any], pod: Pod, where: str, notes: Notes) -> None:
    for key, value in sel.items():
        value = str(value)
        if key == PRODUCT:
            model, mig = gpus.product_model(value)
            pod.models = tuple(dict.fromkeys((*pod.models, model)))
            pod.mig = mig or pod.mig
        elif key == "nvidia.com/gpu.family":
            cc = gpus.FAMILY_CC.get(value.lower())
            if cc is None:
                notes.add(f"{where}: {key}={value} is no GPU family known here: ignored")
            else:
                pod.min_cc = cc
                notes.add(f"{where}: {key}={value} is compute capability {cc} or newer here")
        elif key == "nvidia.com/gpu.memory":
            pod.min_memory_mib = int(k8s_quantity(value, f"{where}.{key}"))
            notes.add(f"{where}: {key}={value} is GPUs with at least {pod.min_memory_mib} MiB here")
        elif key in ("nvidia.com/gpu.count", "nvidia.com/gpu.present", "nvidia.com/mig.strategy"):
            continue
        else:
            pod.node_selector[key] = value


def _affinity(aff: dict[str, Any], pod: Pod, where: str, notes: Notes) -> None:
    node = _map(aff.get("nodeAffinity"), f"{where}.nodeAffinity")
    required = _map(node.get("requiredDuringSchedulingIgnoredDuringExecution"), f"{where}.nodeAffinity.required")
    terms = _list(required.get("nodeSelectorTerms"), f"{where}.nodeAffinity.nodeSelectorTerms")
    if len(terms) == 1:
        for e in _list(_map(terms[0], where).get("matchExpressions"), f"{where}.matchExpressions"):
            key, op, values = e.get("key"), e.get("operator"), [str(v) for v in e.get("values") or []]
            if key == PRODUCT and op == "In" and values:
                found = [gpus.product_model(v) for v in values]
                pod.models = tuple(dict.fromkeys((*pod.models, *(m for m, _ in found))))
            elif op == "In" and len(values) == 1:
                pod.node_selector[key] = values[0]
            else:
                notes.add(f"{where}: node affinity {key} {op} {values}: ignored (node_selector takes key=value)")
    elif terms:
        notes.add(f"{where}: node affinity with several terms (any of): ignored")
    if node.get("preferredDuringSchedulingIgnoredDuringExecution"):
        notes.add(f"{where}: preferred node affinity is no requirement here: ignored")
    anti = _map(aff.get("podAntiAffinity"), f"{where}.podAntiAffinity")
    for term in _list(anti.get("requiredDuringSchedulingIgnoredDuringExecution"), f"{where}.podAntiAffinity"):
        if _map(term, where).get("topologyKey") == HOSTNAME:
            pod.one_per_node = True
        else:
            notes.add(f"{where}: pod anti-affinity on {term.get('topologyKey')}: ignored")
    if aff.get("podAffinity"):
        notes.add(f"{where}: pod affinity: ignored (a gang prefers one node, then one rack)")


def pod_template(template: Any, where: str, notes: Notes) -> Pod:
    """A pod template (metadata + spec) -> what one task runs and needs."""
    template = _map(template, where)
    meta = _map(template.get("metadata"), f"{where}.metadata")
    spec = _map(template.get("spec"), f"{where}.spec")
    where = f"{where}.spec"
    if spec.get("initContainers"):
        names = ", ".join(str(c.get("name")) for c in spec["initContainers"])
        raise JobFileError(f"{where}.initContainers ({names}): they do not run here: do their work at the start "
                           "of the container's command")
    if spec.get("nodeName"):
        raise JobFileError(f"{where}.nodeName: gpuorch places jobs by what nodes offer, not by name: drop it, or "
                           f"ask for a GPU model with nodeSelector {PRODUCT}")
    containers = _list(spec.get("containers"), f"{where}.containers")
    if len(containers) != 1:
        names = ", ".join(str(c.get("name")) for c in containers) or "none"
        raise JobFileError(f"{where}.containers ({names}): a task runs one command here: keep one container")
    c = _map(containers[0], f"{where}.containers[0]")
    cw = f"{where}.containers[{c.get('name', 0)}]"
    env: dict[str, str] = {}
    for e in _list(c.get("env"), f"{cw}.env"):
        e = _map(e, f"{cw}.env")
        if "valueFrom" in e:
            raise JobFileError(f"{cw}.env[{e.get('name')}].valueFrom: gpuorch cannot read secrets, config maps or "
                               "pod fields: write the value (gpuorch submit -e NAME=VALUE), or read RANK, "
                               "MASTER_ADDR and GPUORCH_JOB_ID, which every task gets")
        env[str(e.get("name"))] = _expand(str(e.get("value", "")), env, f"{cw}.env", notes)
    if c.get("envFrom"):
        raise JobFileError(f"{cw}.envFrom: gpuorch cannot read secrets or config maps: write the variables in env")
    command = [str(x) for x in _list(c.get("command"), f"{cw}.command")]
    args = [str(x) for x in _list(c.get("args"), f"{cw}.args")]
    if not command:
        image = c.get("image", "its image")
        raise JobFileError(f"{cw}.command: none, so the image's entrypoint would run, and gpuorch runs no images "
                           f"({image}): write command: [python, train.py] (the entrypoint of {image} and its args)")
    argv = [_expand(a, env, cw, notes) for a in command + args]
    if c.get("workingDir"):
        argv = ["/bin/sh", "-c", 'cd "$1" || exit 1; shift; exec "$@"', "workdir", str(c["workingDir"]), *argv]
    if c.get("image"):
        notes.add(f"image {c['image']} is not pulled: gpuorch runs the command in the node's own environment")
    if c.get("volumeMounts") or spec.get("volumes"):
        names = [str(v.get("name")) for v in _list(spec.get("volumes"), f"{where}.volumes")]
        notes.add(f"{where}.volumes ({', '.join(names) or 'mounts'}) are not mounted: tasks see the node's files")
    extra = sorted(set(c) - SILENT_CONTAINER)
    if extra:
        notes.add(f"{cw}: {', '.join(extra)} ignored")

    pod = Pod(argv=argv, env=env, labels={str(k): str(v) for k, v in _map(meta.get("labels"), where).items()})
    resources = _map(c.get("resources"), f"{cw}.resources")
    limits = _map(resources.get("limits"), f"{cw}.resources.limits")
    requests = _map(resources.get("requests"), f"{cw}.resources.requests")
    gpu = limits.get(GPU, requests.get(GPU))
    if gpu is not None:
        pod.gpus = whole_gpus(k8s_quantity(gpu, f"{cw}.resources {GPU}"), f"{cw}.resources {GPU}")
    for key in {**requests, **limits}:
        if key.startswith("nvidia.com/mig-"):
            pod.mig = key.removeprefix("nvidia.com/mig-")
            n = k8s_quantity(limits.get(key, requests.get(key)), f"{cw}.resources {key}")
            if n != 1:
                raise JobFileError(f"{cw}.resources {key}: {n:g} slices; one MIG slice per task here: ask for 1")
            pod.gpus = 1
        elif key == "amd.com/gpu" or key.startswith("gpu.intel.com/"):
            raise JobFileError(f"{cw}.resources {key}: gpuorch schedules NVIDIA GPUs: ask for {GPU}")
        elif key not in SILENT_RESOURCES:
            notes.add(f"{cw}.resources {key}: not counted here, ignored")
    annotations = _map(meta.get("annotations"), f"{where}.metadata.annotations")
    if "gpu-fraction" in annotations:  # KAI's fractional GPU
        pod.gpus = whole_gpus(float(annotations["gpu-fraction"]), f"{where}.metadata.annotations.gpu-fraction")
    if "gpu-memory" in annotations:
        raise JobFileError(f"{where}.metadata.annotations.gpu-memory: a GPU share is a fraction here: write the "
                           "gpu-fraction annotation")
    cpu = requests.get("cpu", limits.get("cpu"))
    if cpu is not None:
        pod.cpu_milli = k8s_cpu_milli(cpu, f"{cw}.resources cpu")
    mem = requests.get("memory", limits.get("memory"))
    if mem is not None:
        pod.memory_mib = k8s_memory_mib(mem, f"{cw}.resources memory")
    _selector(_map(spec.get("nodeSelector"), f"{where}.nodeSelector"), pod, f"{where}.nodeSelector", notes)
    _affinity(_map(spec.get("affinity"), f"{where}.affinity"), pod, f"{where}.affinity", notes)
    if spec.get("topologySpreadConstraints"):
        notes.add(f"{where}.topologySpreadConstraints: ignored (a gang prefers one node, then one rack)")
    pod.priority_class = spec.get("priorityClassName")
    if spec.get("activeDeadlineSeconds") is not None:
        pod.deadline_s = _count(spec["activeDeadlineSeconds"], f"{where}.activeDeadlineSeconds", 0) or None
    extra = sorted(set(spec) - SILENT_POD)
    if extra:
        notes.add(f"{where}: {', '.join(extra)} ignored")
    return pod


# --- one gang from pods ---------------------------------------------------------------------


@dataclass
class Role:
    name: str
    replicas: int
    pod: Pod


def _dispatch(roles: list[Role], prefix: str = "") -> list[str]:
    """One argv for every task: the role's own, chosen by RANK where roles run different commands."""
    argvs = [(["env", *(f"{k}={v}" for k, v in r.pod.env.items() if _common_env(roles).get(k) != v), *r.pod.argv]
              if any(_common_env(roles).get(k) != v for k, v in r.pod.env.items()) else r.pod.argv) for r in roles]
    if len({tuple(a) for a in argvs}) == 1 and not prefix:
        return argvs[0]
    if len({tuple(a) for a in argvs}) == 1:
        return ["/bin/sh", "-c", prefix + 'exec "$@"', roles[0].name, *argvs[0]]
    lines, start = [], 0
    for r, argv in zip(roles, argvs):
        start += r.replicas
        lines.append(f'if [ "$RANK" -lt {start} ]; then exec {shlex.join(argv)}; fi')
    lines.append("exit 70")
    return ["/bin/sh", "-c", prefix + "; ".join(lines)]


def _common_env(roles: list[Role]) -> dict[str, str]:
    first = roles[0].pod.env
    return {k: v for k, v in first.items() if all(r.pod.env.get(k) == v for r in roles)}


def _labels(*maps: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for m in maps:
        out.update({str(k): str(v) for k, v in (m or {}).items()})
    return out


def gang(origin: str, raw_name: str, roles: list[Role], ctx: Context, notes: Notes, *, queue: str | None = None,
         priority_class: str | None = None, deadline_s: int | None = None, labels: dict[str, str] | None = None,
         prefix: str = "") -> Translated:
    """Roles (Master, Worker; Volcano tasks; pods of a group) -> one gang, in role order (the first is rank 0)."""
    roles = [r for r in roles if r.replicas > 0]
    if not roles:
        raise JobFileError(f"{origin}: no replicas to run")
    first = roles[0].pod
    for r in roles[1:]:
        if r.pod.needs() != first.needs():
            raise JobFileError(f"{origin}: {roles[0].name} and {r.name} ask for different resources; every task of "
                               "a gang asks for the same here: give them the same resources, or submit them as two "
                               "jobs")
    tasks = sum(r.replicas for r in roles)
    job: dict[str, Any] = {}
    job["name"], note = job_name(raw_name, "job")
    notes.add(note)
    labels = {**_labels(*(r.pod.labels for r in roles)), **(labels or {})}
    named = queue or next((labels[k] for k in QUEUE_LABELS if labels.get(k)), None)
    if named:
        job["queue"], note = queue_path(named, ctx, f"{origin}: queue")
        notes.add(note)
    pclass = priority_class or labels.get("kueue.x-k8s.io/priority-class") or first.priority_class
    if pclass:
        job["priority"], note = priority_of(pclass, ctx.site.priority_classes, f"{origin}: priority class")
        notes.add(note)
    deadlines = [d for d in (deadline_s, first.deadline_s) if d]
    if deadlines:
        job["time_limit_s"] = min(deadlines)
    job["tasks"] = tasks
    if first.one_per_node and tasks > 1:
        job["tasks_per_node"] = 1
    job["resources"] = {"gpus": first.gpus, **({"cpu_milli": first.cpu_milli} if first.cpu_milli else {}),
                        **({"memory_mib": first.memory_mib} if first.memory_mib else {})}
    gpu: dict[str, Any] = {}
    if first.models:
        gpu["models"] = list(first.models)
    if first.mig:
        gpu["mig"] = first.mig
    if first.min_cc:
        gpu["min_compute_capability"] = first.min_cc
    if first.min_memory_mib:
        gpu["min_memory_mib"] = first.min_memory_mib
    if gpu and first.gpus:
        job["gpu"] = gpu
    if first.node_selector:
        job["node_selector"] = dict(first.node_selector)
    job["command"] = _dispatch(roles, prefix)
    env = _common_env(roles)
    if env:
        job["env"] = env
    return Translated(job, tuple(notes), origin)


# --- the kinds ------------------------------------------------------------------------------


def _meta(doc: dict[str, Any], kind: str) -> tuple[str, dict[str, Any], str]:
    meta = _map(doc.get("metadata"), f"{kind}.metadata")
    name = str(meta.get("name") or meta.get("generateName") or kind.lower()).rstrip("-")
    return name, meta, f"{doc.get('apiVersion')} {kind} {name}"


def batch_job(doc: dict[str, Any], ctx: Context) -> Translated:
    name, meta, origin = _meta(doc, "Job")
    notes = Notes()
    spec = _map(doc.get("spec"), f"{origin}: spec")
    parallelism = _count(spec.get("parallelism"), f"{origin}: spec.parallelism", 1)
    completions = spec.get("completions")
    if completions is not None and _count(completions, f"{origin}: spec.completions", 1) != parallelism:
        raise JobFileError(f"{origin}: spec.completions={completions} with parallelism={parallelism}: gpuorch starts "
                           f"every task once, all together: write completions: {parallelism} (or submit "
                           f"{completions} jobs)")
    if completions is None and parallelism > 1:
        notes.add(f"{origin}: no completions (a work queue): the job ends when all {parallelism} tasks have ended")
    if parallelism > 1:
        notes.add(f"{origin}: its {parallelism} pods start together, as one gang")
    for key, why in (("backoffLimit", "a failed job is not rerun (max_retries requeues a job whose node is lost)"),
                     ("podFailurePolicy", "a failed job is not rerun")):
        if spec.get(key):
            notes.add(f"{origin}: spec.{key}: ignored ({why})")
    pod = pod_template(spec.get("template"), f"{origin}: spec.template", notes)
    prefix = ""
    if spec.get("completionMode") == "Indexed":
        prefix = 'export JOB_COMPLETION_INDEX="$RANK"; '
    deadline = spec.get("activeDeadlineSeconds")
    made = gang(origin, name, [Role("Job", parallelism, pod)], ctx, notes,
                deadline_s=_count(deadline, f"{origin}: spec.activeDeadlineSeconds", 0) or None,
                labels=_labels(meta.get("labels"), meta.get("annotations")), prefix=prefix)
    if spec.get("suspend") is True:  # as Kueue admits a suspended Job: held here until gpuorch release
        made.job["hold"] = True
    return made


def pytorch_job(doc: dict[str, Any], ctx: Context) -> Translated:
    name, meta, origin = _meta(doc, "PyTorchJob")
    notes = Notes()
    spec = _map(doc.get("spec"), f"{origin}: spec")
    replica_specs = _map(spec.get("pytorchReplicaSpecs"), f"{origin}: spec.pytorchReplicaSpecs")
    unknown = set(replica_specs) - {"Master", "Worker"}
    if unknown:
        raise JobFileError(f"{origin}: spec.pytorchReplicaSpecs.{', '.join(sorted(unknown))}: a PyTorchJob has "
                           "Master and Worker replicas")
    roles = []
    for role in ("Master", "Worker"):
        if role in replica_specs:
            rs = _map(replica_specs[role], f"{origin}: {role}")
            roles.append(Role(role, _count(rs.get("replicas"), f"{origin}: {role}.replicas", 1),
                              pod_template(rs.get("template"), f"{origin}: {role}.template", notes)))
    run = _map(spec.get("runPolicy"), f"{origin}: spec.runPolicy")
    sched = _map(run.get("schedulingPolicy"), f"{origin}: spec.runPolicy.schedulingPolicy")
    if spec.get("elasticPolicy"):
        notes.add(f"{origin}: spec.elasticPolicy: gpuorch starts exactly {sum(r.replicas for r in roles)} tasks")
    if run.get("backoffLimit"):
        notes.add(f"{origin}: runPolicy.backoffLimit: ignored (a failed job is not rerun)")
    nproc = spec.get("nprocPerNode")
    prefix = ('export PET_NNODES="$WORLD_SIZE" PET_NODE_RANK="$RANK" PET_MASTER_ADDR="$MASTER_ADDR" '
              'PET_MASTER_PORT="$MASTER_PORT"' + (f" PET_NPROC_PER_NODE={shlex.quote(str(nproc))}" if nproc else "")
              + "; ")
    return gang(origin, name, roles, ctx, notes, queue=sched.get("queue"), priority_class=sched.get("priorityClass"),
                deadline_s=_count(run.get("activeDeadlineSeconds"), f"{origin}: activeDeadlineSeconds", 0) or None,
                labels=_labels(meta.get("labels"), meta.get("annotations")), prefix=prefix)


def volcano_job(doc: dict[str, Any], ctx: Context) -> Translated:
    name, meta, origin = _meta(doc, "Job")
    notes = Notes()
    spec = _map(doc.get("spec"), f"{origin}: spec")
    roles = []
    for i, t in enumerate(_list(spec.get("tasks"), f"{origin}: spec.tasks")):
        t = _map(t, f"{origin}: spec.tasks[{i}]")
        roles.append(Role(str(t.get("name", f"task{i}")), _count(t.get("replicas"), f"{origin}: tasks[{i}].replicas", 1),
                          pod_template(t.get("template"), f"{origin}: tasks[{t.get('name', i)}].template", notes)))
    total = sum(r.replicas for r in roles)
    min_available = spec.get("minAvailable")
    if min_available is not None and _count(min_available, f"{origin}: spec.minAvailable", 0) < total:
        notes.add(f"{origin}: spec.minAvailable={min_available}: gpuorch starts all {total} tasks together")
    plugins = _map(spec.get("plugins"), f"{origin}: spec.plugins")
    if set(plugins) - {"env", "pytorch"}:
        notes.add(f"{origin}: plugins {', '.join(sorted(set(plugins) - {'env', 'pytorch'}))}: not set up here "
                  "(every task gets RANK, WORLD_SIZE and MASTER_ADDR)")
    for key in ("policies", "maxRetry"):
        if spec.get(key):
            notes.add(f"{origin}: spec.{key}: ignored (a failed job is not rerun)")
    prefix = ""
    if "env" in plugins:  # VK_TASK_INDEX: the pod's index within its task
        starts, start = [], 0
        for r in roles:
            starts.append(f'[ "$RANK" -ge {start} ] && VK_TASK_INDEX=$((RANK - {start}))')
            start += r.replicas
        prefix = "; ".join(starts) + "; export VK_TASK_INDEX; "
    return gang(origin, name, roles, ctx, notes, queue=spec.get("queue"),
                priority_class=spec.get("priorityClassName"),
                labels=_labels(meta.get("labels"), meta.get("annotations")), prefix=prefix)


def pod_group(group: dict[str, Any] | None, pods: list[dict[str, Any]], ctx: Context) -> Translated:
    """A KAI (or Volcano) PodGroup and the Pods that name it; or one bare Pod."""
    notes = Notes()
    roles, labels = [], {}
    for p in pods:
        pname, pmeta, porigin = _meta(p, "Pod")
        roles.append(Role(pname, 1, pod_template({"metadata": pmeta, "spec": p.get("spec")}, porigin, notes)))
        labels.update(_labels(pmeta.get("labels"), pmeta.get("annotations")))
    if group is None:
        name, _, origin = _meta(pods[0], "Pod")
        return gang(origin, name, roles, ctx, notes, labels=labels)
    name, meta, origin = _meta(group, str(group.get("kind")))
    spec = _map(group.get("spec"), f"{origin}: spec")
    min_member = spec.get("minMember")
    if min_member is not None and _count(min_member, f"{origin}: spec.minMember", 0) < len(pods):
        notes.add(f"{origin}: spec.minMember={min_member}: gpuorch starts all {len(pods)} pods together")
    return gang(origin, name, roles, ctx, notes, queue=spec.get("queue"), priority_class=spec.get("priorityClassName"),
                labels={**labels, **_labels(meta.get("labels"))})
