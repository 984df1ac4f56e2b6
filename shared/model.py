"""Plain data shared by every service: resources, GPUs, nodes, job and queue specs.

No I/O here. Quantities are integers in small units (milli-GPU, milli-CPU, MiB)
so sums are exact; the API accepts human units and converts at the edge.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

MILLI = 1000
Priority = Literal["critical", "high", "normal", "low"]
PRIORITY_RANK: dict[str, int] = {"low": 0, "normal": 1, "high": 2, "critical": 3}
Topology = Literal["nvlink", "node", "rack", "zone", "any"]
TOPOLOGY_LEVELS: tuple[str, ...] = ("nvlink", "node", "rack", "zone", "any")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}$")
_QUEUE_PATH = re.compile(r"^[a-z0-9][a-z0-9_\-]{0,62}(\.[a-z0-9][a-z0-9_\-]{0,62}){0,7}$")
RESOURCE_NAME = r"^[a-z0-9][a-z0-9-]{0,40}$"  # pools and deployments, as the API takes them

JOB_ID = r"^[a-z0-9][a-z0-9-]{0,80}$"
NODE_ID = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
QUEUE_PATH = _QUEUE_PATH.pattern

# Ids that reach paths, NATS subjects and task environments: checked wherever an event is read, whoever wrote it
JobId = Annotated[str, Field(pattern=JOB_ID)]
NodeId = Annotated[str, Field(pattern=NODE_ID)]
GpuUuid = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$")]  # GPU-..., MIG-..., MIG-GPU-.../1/0
ResourceName = Annotated[str, Field(pattern=RESOURCE_NAME)]
QueuePath = Annotated[str, Field(pattern=_QUEUE_PATH.pattern)]
TaskIndex = Annotated[int, Field(ge=0)]


def _json_number(v: Any) -> Any:
    """JSON numbers only: pydantic's lax mode would read true as 1 and "5" as 5, which the schema does not allow."""
    if isinstance(v, (bool, str)):
        raise ValueError("Input should be a number")
    return v


JsonNumber = BeforeValidator(_json_number)  # an optional number: Annotated[int, Field(ge=...), JsonNumber] | None
Int = Annotated[int, JsonNumber]  # 1.0 is still 1, as JSON Schema's integer says
Float = Annotated[float, JsonNumber]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


# --- inventory -------------------------------------------------------------------


class MigSlice(Frozen):
    uuid: GpuUuid
    profile: str  # e.g. "1g.10gb"
    memory_mib: int = 0


class GpuInfo(Frozen):
    uuid: GpuUuid
    index: int
    model: str
    memory_mib: int
    compute_capability: str = ""
    nvlink_domain: str | None = None  # GPUs sharing a domain talk over NVLink/NVSwitch
    nvlink_peers: tuple[str, ...] = ()
    pci_bus_id: str = ""
    numa_node: int | None = None
    ecc_enabled: bool | None = None
    mig_enabled: bool = False
    mig_slices: tuple[MigSlice, ...] = ()
    healthy: bool = True
    error: str | None = None  # a discovery query that failed for this GPU


class NodeInfo(Frozen):
    node_id: NodeId
    hostname: str = ""
    labels: dict[str, str] = Field(default_factory=dict)
    rack: str = ""
    zone: str = ""
    cpu_milli: int = 0
    memory_mib: int = 0
    gpus: tuple[GpuInfo, ...] = ()
    driver_version: str = ""
    cuda_version: str = ""
    pool: str | None = None
    address: str = ""  # where gang peers reach this node (MASTER_ADDR)
    agent_url: str = ""  # the agent's HTTP endpoint (task logs)


# --- jobs ------------------------------------------------------------------------


def _gpus_schema(schema: dict[str, Any]) -> None:
    """What ``_whole_or_fraction`` accepts, as JSON Schema: a whole number up to 64, or thousandths below 1."""
    for key in ("type", "minimum", "maximum"):
        schema.pop(key, None)
    schema["anyOf"] = [{"type": "integer", "minimum": 0, "maximum": 64},
                       {"type": "number", "minimum": 0, "exclusiveMaximum": 1, "multipleOf": 0.001}]


