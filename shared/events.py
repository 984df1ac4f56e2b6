"""Event types, their registry, and the CloudEvents 1.0 envelope.

Every event is a frozen pydantic model registered under a versioned type name
``io.gpuorch.<aggregate>.<verb>.v<N>``. On the wire an event is a CloudEvents
structured-mode JSON document (as the NATS protocol binding 1.0.2 defines it),
so any CloudEvents SDK can read the stream. Old versions stay readable forever:
an upcaster registered for ``(type, version)`` rewrites the data on read.
"""

from __future__ import annotations

import json
import os
import time as _time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Callable, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import from_json, to_json

from shared.model import (
    GpuUuid, JobId, JobSpec, NodeId, NodeInfo, Priority, QueuePath, QueueSpec, ResourceName, TaskIndex,
)

CE_PREFIX = "io.gpuorch."
SUBJECT_PREFIX = "gpuorch.events"
CONTENT_TYPE = "application/cloudevents+json"


class UnknownEventType(Exception):
    """The type is not in this code's registry (newer producer, or a typo)."""


class MalformedEvent(Exception):
    """The body is not a CloudEvent, or its data does not match its type."""


def new_id(prefix: str = "") -> str:
    """Time-ordered unique id: 12 hex digits of milliseconds + 10 random hex digits."""
    return f"{prefix}{int(_time.time() * 1000):012x}{os.urandom(5).hex()}"


def subject_token(value: str) -> str:
    """An id as one NATS subject token (dots separate tokens, so they become colons)."""
    return value.replace(".", ":")


