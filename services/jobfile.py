"""Job files: YAML or JSON as the API takes it, or an sbatch script with #SBATCH directives."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml


class JobFileError(ValueError):
    pass


def load_job_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise JobFileError(f"cannot read {path}: {e.strerror}") from None
    if text.startswith("#!") or "#SBATCH" in text:
        return from_sbatch(text, path.name)
    try:
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise JobFileError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from None
    if not isinstance(doc, dict):
        raise JobFileError(f"{path} must hold one job object (a mapping), not {type(doc).__name__}")
    return doc


def slurm_time(value: str) -> int:
    """Slurm --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS -> seconds."""
    if "-" in value:
        days, rest = value.split("-", 1)
        parts = [int(p) for p in rest.split(":")] + [0, 0]
        return int(days) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
    parts = [int(p) for p in value.split(":")]
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return parts[0] * 3600 + parts[1] * 60 + parts[2]


def _mem_mib(value: str) -> int:
    m = re.fullmatch(r"(\d+)([KMGT]?)B?", value.upper())
    if not m:
        raise JobFileError(f"#SBATCH --mem={value}: expected a size like 64G")
    return int(m.group(1)) * {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[m.group(2)]


def from_sbatch(text: str, filename: str) -> dict[str, Any]:
    """Translate the #SBATCH directives we understand; refuse the ones we would silently get wrong."""
    job: dict[str, Any] = {"name": re.sub(r"[^A-Za-z0-9_.\-]", "-", filename)[:63] or "sbatch",
                           "resources": {}, "command": ["bash", "-c", text]}
    nodes = tasks_per_node = ntasks = None
    for line in text.splitlines():
        if not line.startswith("#SBATCH"):
            continue
        for opt in line[len("#SBATCH"):].split():
            key, _, value = opt.lstrip("-").partition("=")
            try:
                if key in ("J", "job-name"):
                    job["name"] = value
                elif key in ("p", "partition"):
                    job["queue"] = value
                elif key in ("t", "time"):
                    job["time_limit_s"] = slurm_time(value)
                elif key in ("N", "nodes"):
                    nodes = int(value)
                elif key in ("n", "ntasks"):
                    ntasks = int(value)
                elif key == "ntasks-per-node":
                    tasks_per_node = int(value)
                elif key in ("gpus-per-task", "gpus-per-node"):
                    job["resources"]["gpus"] = int(value.split(":")[-1])
                elif key == "gres":
                    job["resources"]["gpus"] = int(value.split(":")[-1])
                elif key == "cpus-per-task":
                    job["resources"]["cpu_milli"] = int(value) * 1000
                elif key == "mem":
                    job["resources"]["memory_mib"] = int(_mem_mib(value))
                elif key in ("o", "output", "e", "error", "mail-type", "mail-user", "account", "A", "exclusive"):
                    pass
                else:
                    raise JobFileError(f"#SBATCH --{key} is not supported by gpuorch")
            except ValueError as e:
                if isinstance(e, JobFileError):
                    raise
                raise JobFileError(f"#SBATCH --{key}={value}: {e}") from None
    if ntasks or nodes:
        job["tasks"] = ntasks or nodes * (tasks_per_node or 1)
    return job
