"""Workload traces as plain data: Alibaba openb node and pod lists, Microsoft Philly jobs, our own job files.

Loaders only parse; they never schedule. A time-based trace becomes ``TraceJob``s
(submit time, how long the job holds its resources once placed, its ``JobSpec``);
a cluster becomes ``NodeInfo``s, exactly what node agents would register.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from services.scheduler.placement import PodShape
from shared.model import MILLI, GpuConstraints, GpuInfo, JobSpec, NodeInfo, TaskResources

OPENB_NODES = "openb_node_list_gpu_node.csv"
OPENB_DEFAULT_PODS = "openb_pod_list_default.csv"
KUBE_MIN_CPU = 100  # kube-scheduler's "non-zero request" for a pod that asks for no CPU
PHILLY_NODE_GPUS = 8


class TraceError(ValueError):
    """A trace file that cannot be read, with what to fix."""


@dataclass(frozen=True, slots=True)
class OpenbNode:
    name: str
    cpu: int
    mem: int
    gpus: int
    model: str


@dataclass(frozen=True, slots=True)
class OpenbPod:
    """One openb pod: k GPUs of m milli each (k > 1 only with m = 1000), CPU milli, memory MiB, accepted models."""

    name: str
    cpu: int
    mem: int
    count: int
    milli: int
    models: tuple[str, ...] = ()
    created: float | None = None
    deleted: float | None = None

    @property
    def gpu_milli(self) -> int:
        return self.count * self.milli

    @property
    def shape(self) -> PodShape:
        return PodShape(self.cpu, self.mem, self.count, self.milli, self.models if self.count else ())

    @property
    def typical_key(self) -> tuple[int, int, int, tuple[str, ...]]:
        """The exact tuple FGD's target workload counts: (CPU, m, k, spec); memory is not part of it."""
        return (self.cpu, self.milli, self.count, self.models if self.count else ())


@dataclass(frozen=True, slots=True)
class TraceJob:
    """A job of a time-based trace: when it is submitted and how long it holds what it is given.

    ``duration`` None: it holds its resources until the simulation ends.
    ``cancel_at``: cancelled at that time if still waiting (recorded logs only).
    """

    job_id: str
    submit: float
    duration: float | None
    spec: JobSpec
    cancel_at: float | None = None


def job_id_of(name: str) -> str:
    """A trace's job name as a job id: lowercase letters, digits and '-', as every job event requires."""
    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:72] or "job"


def _rows(path: Path) -> list[dict[str, str]]:
    try:
        with path.open(newline="") as f:
            return list(csv.DictReader(f))
    except OSError as e:
        raise TraceError(f"cannot read {path}: {e.strerror}") from None


def _int(row: dict[str, str], key: str, path: Path, default: int | None = None) -> int:
    value = (row.get(key) or "").strip()
    if not value:
        if default is None:
            raise TraceError(f"{path}: column {key!r} is missing or empty in row {row}")
        return default
    try:
        return int(float(value))
    except ValueError:
        raise TraceError(f"{path}: {key}={value!r} is not a number") from None


def _time(value: str | None) -> float | None:
    try:
        return float(value) if value not in (None, "") else None
    except ValueError:
        return None


def load_openb_nodes(path: Path) -> list[OpenbNode]:
    """GPU nodes only (the paper simulates no CPU-only node), sorted by name."""
    nodes = []
    for row in _rows(path):
        gpus = _int(row, "gpu", path, 0)
        if gpus <= 0:
            continue
        nodes.append(OpenbNode(row["sn"], _int(row, "cpu_milli", path), _int(row, "memory_mib", path), gpus,
                               (row.get("model") or "").strip()))
    if not nodes:
        raise TraceError(f"{path}: no GPU node (columns sn, cpu_milli, memory_mib, gpu, model)")
    return sorted(nodes, key=lambda n: n.name)


