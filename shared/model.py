"""Plain data shared by every service: resources, GPUs, nodes, job and queue specs.

No I/O here. Quantities are integers in small units (milli-GPU, milli-CPU, MiB)
so sums are exact; the API accepts human units and converts at the edge.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MILLI = 1000
Priority = Literal["critical", "high", "normal", "low"]
PRIORITY_RANK: dict[str, int] = {"low": 0, "normal": 1, "high": 2, "critical": 3}
Topology = Literal["nvlink", "node", "rack", "zone", "any"]
TOPOLOGY_LEVELS: tuple[str, ...] = ("nvlink", "node", "rack", "zone", "any")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}$")
_QUEUE_PATH = re.compile(r"^[a-z0-9][a-z0-9_\-]{0,62}(\.[a-z0-9][a-z0-9_\-]{0,62}){0,7}$")


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# --- inventory -------------------------------------------------------------------


class MigSlice(Frozen):
    uuid: str
    profile: str  # e.g. "1g.10gb"
    memory_mib: int = 0


class GpuInfo(Frozen):
    uuid: str
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
    node_id: str
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


class TaskResources(Frozen):
    gpus: float = Field(default=1, ge=0, le=64, description="per task: whole GPUs, or a fraction below 1")
    cpu_milli: int = Field(default=0, ge=0, le=10_000_000)
    memory_mib: int = Field(default=0, ge=0, le=100_000_000)

    @field_validator("gpus")
    @classmethod
    def _whole_or_fraction(cls, v: float) -> float:
        if v >= 1 and v != int(v):
            raise ValueError("gpus must be a whole number, or a fraction below 1 (e.g. 0.25)")
        if v < 1 and round(v * MILLI) != v * MILLI:
            raise ValueError("a fractional GPU is counted in thousandths: at most 3 decimals")
        return v

    @property
    def gpu_milli(self) -> int:
        return round(self.gpus * MILLI)


class GpuConstraints(Frozen):
    models: tuple[str, ...] = ()
    min_memory_mib: int = Field(default=0, ge=0)
    min_compute_capability: str | None = None
    mig: str | None = Field(default=None, pattern=r"^[1-7]g\.[0-9]+gb$")


class JobSpec(Frozen):
    name: str = Field(min_length=1, max_length=63)
    queue: str = Field(default="default", max_length=255)
    priority: Priority = "normal"
    tasks: int = Field(default=1, ge=1, le=1024)
    resources: TaskResources = TaskResources()
    gpu: GpuConstraints = GpuConstraints()
    topology: Topology = "any"
    node_selector: dict[str, str] = Field(default_factory=dict)
    time_limit_s: int | None = Field(default=None, gt=0, le=365 * 86400)
    max_retries: int = Field(default=0, ge=0, le=100)
    command: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("name: letters, digits, '.', '_' or '-', starting with a letter or digit")
        return v

    @field_validator("queue")
    @classmethod
    def _queue(cls, v: str) -> str:
        if not _QUEUE_PATH.match(v):
            raise ValueError("queue is a dotted path of lowercase names, e.g. research.nlp")
        return v

    @model_validator(mode="after")
    def _mig_is_whole_slice(self) -> "JobSpec":
        if self.gpu.mig and self.resources.gpus not in (0, 1):
            raise ValueError("a MIG job asks for one slice per task: leave resources.gpus at 1")
        return self

    @property
    def gpu_milli(self) -> int:
        return 0 if self.gpu.mig else self.resources.gpu_milli


# --- queues ----------------------------------------------------------------------


class GpuAmount(Frozen):
    gpus: float = Field(default=0, ge=0)


class QueueSpec(Frozen):
    guaranteed: GpuAmount = GpuAmount()
    limit: GpuAmount | None = None
    weight: float = Field(default=1, gt=0, le=1000)
    priority: int = 0
    preempt_min_runtime_s: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _limit_above_guarantee(self) -> "QueueSpec":
        if self.limit is not None and self.limit.gpus < self.guaranteed.gpus:
            raise ValueError("limit.gpus is below guaranteed.gpus")
        return self


def valid_queue_path(path: str) -> bool:
    return bool(_QUEUE_PATH.match(path))