class TaskResources(Frozen):
    gpus: Float = Field(default=1, ge=0, le=64, description="per task: whole GPUs, or a fraction below 1",
                        json_schema_extra=_gpus_schema)
    cpu_milli: Int = Field(default=0, ge=0, le=10_000_000)
    memory_mib: Int = Field(default=0, ge=0, le=100_000_000)

    @field_validator("gpus")
    @classmethod
    def _whole_or_fraction(cls, v: float) -> float:
        if v >= 1 and v != int(v):
            raise ValueError("gpus must be a whole number, or a fraction below 1 (e.g. 0.25)")
        if v < 1 and round(v, 3) != v:  # decimally, as JSON Schema's multipleOf 0.001 (0.007 * 1000 is no whole float)
            raise ValueError("a fractional GPU is counted in thousandths: at most 3 decimals")
        return v

    @property
    def gpu_milli(self) -> int:
        return round(self.gpus * MILLI)


class GpuConstraints(Frozen):
    models: tuple[str, ...] = ()
    min_memory_mib: Int = Field(default=0, ge=0, le=100_000_000)
    min_compute_capability: str | None = Field(default=None, pattern=r"^[0-9]{1,2}(\.[0-9]{1,2})?$")
    mig: str | None = Field(default=None, pattern=r"^[1-7]g\.[0-9]+gb$")


EnvName = Annotated[str, Field(pattern=r"^[^=\x00]{1,255}$", description="no '=' or NUL: exec() could not pass it")]
# what the API takes (events keep reading EnvName: a job submitted before stays readable)
EnvVarName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,254}$", description="a POSIX environment name")]
NoNul = Annotated[str, Field(max_length=131_072, pattern=r"^[^\x00]*$")]  # reaches exec(): no NUL byte
# an environment as the API takes it; the schema says that names outside the pattern are refused, not just free
EnvMap = Annotated[dict[EnvVarName, NoNul], Field(max_length=1024, json_schema_extra={"additionalProperties": False})]


MAX_ENV_BYTES = 128 * 1024  # env + secret_env as exec() counts them: one "NAME=value" above 128 KiB is E2BIG on Linux


def env_bytes(*envs: dict[str, str]) -> int:
    """Bytes of these environments as exec() passes them: "NAME=value" and a NUL each."""
    return sum(len(k.encode()) + len(v.encode()) + 2 for env in envs for k, v in env.items())


class ArrayElement(Frozen):
    """One element of a job array (Slurm's --array): every element is a job of its own, id ``<array id>-<index>``."""

    id: JobId = Field(description="the array's id: cancel it to cancel every element")
    index: Annotated[int, Field(ge=0, le=1_000_000), JsonNumber]
    max_running: Annotated[int, Field(ge=1, le=100_000), JsonNumber] | None = Field(
        default=None, description="at most this many of the array's elements placed or running at once (--array=...%N)")


class Dependency(Frozen):
    """Slurm's --dependency: the job waits until ``job`` (a job, or every element of an array) has ended so."""

    kind: Literal["afterok", "afterany", "afternotok"] = Field(
        description="afterok: succeeded; afternotok: failed or cancelled; afterany: ended either way")
    job: JobId