def load_openb_pods(path: Path) -> list[OpenbPod]:
    """Pods sorted by name, with the simulator's conversions: CPU 0 becomes 100m, m is clamped to (0, 1000]."""
    pods = []
    for row in _rows(path):
        count = _int(row, "num_gpu", path, 0)
        milli = min(MILLI, max(1, _int(row, "gpu_milli", path, 0))) if count > 0 else 0
        spec = (row.get("gpu_spec") or "").strip()
        models = tuple(m for m in spec.split("|") if m) if count > 0 else ()
        pods.append(OpenbPod(row["name"], _int(row, "cpu_milli", path, 0) or KUBE_MIN_CPU, _int(row, "memory_mib", path, 0),
                             count, milli, models, _time(row.get("creation_time")), _time(row.get("deletion_time"))))
    if not pods:
        raise TraceError(f"{path}: no pod (columns name, cpu_milli, memory_mib, num_gpu, gpu_milli[, gpu_spec])")
    return sorted(pods, key=lambda p: p.name)


def openb_paths(target: Path, workload: str | None = None) -> tuple[Path, Path]:
    """(node list, pod list) for ``openb:DIR`` (the default workload, or ``workload``) or ``openb:POD_CSV``."""
    if target.is_dir():
        name = OPENB_DEFAULT_PODS if workload is None else f"openb_pod_list_{workload}.csv"
        return target / OPENB_NODES, target / name
    return target.parent / OPENB_NODES, target


def workload_name(pod_csv: Path) -> str:
    stem = pod_csv.stem
    return stem.removeprefix("openb_pod_list_")


# --- clusters --------------------------------------------------------------------


def gpu_node(node_id: str, gpus: int, model: str, cpu: int, mem: int, gpu_memory_mib: int = 0) -> NodeInfo:
    return NodeInfo(
        node_id=node_id, hostname=node_id, cpu_milli=cpu, memory_mib=mem,
        gpus=tuple(GpuInfo(uuid=f"GPU-{node_id}-{i}", index=i, model=model, memory_mib=gpu_memory_mib) for i in range(gpus)),
    )


def openb_cluster(nodes: Iterable[OpenbNode]) -> tuple[NodeInfo, ...]:
    return tuple(gpu_node(n.name, n.gpus, n.model, n.cpu, n.mem) for n in nodes)


def uniform_cluster(count: int, gpus: int = PHILLY_NODE_GPUS, model: str = "GPU", prefix: str = "node") -> tuple[NodeInfo, ...]:
    """``count`` identical nodes without CPU or memory limits worth speaking of (Philly jobs ask for neither)."""
    width = max(3, len(str(count - 1)))
    return tuple(gpu_node(f"{prefix}-{i:0{width}d}", gpus, model, 1_000_000, 10_000_000) for i in range(count))


def profile_cluster(spec: str) -> tuple[NodeInfo, ...]:
    """``profile:count,...`` with the simulated node profiles of ``gpuorch up``."""
    from shared.profiles import PROFILES, build

    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        profile, _, count = item.partition(":")
        if profile not in PROFILES:
            raise TraceError(f"unknown node profile {profile!r}; known: {', '.join(PROFILES)}")
        if count and not count.isdigit():
            raise TraceError(f"--nodes takes profile:count, got {item!r}")
        out.extend(build(profile, f"{profile}-{k}") for k in range(int(count or 1)))
    return tuple(out)


# --- time-based jobs -------------------------------------------------------------


def openb_jobs(pods: Sequence[OpenbPod]) -> list[TraceJob]:
    """The openb pods on their own clock: created at creation_time, holding until deletion_time."""
    jobs = []
    for p in pods:
        if p.created is None:
            raise TraceError(f"pod {p.name} has no creation_time: this pod list has no time columns")
        duration = None if p.deleted is None else max(1.0, p.deleted - p.created)
        gpus = p.count if p.milli >= MILLI or p.count == 0 else p.milli / MILLI
        spec = JobSpec(name=p.name, resources=TaskResources(gpus=gpus, cpu_milli=p.cpu, memory_mib=p.mem),
                       gpu=GpuConstraints(models=p.models))
        jobs.append(TraceJob(job_id_of(p.name), p.created, duration, spec))
    return jobs


def philly_split(gpus: int) -> tuple[int, int]:
    """(tasks, GPUs per task) for a Philly job on 8-GPU nodes: the widest tasks that divide it evenly."""
    if gpus <= PHILLY_NODE_GPUS:
        return 1, gpus
    for per in (8, 4, 2, 1):
        if gpus % per == 0:
            return gpus // per, per
    return gpus, 1


