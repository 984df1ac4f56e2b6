"""What every job-file reader shares: results, the site map, names of queues and priorities, quantities."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from shared.model import QUEUE_PATH

Priority = Literal["critical", "high", "normal", "low"]


class JobFileError(ValueError):
    """A file gpuorch will not run as written: the message names the directive or field, why, and what to write."""


class NotSupportedYet(JobFileError):
    """Something gpuorch will support later (job arrays, dependencies)."""


# --- the site map: how this site's names map here ----------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Partition(_Strict):
    """What a Slurm partition means here: a queue, GPU models, or both."""

    queue: str | None = None
    models: tuple[str, ...] = ()


class SiteMap(_Strict):
    """GPUORCH_JOBFILE_MAP (YAML): Slurm partitions and QOS, Kubernetes priority classes, as this site names them.

        partitions: {gpu-h100: {models: [H100-80GB]}, nlp: {queue: research.nlp}}
        qos: {scavenger: low, urgent: high}
        priority_classes: {train: normal}
    """

    partitions: dict[str, Partition] = {}
    qos: dict[str, Priority] = {}
    priority_classes: dict[str, Priority] = {}


def load_site_map(path: Path | None) -> SiteMap:
    if path is None:
        return SiteMap()
    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
        return SiteMap.model_validate(doc)
    except OSError as e:
        raise JobFileError(f"cannot read the job-file map {path}: {e.strerror}") from None
    except (yaml.YAMLError, ValidationError) as e:
        raise JobFileError(f"the job-file map {path} is not valid: {e}") from None


@dataclass(frozen=True)
class Context:
    """What the reader knows about this cluster: the site map, the queues and GPU models there (None: unknown),
    and the submitting environment (sbatch's --export=NAME reads it)."""

    site: SiteMap = SiteMap()
    queues: tuple[str, ...] | None = None
    models: tuple[str, ...] = ()
    environ: Mapping[str, str] = field(default_factory=dict)


# --- results -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Translated:
    """One job as POST /v1/jobs takes it, with what the translation could not carry over."""

    job: dict[str, Any]
    warnings: tuple[str, ...] = ()
    origin: str = ""  # "sbatch script train.sh", "batch/v1 Job llama-ft"
    logs: dict[str, str] = field(default_factory=dict)  # sbatch --output/--error as written (recorded, not written)


@dataclass(frozen=True)
class QueueDef:
    """One queue as PUT /v1/queues/{path} takes it."""

    path: str
    spec: dict[str, Any]
    origin: str = ""
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Loaded:
    jobs: tuple[Translated, ...] = ()
    queues: tuple[QueueDef, ...] = ()
    notes: tuple[str, ...] = ()  # documents skipped, and why


# --- names ---------------------------------------------------------------------------------

_PATH = re.compile(QUEUE_PATH)


def job_name(raw: str, fallback: str = "job") -> tuple[str, str | None]:
    """A job name gpuorch accepts (letters, digits, '.', '_', '-', 63 at most), and a note if it had to change."""
    name = re.sub(r"[^A-Za-z0-9_.\-]+", "-", raw.strip()).lstrip("-._")[:63].rstrip("-") or fallback
    return name, (None if name == raw else f"job name {raw!r} is {name!r} here (letters, digits, '.', '_', '-')")


def queue_path(raw: str, ctx: Context, what: str) -> tuple[str, str | None]:
    """A queue named in a file -> a queue path here, and a note when it had to change.

    Lower case; a name that is a leaf of exactly one known queue path ("nlp" -> "research.nlp") is that path.
    """
    name = raw.strip().lower()
    if not _PATH.match(name):
        raise JobFileError(f"{what}: {raw!r} cannot name a queue here (lowercase letters, digits, '_' and '-', "
                           "dotted for a path, e.g. research.nlp): write the queue's path")
    note = None if name == raw else f"{what}: queue {name!r}"
    if ctx.queues is None or name in ctx.queues:
        return name, note
    matches = sorted(q for q in ctx.queues if q.endswith("." + name))
    if len(matches) == 1:
        return matches[0], f"{what}: queue {raw!r} is {matches[0]} here"
    if len(matches) > 1:
        raise JobFileError(f"{what}: queue {raw!r} could be any of {', '.join(matches)}: write the full path")
    return name, note


_PRIORITY_WORDS: dict[str, Priority] = {
    **dict.fromkeys(("critical", "emergency"), "critical"),
    **dict.fromkeys(("high", "higher", "urgent", "premium", "express", "inference", "build", "prod", "production"),
                    "high"),
    **dict.fromkeys(("normal", "default", "standard", "medium", "regular"), "normal"),
    **dict.fromkeys(("low", "lower", "lowprio", "scavenger", "scavenge", "preempt", "preemptible", "preemptable",
                     "standby", "spot", "besteffort", "opportunistic", "free", "backfill", "train"), "low"),
}


def priority_of(name: str, table: Mapping[str, str], what: str) -> tuple[Priority, str | None]:
    """A QOS or priority class name -> a gpuorch priority: the site map's, else by the words in it ("gpu_high"
    is high; KAI's train / build / inference are low / high / high), else normal with a note."""
    if name in table:
        return table[name], None  # type: ignore[return-value]
    words = [_PRIORITY_WORDS[w] for w in re.split(r"[^a-z]+", name.lower()) if w in _PRIORITY_WORDS]
    if len(set(words)) == 1:
        return words[0], f"{what} {name!r} is priority {words[0]} here"
    return "normal", (f"{what} {name!r} means nothing here: priority normal (a site maps its names in "
                      "GPUORCH_JOBFILE_MAP)")


# --- quantities ----------------------------------------------------------------------------

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "m": 10**-3}


def k8s_quantity(value: Any, what: str) -> float:
    """A Kubernetes quantity ("500m", "16Gi", "1e9", 2) as a plain number."""
    if isinstance(value, bool):
        raise JobFileError(f"{what}: {value!r} is no quantity")
    if isinstance(value, (int, float)):
        return float(value)
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?\s*", str(value))
    if not m:
        raise JobFileError(f"{what}: {value!r} is no Kubernetes quantity (e.g. 500m, 4, 16Gi)")
    unit = m.group(2) or ""
    return float(m.group(1)) * (_BINARY.get(unit) or _DECIMAL[unit])


def k8s_cpu_milli(value: Any, what: str) -> int:
    return math.ceil(round(k8s_quantity(value, what) * 1000, 6))


def k8s_memory_mib(value: Any, what: str) -> int:
    return math.ceil(round(k8s_quantity(value, what) / 2**20, 6))


def whole_gpus(value: float, what: str) -> float:
    """GPUs as JobSpec takes them: whole, or a fraction below 1 in thousandths."""
    if value >= 1 and value != int(value):
        raise JobFileError(f"{what}: {value:g} GPUs; write a whole number, or a fraction below 1")
    return int(value) if value == int(value) else round(value, 3)


class Notes(list):
    """Warnings in the order found, each once."""

    def add(self, message: str | None) -> None:
        if message and message not in self:
            self.append(message)
