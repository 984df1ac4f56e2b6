"""What a scheduling cycle is told (Policy) and what it decides (Plan): plain data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.scheduler.fragmentation import TypicalShape
from services.scheduler.placement import POLICIES

if TYPE_CHECKING:
    from services.scheduler.snapshot import RunningJob
from shared.events import TaskPlacement
from shared.model import PRIORITY_RANK


@dataclass(frozen=True)
class Policy:
    """How a cycle decides. ``name`` picks the node scorer (see placement.POLICIES)."""

    name: str = "fgd"
    seed: int = 0
    typical: tuple[TypicalShape, ...] | None = None  # FGD's target workload; None: from the snapshot's jobs
    backfill: bool = True  # False: no reservation, any job that fits starts
    preempt: bool = True
    cross_queue_preemption: bool = False
    preemptible_below: int = PRIORITY_RANK["normal"]  # only ranks below this are ever evicted for priority
    grace_s: int = 30
    max_preemptors: int = 16  # victim searches per cycle; the rest wait for the next cycle
    reclaim_grace_s: int = 300
    min_runtime_s: Mapping[str, int] = field(default_factory=dict)  # per queue: never evict a younger job
    queue_priority: Mapping[str, int] = field(default_factory=dict)  # reclaim takes from low-priority queues first
    max_preemptions_per_hour: int = 3  # thrashing guard: a job evicted this often in the last hour stays

    def protected(self, job: "RunningJob", now: float) -> bool:
        """A victim that must be left alone: too young for its queue, or evicted too often lately."""
        began = job.started_at if job.started_at is not None else job.placed_at
        if now - began < self.min_runtime_s.get(job.queue, 0):
            return True
        return sum(1 for t in job.preemptions if now - t < 3600) >= self.max_preemptions_per_hour

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown policy {self.name!r}; choose one of {', '.join(POLICIES)}")


@dataclass(frozen=True)
class Placement:
    job_id: str
    tasks: tuple[TaskPlacement, ...]
    spread: str  # tightest level the gang reached: nvlink | node | rack | zone | any
    policy: str


@dataclass(frozen=True)
class Preemption:
    job_id: str
    reason: str
    grace_s: int = 30
    for_job: str = ""  # the preemptor; empty for a reclaim
    for_queue: str = ""


@dataclass(frozen=True)
class Reservation:
    job_id: str
    start: float  # when enough should be free (inf: waits on jobs without a time limit)
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class ReclaimRequest:
    queue: str
    gpus: float


@dataclass(frozen=True)
class Plan:
    policy: str
    placements: Mapping[str, Placement] = field(default_factory=dict)
    preemptions: tuple[Preemption, ...] = ()
    unschedulable: Mapping[str, str] = field(default_factory=dict)
    reservation: Reservation | None = None
    cancellations: Mapping[str, str] = field(default_factory=dict)  # job -> the dependency that can never be met
