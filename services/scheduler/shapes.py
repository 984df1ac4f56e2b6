"""What one task of a job needs, in the integer units the placement code works in."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from services.scheduler.placement import PodShape
from shared.model import MILLI, JobSpec


def parse_cc(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    major, _, minor = text.partition(".")
    try:
        return int(major), int(minor or 0)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class TaskShape:
    """What one task of a job needs, and where it may go."""

    gpus: int = 0  # GPUs per task (one MIG slice counts as one)
    milli: int = 0  # milli per GPU: 1000 whole, below 1000 shared, 0 for MIG or CPU-only
    mig: str | None = None
    cpu: int = 0
    mem: int = 0
    models: tuple[str, ...] = ()
    min_memory_mib: int = 0
    min_cc: tuple[int, int] | None = None
    selector: tuple[tuple[str, str], ...] = ()
    one_domain: bool = False  # topology nvlink: each task's GPUs inside one NVLink domain
    per_node: int = 0  # exactly this many tasks on each node used (JobSpec.tasks_per_node); 0: as many as fit

    @classmethod
    def of(cls, spec: JobSpec) -> "TaskShape":
        """The shape of one task of ``spec``: made once per spec (a JobSpec is frozen), since every cycle asks it
        of every waiting job (a quarter of a cycle's time over 10,000 of them)."""
        key = id(spec)
        found = _SHAPES.get(key)
        if found is not None and found[0]() is spec:
            return found[1]
        shape = cls._of(spec)
        # held weakly: the entry goes with its spec (before its id can be reused)
        _SHAPES[key] = (weakref.ref(spec, lambda _, key=key: _SHAPES.pop(key, None)), shape)
        return shape

    @classmethod
    def _of(cls, spec: JobSpec) -> "TaskShape":
        r, g = spec.resources, spec.gpu
        if g.mig:
            gpus, milli = 1, 0
        elif r.gpu_milli >= MILLI:
            gpus, milli = r.gpu_milli // MILLI, MILLI
        elif r.gpu_milli > 0:
            gpus, milli = 1, r.gpu_milli
        else:
            gpus, milli = 0, 0
        return cls(
            gpus=gpus,
            milli=milli,
            mig=g.mig,
            cpu=r.cpu_milli,
            mem=r.memory_mib,
            models=tuple(g.models),
            min_memory_mib=g.min_memory_mib,
            min_cc=parse_cc(g.min_compute_capability),
            selector=tuple(sorted(spec.node_selector.items())),
            one_domain=spec.topology == "nvlink",
            per_node=spec.tasks_per_node or 0,
        )

    @property
    def gpu_milli(self) -> int:
        return MILLI if self.mig else self.gpus * self.milli

    @property
    def pod(self) -> PodShape:
        """The shape the scorers see; a MIG task leaves whole-GPU state alone, so it scores as CPU-only."""
        if self.mig:
            return PodShape(self.cpu, self.mem)
        return PodShape(self.cpu, self.mem, self.gpus, self.milli)


class ShapeBook:
    """Task shapes by small integer id, shared by the working states of one cycle."""

    def __init__(self) -> None:
        self._ids: dict[TaskShape, int] = {}
        self.shapes: list[TaskShape] = []
        self.pods: list[PodShape] = []

    def id(self, shape: TaskShape) -> int:
        sid = self._ids.get(shape)
        if sid is None:
            sid = self._ids[shape] = len(self.shapes)
            self.shapes.append(shape)
            self.pods.append(shape.pod)
        return sid


_SHAPES: dict[int, tuple[weakref.ref[JobSpec], TaskShape]] = {}  # id(spec) -> (the spec, its task shape)