class Event(BaseModel):
    """Base of every event. Subclasses set TYPE ('job.placed'), VERSION and KEY (the aggregate id field)."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    TYPE: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1
    KEY: ClassVar[str] = ""

    @classmethod
    def ce_type(cls) -> str:
        return f"{CE_PREFIX}{cls.TYPE}.v{cls.VERSION}"

    @property
    def aggregate(self) -> str:
        return self.TYPE.split(".", 1)[0]

    @property
    def aggregate_id(self) -> str:
        return str(getattr(self, self.KEY))

    @property
    def nats_subject(self) -> str:
        return f"{SUBJECT_PREFIX}.{self.aggregate}.{subject_token(self.aggregate_id)}"


REGISTRY: dict[str, type[Event]] = {}
Upcaster = Callable[[dict[str, Any]], tuple[str, dict[str, Any]]]
UPCASTERS: dict[str, Upcaster] = {}


def register(cls: type[Event]) -> type[Event]:
    key = cls.ce_type()
    if key in REGISTRY:
        raise ValueError(f"event type {key} registered twice")
    REGISTRY[key] = cls
    return cls


def upcaster(old_type: str) -> Callable[[Upcaster], Upcaster]:
    """Register ``fn(data) -> (newer_type, newer_data)`` for an old versioned type name."""

    def deco(fn: Upcaster) -> Upcaster:
        UPCASTERS[old_type] = fn
        return fn

    return deco


# --- nodes -----------------------------------------------------------------------


@register
class NodeRegistered(Event):
    TYPE, KEY = "node.registered", "node_id"
    node_id: NodeId
    node: NodeInfo


@register
class NodeCordoned(Event):
    TYPE, KEY = "node.cordoned", "node_id"
    node_id: NodeId
    reason: str = ""


@register
class NodeDrainRequested(Event):
    TYPE, KEY = "node.drain_requested", "node_id"
    node_id: NodeId
    grace_s: int = 300
    reason: str = ""


@register
class NodeDrained(Event):
    TYPE, KEY = "node.drained", "node_id"
    node_id: NodeId


@register
class NodeResumed(Event):
    TYPE, KEY = "node.resumed", "node_id"
    node_id: NodeId


@register
class NodeLost(Event):
    TYPE, KEY = "node.lost", "node_id"
    node_id: NodeId
    reason: str = ""


@register
class GpuUnhealthy(Event):
    TYPE, KEY = "gpu.unhealthy", "node_id"
    node_id: NodeId
    gpu_uuid: GpuUuid
    kind: str  # xid | ecc | thermal | lost
    xid: int | None = None
    detail: str = ""

    @property
    def nats_subject(self) -> str:  # ordered with its node
        return f"{SUBJECT_PREFIX}.node.{subject_token(self.node_id)}"


# --- jobs ------------------------------------------------------------------------


class GpuShare(BaseModel):
    model_config = ConfigDict(frozen=True)
    uuid: GpuUuid
    milli: int = 1000
    mig_profile: str | None = None


class TaskPlacement(BaseModel):
    model_config = ConfigDict(frozen=True)
    task: TaskIndex
    node_id: NodeId
    gpus: tuple[GpuShare, ...] = ()
    cpu_milli: int = 0
    memory_mib: int = 0


@register
class JobSubmitted(Event):
    TYPE, KEY = "job.submitted", "job_id"
    job_id: JobId
    spec: JobSpec
    submitted_at: float | None = None  # original submit time (epoch s), kept across requeues
    owner: str | None = None  # the user who submitted it (None: written before users existed)


@register
class JobRejected(Event):
    TYPE, KEY = "job.rejected", "job_id"
    job_id: JobId
    reason: str


@register
class JobQueued(Event):
    TYPE, KEY = "job.queued", "job_id"
    job_id: JobId


@register
class JobHeld(Event):
    """A waiting job is held (Slurm's ``scontrol hold``, ``sbatch --hold``; Kubernetes' ``suspend: true``): it is not
    placed, and asks nothing of quota, fair share or the autoscaler, until ``job.released`` queues it again."""

    TYPE, KEY = "job.held", "job_id"
    job_id: JobId
    reason: str = ""
    admin: bool = False  # an admin's hold (Slurm's JobHeldAdmin): only an admin releases it


@register
class JobReleased(Event):
    TYPE, KEY = "job.released", "job_id"
    job_id: JobId


@register
class JobUpdated(Event):
    """A change to a job's spec that its owner or an admin asked for (Slurm's ``scontrol update``): its priority
    while it waits, its time limit while it waits or runs. A field left None is unchanged."""

    TYPE, KEY = "job.updated", "job_id"
    job_id: JobId
    priority: Priority | None = None
    time_limit_s: int | None = Field(default=None, gt=0, le=365 * 86400)


@register
class JobPlaced(Event):
    TYPE, KEY = "job.placed", "job_id"
    job_id: JobId
    placements: tuple[TaskPlacement, ...]
    spread: str = "node"  # tightest topology level the gang fits in
    policy: str = ""


@register
class JobUnschedulable(Event):
    TYPE, KEY = "job.unschedulable", "job_id"
    job_id: JobId
    reason: str


@register
class JobTaskStarted(Event):
    TYPE, KEY = "job.task_started", "job_id"
    job_id: JobId
    task: TaskIndex
    node_id: NodeId
    pid: int | None = None
    attempt: int | None = None  # the stream sequence of the job.placed it runs for (None: an agent older than this field)


@register
class JobTaskExited(Event):
    """``interrupted``: the task did not end by itself or by a decision about its job; its node stopped under it
    (a simulated node powering off with `gpuorch up`): the job goes back to the queue, no retry counted."""

    TYPE, KEY = "job.task_exited", "job_id"
    job_id: JobId
    task: TaskIndex
    node_id: NodeId
    code: int | None = None
    signal: int | None = None
    reason: str = ""
    attempt: int | None = None  # the stream sequence of the job.placed it ran for (None: an agent older than this field)
    interrupted: bool = False


@register
class JobSucceeded(Event):
    TYPE, KEY = "job.succeeded", "job_id"
    job_id: JobId


@register
class JobFailed(Event):
    TYPE, KEY = "job.failed", "job_id"
    job_id: JobId
    code: int | None = None
    reason: str = ""


@register
class JobCancelled(Event):
    TYPE, KEY = "job.cancelled", "job_id"
    job_id: JobId
    reason: str = ""


@register
class JobPreempting(Event):
    TYPE, KEY = "job.preempting", "job_id"
    job_id: JobId
    reason: str
    grace_s: int = 30


@register
class JobPreempted(Event):
    TYPE, KEY = "job.preempted", "job_id"
    job_id: JobId


@register
class JobTimedOut(Event):
    TYPE, KEY = "job.timed_out", "job_id"
    job_id: JobId
    grace_s: int = 30


@register
class JobRequeued(Event):
    """A running job lost its node (or its place) and goes back to the queue: its resources are freed, retries + 1
    (``interrupted``: not its fault, no retry counted: its node stopped under it, or was lost before any of its
    tasks started)."""

    TYPE, KEY = "job.requeued", "job_id"
    job_id: JobId
    reason: str = ""
    interrupted: bool = False


# --- queues ----------------------------------------------------------------------


@register
class QueueDefined(Event):
    TYPE, KEY = "queue.defined", "path"
    path: QueuePath
    spec: QueueSpec


@register
class QueueUpdated(Event):
    TYPE, KEY = "queue.updated", "path"
    path: QueuePath
    spec: QueueSpec


@register
class QueueDeleted(Event):
    TYPE, KEY = "queue.deleted", "path"
    path: QueuePath


# --- pools and deployments -------------------------------------------------------


@register
class PoolDefined(Event):
    TYPE, VERSION, KEY = "pool.defined", 2, "pool"
    pool: ResourceName
    profile: str
    min_nodes: int = 0
    max_nodes: int = 0
    provision_delay_s: float = 0
    idle_timeout_s: float = 600
    cost_per_node_hour: float = 0.0
    hourly_cost_cap: float | None = None
    provider: str = "simulated"  # a name: the built-in "simulated" or one in the server's providers file


@upcaster("io.gpuorch.pool.defined.v1")
def _pool_defined_v1(data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """v1 carried the commands to run; they are dropped unread: only an admin's providers file names commands."""
    return PoolDefined.ce_type(), {k: v for k, v in data.items() if k not in ("provision_command", "terminate_command")}