class JobSpec(Frozen):
    name: str = Field(min_length=1, max_length=63, pattern=_NAME.pattern,
                      description="letters, digits, '.', '_' or '-', starting with a letter or digit")
    queue: str = Field(default="default", max_length=255, pattern=QUEUE_PATH,
                       description="a leaf of the queue tree as a dotted path of lowercase names, e.g. research.nlp")
    priority: Priority = "normal"
    tasks: Int = Field(default=1, ge=1, le=1024)
    resources: TaskResources = TaskResources()
    gpu: GpuConstraints = GpuConstraints()
    topology: Topology = "any"
    tasks_per_node: Annotated[int, Field(ge=1, le=1024), JsonNumber] | None = Field(
        default=None, description="exactly this many tasks on every node the gang uses, as Slurm's --nodes with "
                                  "--ntasks-per-node (tasks is a multiple of it); none: as many as fit")
    node_selector: dict[str, str] = Field(default_factory=dict)
    time_limit_s: Annotated[int, Field(gt=0, le=365 * 86400), JsonNumber] | None = None
    max_retries: Int = Field(default=0, ge=0, le=100, description="times it is requeued when its node is lost while it "
                             "runs; a job lost before any task started is requeued without spending one, "
                             "twice (GPUORCH_FREE_UNSTARTED_REQUEUES)")
    command: tuple[NoNul, ...] = Field(default=(), max_length=4096)
    env: dict[EnvName, NoNul] = Field(default_factory=dict, max_length=1024)
    secret_env: dict[EnvName, NoNul] = Field(
        default_factory=dict, max_length=1024,
        description="stored, given to the tasks, never shown by the API or in events (env names matching the "
                    "server's secret pattern are moved here on submit)")
    array: ArrayElement | None = Field(default=None, description="set by the API for each element of an array")
    dependencies: tuple[Dependency, ...] = Field(default=(), max_length=64,
                                                 description="all must be met before the job may be placed")
    singleton: bool = Field(default=False, description="Slurm's --dependency=singleton: waits while another job "
                                                       "of the same name and owner is placed or running")

    @model_validator(mode="after")
    def _mig_is_whole_slice(self) -> "JobSpec":
        if self.gpu.mig and self.resources.gpus not in (0, 1):
            raise ValueError("a MIG job asks for one slice per task: leave resources.gpus at 1")
        return self

    @model_validator(mode="after")
    def _tasks_split_evenly_by_node(self) -> "JobSpec":
        k = self.tasks_per_node
        if k is not None and self.tasks % k:
            raise ValueError(f"tasks ({self.tasks}) is not a multiple of tasks_per_node ({k}): every node the gang "
                             "uses holds tasks_per_node tasks")
        if k is not None and self.topology == "node" and k != self.tasks:
            raise ValueError("topology node keeps the gang on one node: leave tasks_per_node out, or equal to tasks")
        return self

    @model_validator(mode="after")
    def _env_fits_exec(self, info: ValidationInfo) -> "JobSpec":
        """Checked where a job is made (the API, a deployment's replicas); a logged job is read as it was
        (``decode`` validates with context ``stored``): its task fails with exec()'s reason instead."""
        if not (info.context or {}).get("stored") and (n := env_bytes(self.env, self.secret_env)) > MAX_ENV_BYTES:
            raise ValueError(f"env and secret_env take {n} bytes as NAME=value; at most {MAX_ENV_BYTES} (128 KiB), "
                             "what one exec() can pass: put larger data in a file")
        return self

    @property
    def gpu_milli(self) -> int:
        return 0 if self.gpu.mig else self.resources.gpu_milli


# --- queues ----------------------------------------------------------------------


MAX_QUEUE_GPUS = 1_000_000


class GpuAmount(Frozen):
    gpus: Float = Field(default=0, ge=0, le=MAX_QUEUE_GPUS)


GroupName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.@+-]{0,127}$")]


class QueueSpec(Frozen):
    guaranteed: GpuAmount = GpuAmount()
    limit: GpuAmount | None = None
    weight: Float = Field(default=1, gt=0, le=1000)
    priority: Int = Field(default=0, ge=-1000, le=1000)
    preempt_min_runtime_s: Int = Field(default=0, ge=0, le=30 * 86400)
    groups: tuple[GroupName, ...] = Field(default=(), max_length=64,
                                          description="groups whose users may submit here (empty: as the parent; none: all)")
    group_access: Literal["none", "read", "cancel"] = Field(
        default="none", description="what users of those groups may do with each other's jobs in this queue")
    max_priority: Priority = Field(default="high", description="the highest priority a user may submit at here")

    @model_validator(mode="after")
    def _limit_above_guarantee(self) -> "QueueSpec":
        if self.limit is not None and self.limit.gpus < self.guaranteed.gpus:
            raise ValueError("limit.gpus is below guaranteed.gpus")
        return self


def valid_queue_path(path: str) -> bool:
    return bool(_QUEUE_PATH.match(path))