def load_philly(path: Path, limit: int | None = None) -> list[TraceJob]:
    """Philly jobs in submit order, on a clock starting at 0 at the first submission.

    Each job's time limit is its actual duration (a perfect user estimate), so
    backfill knows when running jobs end.
    """
    rows = _rows(path)
    if rows and not {"timestamp", "duration", "num_gpus"} <= set(rows[0]):
        raise TraceError(f"{path}: expected columns timestamp, duration, num_gpus")
    parsed = []
    for i, row in enumerate(rows):
        try:
            t = datetime.fromisoformat(row["timestamp"]).timestamp()
            duration = max(1.0, float(row["duration"]))
            gpus = int(row["num_gpus"])
        except (ValueError, KeyError) as e:
            raise TraceError(f"{path}: row {i + 2}: {e}") from None
        if gpus > 0:
            parsed.append((t, i, duration, gpus))
    parsed.sort()
    if limit is not None:
        parsed = parsed[:limit]
    t0 = parsed[0][0] if parsed else 0.0
    jobs = []
    for t, i, duration, gpus in parsed:
        tasks, per = philly_split(gpus)
        spec = JobSpec(name=f"philly-{i}", tasks=tasks, resources=TaskResources(gpus=per),
                       time_limit_s=min(365 * 86400, math.ceil(duration)))
        jobs.append(TraceJob(f"philly-{i:05d}", t - t0, duration, spec))
    return jobs


def window(jobs: Sequence[TraceJob], start_day: float, days: float) -> list[TraceJob]:
    """The jobs submitted in [start_day, start_day + days) of the trace (days since its first job), re-based to 0."""
    t0 = min((j.submit for j in jobs), default=0.0) + start_day * 86400
    t1 = t0 + days * 86400
    return [TraceJob(j.job_id, j.submit - t0, j.duration, j.spec, j.cancel_at) for j in jobs if t0 <= j.submit < t1]


def philly_nodes_for_load(jobs: Sequence[TraceJob], load: float, gpus_per_node: int = PHILLY_NODE_GPUS) -> int:
    """Nodes such that the jobs' GPU-seconds are ``load`` x the cluster's GPU-seconds over the submit span."""
    if not jobs:
        return 1
    span = max(1.0, max(j.submit for j in jobs) - min(j.submit for j in jobs))
    work = sum((j.duration or 0.0) * j.spec.tasks * j.spec.gpu_milli / MILLI for j in jobs)
    return max(1, math.ceil(work / (load * span * gpus_per_node)))


SIM_KEYS = ("submit_at", "duration_s", "count")


def yaml_list(path: Path, key: str) -> list:
    """A YAML/JSON file holding a list, or a mapping with the list under ``key``."""
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise TraceError(f"cannot read {key} from {path}: {e}") from None
    items = doc.get(key) if isinstance(doc, dict) else doc
    if not isinstance(items, list):
        raise TraceError(f"{path}: expected a list of {key}, or a mapping with a '{key}' list")
    return items


def load_job_files(target: Path) -> list[TraceJob]:
    """Our own job files: a directory of YAML/JSON jobs, or one YAML file with a list under ``jobs``.

    Besides the job itself, each may say when it is submitted (``submit_at``, s,
    default 0), how long it runs (``duration_s``, default its time limit, else
    until the end) and how many copies to submit (``count``, default 1).
    """
    from services.jobfile import JobFileError, load_job_file

    docs: list[dict] = []
    if target.is_dir():
        for p in sorted(target.iterdir()):
            if p.suffix in (".yaml", ".yml", ".json", ".sh", ".sbatch"):
                try:
                    docs.append(load_job_file(p))
                except JobFileError as e:
                    raise TraceError(str(e)) from None
    else:
        docs = yaml_list(target, "jobs")
    jobs = []
    for n, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise TraceError(f"{target}: job {n} is not a mapping")
        sim = {k: doc[k] for k in SIM_KEYS if k in doc}
        try:
            spec = JobSpec.model_validate({k: v for k, v in doc.items() if k not in SIM_KEYS})
        except ValueError as e:
            raise TraceError(f"{target}: job {n} ({doc.get('name', '?')}): {e}") from None
        duration = sim.get("duration_s", spec.time_limit_s)
        for c in range(int(sim.get("count", 1))):
            jobs.append(TraceJob(f"{job_id_of(spec.name)}-{n:04d}-{c:04d}", float(sim.get("submit_at", 0.0)),
                                 None if duration is None else float(duration), spec))
    return jobs
