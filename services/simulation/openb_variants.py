"""Heavier multi-GPU openb workloads, derived in code from a shared pod list (not stored as data).

``multigpu20`` is ``default`` plus clones of its 2-, 4- and 8-GPU pods until those
hold 20 % of the requested GPUs. ``multigpu40`` and ``multigpu60`` continue the same
recipe from ``multigpu20``: clones of its multi-GPU pods, drawn with a fixed seed,
until multi-GPU pods hold 40 % (60 %) of the requested GPUs.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import replace

from services.simulation.traces import OpenbPod, TraceError

BASE = "multigpu20"
SEED = 2023
_NAME = re.compile(r"multigpu(\d+)")


def multigpu_share(pods: Sequence[OpenbPod]) -> float:
    """The share of the requested GPU milli that multi-GPU pods ask for."""
    total = sum(p.gpu_milli for p in pods)
    return sum(p.gpu_milli for p in pods if p.count > 1) / total if total else 0.0


def with_multigpu_share(pods: Sequence[OpenbPod], share: float, seed: int = SEED) -> list[OpenbPod]:
    """``pods`` plus clones of its multi-GPU pods, drawn with replacement, until they hold ``share`` of the GPUs.

    Clones are named on from the last pod (``openb-pod-NNNN``), keep CPU, memory, k,
    m and GPU models, and drop the trace's timestamps (as the shared multigpu files do).
    """
    if not 0 < share < 1:
        raise TraceError(f"multi-GPU share {share} must be between 0 and 1")
    pool = sorted((p for p in pods if p.count > 1), key=lambda p: p.name)
    if not pool:
        raise TraceError("no multi-GPU pod to resample")
    rng = random.Random(seed)
    out = list(pods)
    total = sum(p.gpu_milli for p in pods)
    multi = total * multigpu_share(pods)
    while multi < share * total:
        p = pool[rng.randrange(len(pool))]
        out.append(replace(p, name=f"openb-pod-{len(out):04d}", created=None, deleted=None))
        multi += p.gpu_milli
        total += p.gpu_milli
    return out


def derived_share(workload: str) -> float | None:
    """``multigpuNN`` -> NN / 100 for a workload derived here; None for any other name."""
    m = _NAME.fullmatch(workload)
    return int(m.group(1)) / 100 if m else None
