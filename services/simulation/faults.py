"""Faults to inject into a replay: a list an operator writes, or a rate drawn as a Poisson process.

A list (YAML or JSON) names each fault: when (``t``, seconds from the start of the
replay), where (``node``; ``gpu``, an index on that node) and what: ``xid`` (an
XID the driver reports, judged by the health rules' table: an application XID
marks nothing) or ``lost: true`` (the node stops heartbeating: its tasks die with
it, and the health rules call it lost after the heartbeat timeout). ``repair_s``:
seconds until the node is back (a lost node re-registers; a faulted one is resumed
by an operator); absent, it stays out.

A rate ``R[:H]`` draws faults at R per 1,000 GPU-days on the GPUs present (pool
nodes too, while they exist), each repaired after H hours (default 4; 0: never), until
the trace would have ended without faults (the last submission's end): jobs restart
from scratch, and a job longer than the time between faults on its GPUs would
otherwise never end.
Meta's Llama 3 training run saw about 0.47 unexpected interruptions per 1,000
GPU-days (419 in 54 days on 16,384 H100s, Dubey et al. 2024), 58.7 % of them GPU
issues. What each fault is, is drawn from ``MIX``, our approximation of that
breakdown: GPUs failing or falling off the bus, memory (HBM) errors, NVLink, and
the rest (network, host) as a node lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.simulation.traces import TraceError, yaml_list

DEFAULT_REPAIR_H = 4.0
MIX: tuple[tuple[float, int | None], ...] = (  # (share, XID; None: the node is lost)
    (0.35, 79),  # GPU has fallen off the bus / faulty GPU
    (0.20, 95),  # uncontained ECC error (HBM)
    (0.10, 48),  # double-bit ECC error (HBM)
    (0.10, 74),  # NVLink error
    (0.25, None),  # network, host: the node stops heartbeating
)


class FaultEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    t: float = Field(ge=0)
    node: str = Field(min_length=1)
    gpu: int = Field(default=0, ge=0)
    xid: int | None = Field(default=None, ge=1)
    lost: bool = False
    repair_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_kind(self) -> FaultEntry:
        if (self.xid is None) == (not self.lost):
            raise ValueError("a fault is either xid: N or lost: true")
        return self


@dataclass(frozen=True)
class FaultRate:
    per_1000_gpu_days: float
    repair_s: float | None = DEFAULT_REPAIR_H * 3600
    seed: int = 0

    def per_gpu_second(self) -> float:
        return self.per_1000_gpu_days / 1000 / 86400

    @staticmethod
    def kind(u: float) -> int | None:
        """The XID (None: node lost) at the point ``u`` in [0, 1) of the mix."""
        for share, xid in MIX:
            if u < share:
                return xid
            u -= share
        return MIX[-1][1]


Faults = FaultRate | list[FaultEntry]


def parse_faults(text: str, seed: int = 0) -> Faults:
    """``--faults``: a file of faults, or ``RATE[:REPAIR_H]``."""
    head, _, tail = text.partition(":")
    try:
        rate = float(head)
    except ValueError:
        return load_faults(Path(text).expanduser())
    try:
        repair_h = float(tail) if tail else DEFAULT_REPAIR_H
    except ValueError:
        raise TraceError(f"--faults RATE[:REPAIR_H] takes numbers, got {text!r}") from None
    if rate < 0 or repair_h < 0:
        raise TraceError(f"--faults RATE[:REPAIR_H] takes numbers >= 0, got {text!r}")
    return FaultRate(rate, repair_h * 3600 or None, seed)


def load_faults(path: Path) -> list[FaultEntry]:
    out = []
    for i, item in enumerate(yaml_list(path, "faults")):
        try:
            out.append(FaultEntry.model_validate(item))
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'fault'}: {x['msg']}" for x in e.errors())
            raise TraceError(f"{path}: fault {i + 1}: {problems}") from None
    return sorted(out, key=lambda f: f.t)
