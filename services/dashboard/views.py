"""What the dashboard's pages show, from the API's answers: plain data for the templates, no I/O."""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

GPU_STATES = ("free", "job", "shared", "mig", "unhealthy", "cordoned", "lost")
FINISHED = ("succeeded", "failed", "cancelled", "rejected")


@dataclass(frozen=True, slots=True)
class Tile:
    """One GPU as a tile: its state (a CSS class), a fill fraction (shared GPUs, MIG slices) and its hover text."""

    index: int
    state: str
    fill: float
    title: str
    job: str = ""


@dataclass(frozen=True, slots=True)
class Domain:
    name: str
    tiles: tuple[Tile, ...]


@dataclass(slots=True)
class NodeRow:
    id: str
    state: str
    model: str
    rack: str
    zone: str
    health: str
    domains: list[Domain]
    util: float | None = None
    temp: float | None = None
    counts: dict[str, int] = field(default_factory=dict)


def gpu_jobs(jobs: list[dict[str, Any]]) -> dict[str, list[tuple[dict[str, Any], int]]]:
    """GPU (or MIG slice) uuid -> the visible jobs placed on it, with the share each holds (milli-GPU)."""
    out: dict[str, list[tuple[dict[str, Any], int]]] = {}
    for job in jobs:
        for p in job.get("placement") or ():
            for uuid, share in zip(p["gpus"], p.get("shares") or [1000] * len(p["gpus"])):
                out.setdefault(uuid, []).append((job, share))
    return out


def _who(held: list[tuple[dict[str, Any], int]]) -> str:
    return "; ".join(f"job {j['id']} ({j['name']}, queue {j['queue']}{', ' + str(s / 10) + '%' if s < 1000 else ''})"
                     for j, s in held)


def tile(node: dict[str, Any], gpu: dict[str, Any], held: dict[str, list[tuple[dict[str, Any], int]]]) -> Tile:
    alloc = int(gpu.get("allocated_milli") or 0)
    here = list(held.get(gpu["uuid"], ()))
    slices = gpu.get("mig_slices") or ()
    used_slices = [s for s in slices if s["uuid"] in held]
    for s in used_slices:
        here += held[s["uuid"]]
    head = f"GPU {gpu['index']} · {gpu['model']} · {node['id']}"
    job = here[0][0]["id"] if here else ""
    if gpu.get("health") == "unhealthy":
        return Tile(gpu["index"], "unhealthy", 1.0, f"{head}\nUNHEALTHY: {gpu.get('health_reason') or 'unhealthy'}"
                    + (f"\n{_who(here)}" if here else ""), job)
    if node["state"] == "lost":
        return Tile(gpu["index"], "lost", 1.0, f"{head}\nnode lost", job)
    if slices:
        fill = len(used_slices) / len(slices)
        names = ", ".join(s["profile"] for s in slices)
        return Tile(gpu["index"], "mig", fill, f"{head}\nMIG: {len(used_slices)}/{len(slices)} slices used ({names})"
                    + (f"\n{_who(here)}" if here else ""), job)
    fenced = node["state"] in ("cordoned", "draining")
    if alloc >= 1000:
        state, fill, what = "job", 1.0, _who(here) or "in use (a job you may not see)"
    elif alloc > 0:
        state, fill = "shared", alloc / 1000
        what = f"shared: {alloc / 10:g}% taken" + (f"\n{_who(here)}" if here else "")
    else:
        state, fill, what = "free", 0.0, "free"
    if fenced:
        what += f"\nnode {node['state']}"
        state = "cordoned" if state == "free" else state
    return Tile(gpu["index"], state, fill, f"{head}\n{what}", job)