@register
class PoolScaleRequested(Event):
    TYPE, KEY = "pool.scale_requested", "pool"
    pool: ResourceName
    delta: int
    reason: str = ""


@register
class PoolNodeProvisioned(Event):
    TYPE, KEY = "pool.node_provisioned", "pool"
    pool: ResourceName
    node_id: NodeId


@register
class PoolNodeTerminated(Event):
    TYPE, KEY = "pool.node_terminated", "pool"
    pool: ResourceName
    node_id: NodeId


@register
class DeploymentDefined(Event):
    TYPE, KEY = "deployment.defined", "name"
    name: ResourceName
    spec: dict[str, Any] = Field(default_factory=dict)


@register
class DeploymentScaled(Event):
    TYPE, KEY = "deployment.scaled", "name"
    name: ResourceName
    replicas: int


@register
class DeploymentDeleted(Event):
    """The deployment is gone; the autoscaler cancels its replicas (its owner's jobs that name it)."""

    TYPE, KEY = "deployment.deleted", "name"
    name: ResourceName


@register
class PoolDeleted(Event):
    """The pool is gone; it had no node left (the API refuses to delete one that has)."""

    TYPE, KEY = "pool.deleted", "pool"
    pool: ResourceName


# --- access ----------------------------------------------------------------------


@register
class TokenIssued(Event):
    """An API token was issued (the audit trail; the token itself is never in the log)."""

    TYPE, KEY = "token.issued", "token_id"
    token_id: str
    user: str
    groups: tuple[str, ...] = ()
    role: str = "user"
    expires_at: float | None = None


@register
class TokenRevoked(Event):
    TYPE, KEY = "token.revoked", "token_id"
    token_id: str
    user: str = ""


# --- leadership ------------------------------------------------------------------


@register
class LeaderElected(Event):
    """A singleton decider's term began: from here on, decisions from ``source`` count only with this epoch."""

    TYPE, KEY = "leader.elected", "lease"
    lease: ResourceName  # the KV lease: scheduler, health, autoscaler
    source: str = Field(pattern=r"^/gpuorch/[a-z0-9/-]{1,100}$")  # the decision source it vouches for
    epoch: int = Field(ge=1)  # the lease's KV revision at acquisition
    holder: str = Field(max_length=300)