def node_rows(nodes: list[dict[str, Any]], jobs: list[dict[str, Any]],
              telemetry: dict[str, dict[str, Any]]) -> list[NodeRow]:
    """One row per node, its GPU tiles grouped by NVLink domain (PCIe GPUs: one group of their own)."""
    held = gpu_jobs(jobs)
    rows = []
    for n in sorted(nodes, key=lambda n: (n.get("zone") or "", n.get("rack") or "", n["id"])):
        by_domain: dict[str, list[Tile]] = {}
        for g in sorted(n["gpus"], key=lambda g: g["index"]):
            by_domain.setdefault(g.get("nvlink_domain") or "PCIe", []).append(tile(n, g, held))
        domains = [Domain(name, tuple(ts)) for name, ts in by_domain.items()]
        counts: dict[str, int] = {}
        for d in domains:
            for t in d.tiles:
                counts[t.state] = counts.get(t.state, 0) + 1
        sick = [g for g in n["gpus"] if g.get("health") == "unhealthy"]
        models = sorted({g["model"] for g in n["gpus"]})
        sample = telemetry.get(n["id"]) or {}
        rows.append(NodeRow(n["id"], n["state"], "/".join(models) or "no GPU", n.get("rack") or "", n.get("zone") or "",
                            health(sick), domains,
                            sample.get("util"), sample.get("temp"), counts))
    return rows


def health(sick: list[dict[str, Any]]) -> str:
    """'ok', or what is wrong in a word: 'GPU 3 xid 79', '2 GPUs sick'."""
    if not sick:
        return "ok"
    if len(sick) == 1:
        return (sick[0].get("health_reason") or "sick").split(":", 1)[0]
    return f"{len(sick)} GPUs sick"


def short_model(model: str) -> str:
    """A100-SXM4-40GB -> A100-40GB: the form factor is in the tooltip, the column stays narrow."""
    return re.sub(r"-(SXM\d?|PCIE|PCIe|NVL)(?=-|$)", "", model)


@dataclass(frozen=True, slots=True)
class SickGpu:
    node: str
    index: int
    model: str
    reason: str


def sick_gpus(nodes: list[dict[str, Any]]) -> list[SickGpu]:
    return [SickGpu(n["id"], g["index"], g["model"], g.get("health_reason") or "unhealthy")
            for n in sorted(nodes, key=lambda n: n["id"]) for g in n["gpus"] if g.get("health") == "unhealthy"]


def node_states(rows: list["NodeRow"]) -> dict[str, int]:
    out = {"cordoned": 0, "draining": 0, "lost": 0}
    for r in rows:
        if r.state in out:
            out[r.state] += 1
    return out


def row_matches(row: NodeRow, model: str, rack: str, state: str) -> bool:
    if model and model not in row.model.split("/"):
        return False
    if rack and row.rack != rack:
        return False
    if state:
        if state in ("cordoned", "draining", "lost", "idle", "allocated"):
            return row.state == state or (state == "cordoned" and row.counts.get("cordoned", 0) > 0)
        return row.counts.get(state, 0) > 0
    return True


def summary(rows: list[NodeRow]) -> dict[str, int]:
    out = {s: 0 for s in GPU_STATES}
    for r in rows:
        for s, c in r.counts.items():
            out[s] = out.get(s, 0) + c
    return out


def telemetry_of(sample: dict[str, Any]) -> dict[str, float | None]:
    """A node's telemetry sample -> mean GPU utilization (%) and hottest GPU (°C)."""
    utils = [g["gpu_util_pct"] for g in sample.get("gpus") or () if g.get("gpu_util_pct") is not None]
    temps = [g["temperature_c"] for g in sample.get("gpus") or () if g.get("temperature_c") is not None]
    return {"util": round(sum(utils) / len(utils)) if utils else None, "temp": max(temps) if temps else None,
            "t": sample.get("t")}


# --- queues ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QueueRow:
    path: str
    depth: int
    name: str
    guaranteed: float
    limit: float | None
    entitled: float
    allocated: float
    borrowed: float
    pending: float
    weight: float
    leaf: bool


def queue_rows(queues: list[dict[str, Any]]) -> tuple[list[QueueRow], float]:
    """The tree in depth-first order, and the scale of its bars (the largest figure shown)."""
    rows = []
    for q in sorted(queues, key=lambda q: q["path"].split(".")):
        guaranteed = float((q.get("guaranteed") or {}).get("gpus") or 0)
        limit = (q.get("limit") or {}).get("gpus") if q.get("limit") else None
        allocated = float(q["allocated"]["gpus"])
        rows.append(QueueRow(q["path"], q["path"].count("."), q["path"].rsplit(".", 1)[-1], guaranteed,
                             float(limit) if limit is not None else None, float(q["entitlement"]["gpus"]), allocated,
                             max(0.0, allocated - guaranteed), float(q["pending"]["gpus"]), float(q.get("weight") or 1),
                             bool(q.get("leaf"))))
    scale = max([1.0] + [max(r.guaranteed, r.entitled, r.allocated + r.pending, r.limit or 0) for r in rows])
    return rows, scale


PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777", "#4b5563",
           "#65a30d")


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    colour: str
    points: str  # SVG polyline points
    last: float


@dataclass(frozen=True, slots=True)
class Plot:
    width: int
    height: int
    series: tuple[Series, ...]
    y_max: float
    y_ticks: tuple[tuple[float, float], ...]  # (value, y)
    x_ticks: tuple[tuple[str, float], ...]  # (label, x)


def usage_plot(edges: list[float], buckets: list[dict[str, float]], width: int = 900, height: int = 240,
               leaves: set[str] | None = None) -> Plot:
    """GPUs held on average per queue in each bucket [edges[i], edges[i+1]): an SVG line per queue."""
    pad_l, pad_b, pad_t = 44, 22, 8
    names = sorted({q for b in buckets for q in b if leaves is None or q in leaves})
    spans = [edges[i + 1] - edges[i] for i in range(len(buckets))]
    avg = {q: [b.get(q, 0.0) / s if s > 0 else 0.0 for b, s in zip(buckets, spans)] for q in names}
    top = max([1.0] + [v for vs in avg.values() for v in vs])
    step = 10 ** math.floor(math.log10(top))
    y_max = math.ceil(top / step) * step
    inner_w, inner_h = width - pad_l - 8, height - pad_b - pad_t

    def x(i: int) -> float:
        return pad_l + inner_w * (i + 0.5) / max(1, len(buckets))

    def y(v: float) -> float:
        return pad_t + inner_h * (1 - v / y_max)

    series = tuple(Series(q, PALETTE[i % len(PALETTE)], " ".join(f"{x(k):.1f},{y(v):.1f}" for k, v in enumerate(avg[q])),
                          avg[q][-1] if avg[q] else 0.0) for i, q in enumerate(names))
    y_ticks = tuple((y_max * f, y(y_max * f)) for f in (0, 0.25, 0.5, 0.75, 1))
    n = len(buckets)
    x_ticks = tuple((time.strftime("%H:%M", time.localtime(edges[k])), x(k)) for k in range(0, n, max(1, n // 6)))
    return Plot(width, height, series, y_max, y_ticks, x_ticks)


# --- jobs -------------------------------------------------------------------------------

JOB_SORTS = {
    "age": lambda j: -(j.get("submitted_at") or 0),
    "state": lambda j: j["state"],
    "queue": lambda j: j["queue"],
    "user": lambda j: j.get("owner") or "",
    "gpus": lambda j: -j["gpus"],
    "nodes": lambda j: -len(j["nodes"]),
    "name": lambda j: j["name"],
}


def job_row(job: dict[str, Any], now: float) -> dict[str, Any]:
    nodes = sorted({p["node"] for p in job.get("placement") or ()})
    return {**job, "gpus": round(job["tasks"] * float(job["gpus_per_task"]), 3), "nodes": nodes,
            "age": age(now - (job.get("submitted_at") or now))}


def age(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d"


def sort_jobs(rows: list[dict[str, Any]], key: str, desc: bool) -> list[dict[str, Any]]:
    return sorted(rows, key=JOB_SORTS.get(key, JOB_SORTS["age"]), reverse=desc)


def event_summary(e: dict[str, Any]) -> str:
    """One line about a CloudEvent as the API shows it: its data's notable fields."""
    data = e.get("data") or {}
    parts = []
    for k in ("reason", "detail", "kind", "xid", "code", "grace_s", "node_id", "policy"):
        if data.get(k) not in (None, ""):
            parts.append(f"{k}={data[k]}")
    if "placements" in data:
        parts.append("placed " + ", ".join(f"task {p['task']} → {p['node_id']} ({len(p['gpus'])} GPU)"
                                           for p in data["placements"][:8]))
    if e.get("gpuorchactor"):
        parts.append(f"by {e['gpuorchactor']}")
    return " · ".join(parts)


def short_type(t: str) -> str:
    """io.gpuorch.job.placed.v1 -> job.placed"""
    parts = t.split(".")
    return ".".join(parts[2:-1]) if len(parts) > 3 and t.startswith("io.gpuorch.") else t