# --- envelope --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Envelope:
    """One event as stored: CloudEvents attributes, the typed data, and the stream position."""

    data: Event
    id: str = field(default_factory=new_id)
    source: str = "/gpuorch"
    time: datetime = field(default_factory=lambda: datetime.now(UTC))
    epoch: int | None = None  # lease epoch of the deciding leader (CloudEvents extension)
    traceparent: str | None = None
    actor: str | None = None  # the person whose request caused it (CloudEvents extension; the audit trail)
    seq: int = 0  # stream sequence; 0 until stored

    @property
    def type(self) -> str:
        return self.data.ce_type()

    @property
    def subject(self) -> str:
        return f"{self.data.aggregate}/{self.data.aggregate_id}"

    @property
    def timestamp(self) -> float:
        return self.time.timestamp()

    def _attributes(self) -> dict[str, Any]:
        ce: dict[str, Any] = {
            "specversion": "1.0",
            "id": self.id,
            "source": self.source,
            "type": self.type,
            "subject": self.subject,
            "time": self.time.isoformat().replace("+00:00", "Z"),
            "datacontenttype": "application/json",
        }
        if self.epoch is not None:
            ce["gpuorchepoch"] = self.epoch
        if self.traceparent:
            ce["traceparent"] = self.traceparent
        if self.actor:
            ce["gpuorchactor"] = self.actor
        return ce

    def to_cloudevent(self) -> dict[str, Any]:
        return {**self._attributes(), "data": self.data.model_dump(mode="json")}

    def encode(self) -> bytes:
        """The structured-mode body: the attributes, then the data serialized by pydantic (the append hot path)."""
        return to_json(self._attributes())[:-1] + b',"data":' + to_json(self.data) + b"}"

    def headers(self) -> dict[str, str]:
        h = {
            "Nats-Msg-Id": self.id,
            "Content-Type": CONTENT_TYPE,
            "ce-type": self.type,
            "ce-subject": self.subject,
        }
        if self.traceparent:
            h["traceparent"] = self.traceparent
        return h


STORED = {"stored": True}  # validation context of a logged event: rules for new data only (model.JobSpec) let it be


def decode(body: bytes, seq: int = 0) -> Envelope:
    """Parse a stored CloudEvent. Raises UnknownEventType or MalformedEvent; never anything else."""
    try:
        ce = from_json(body)
        if not isinstance(ce, dict) or ce.get("specversion") != "1.0":
            raise MalformedEvent("not a CloudEvents 1.0 JSON object")
        ce_type, data = ce["type"], ce.get("data") or {}
        ce_time = datetime.fromisoformat(ce["time"])
    except (ValueError, KeyError, TypeError) as e:
        raise MalformedEvent(f"unreadable envelope: {e}") from None
    while ce_type in UPCASTERS:
        ce_type, data = UPCASTERS[ce_type](data)
    cls = REGISTRY.get(ce_type)
    if cls is None:
        raise UnknownEventType(ce_type)
    try:
        event = cls.model_validate(data, context=STORED)
    except ValidationError as e:
        raise MalformedEvent(f"{ce_type}: {e.errors()[0].get('msg')} at {e.errors()[0].get('loc')}") from None
    epoch, actor = ce.get("gpuorchepoch"), ce.get("gpuorchactor")
    return Envelope(
        data=event,
        id=str(ce.get("id", "")),
        source=str(ce.get("source", "")),
        time=ce_time,
        epoch=epoch if isinstance(epoch, int) else None,
        traceparent=ce.get("traceparent"),
        actor=actor if isinstance(actor, str) else None,
        seq=seq,
    )


def export_schemas(directory: Path) -> list[Path]:
    """Write one JSON Schema per event type (the CloudEvent with its typed data)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for ce_type, cls in sorted(REGISTRY.items()):
        schema = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"https://gpuorch.io/schemas/{ce_type}.json",
            "title": ce_type,
            "type": "object",
            "required": ["specversion", "id", "source", "type", "time", "data"],
            "properties": {
                "specversion": {"const": "1.0"},
                "id": {"type": "string"},
                "source": {"type": "string"},
                "type": {"const": ce_type},
                "subject": {"type": "string"},
                "time": {"type": "string", "format": "date-time"},
                "datacontenttype": {"const": "application/json"},
                "gpuorchepoch": {"type": "integer"},
                "gpuorchactor": {"type": "string"},
                "data": cls.model_json_schema(),
            },
        }
        path = directory / f"{ce_type}.json"
        path.write_text(json.dumps(schema, indent=2, sort_keys=True))
        written.append(path)
    return written
