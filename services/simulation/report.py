"""What a simulation hands back: a downsampled timeline for JSON, and the PNG plots."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from services.simulation.engine import Sample, SimResult
from services.simulation.paper import PaperRun

MAX_POINTS = 600


def timeline(result: SimResult, points: int = MAX_POINTS) -> list[dict[str, float]]:
    """Allocation %, cumulative utilization %, queue length, at up to ``points`` instants."""
    rows = _series(result)
    step = max(1, len(rows) // points)
    keep = rows[::step] + ([rows[-1]] if rows and (len(rows) - 1) % step else [])
    return [{"t": round(t, 3), "allocation_pct": round(a, 3), "utilization_pct": round(u, 3), "queued": q}
            for t, a, u, q in keep]


def _series(result: SimResult) -> list[tuple[float, float, float, int]]:
    """(t, allocation %, utilization % so far, queued) after each instant."""
    out = []
    cap = result.capacity or 1
    t0 = result.samples[0].t if result.samples else 0.0
    area = 0.0
    prev: Sample | None = None
    for s in result.samples:
        if prev is not None:
            area += prev.allocated * (s.t - prev.t)
        util = 100 * area / (cap * (s.t - t0)) if s.t > t0 else 100 * s.allocated / cap
        out.append((s.t, 100 * s.allocated / cap, util, s.queued))
        prev = s
    return out


def _axes(title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    fig.suptitle(title)
    return plt, fig, axes


def plot_timelines(results: Mapping[str, SimResult], path: Path, title: str) -> Path:
    """Allocation ratio, utilization and queue length over virtual time, one line per run."""
    plt, fig, (ax_a, ax_u, ax_q) = _axes(title)
    span = max((r.samples[-1].t - r.samples[0].t for r in results.values() if r.samples), default=0.0)
    unit, label = (86400, "days") if span > 3 * 86400 else (3600, "hours") if span > 3 * 3600 else (1, "seconds")
    for name, r in results.items():
        rows = _series(r)
        if not rows:
            continue
        t0 = rows[0][0]
        xs = [(t - t0) / unit for t, *_ in rows]
        ax_a.step(xs, [a for _, a, _, _ in rows], where="post", label=name, linewidth=0.8)
        ax_u.plot(xs, [u for _, _, u, _ in rows], label=name, linewidth=0.8)
        ax_q.step(xs, [q for *_, q in rows], where="post", label=name, linewidth=0.8)
    ax_a.set_ylabel("allocation ratio %")
    ax_u.set_ylabel("utilization % (mean so far)")
    ax_q.set_ylabel("jobs waiting")
    ax_q.set_xlabel(f"virtual time ({label})")
    for ax in (ax_a, ax_u, ax_q):
        ax.grid(alpha=0.3)
    ax_a.legend(loc="lower right", fontsize=8)
    return _save(plt, fig, path)


def plot_paper(runs: Mapping[str, Sequence[PaperRun]], path: Path, title: str) -> Path:
    """The FGD paper's view: allocated GPU % against arrived GPU % (median over seeds), its ratio to what
    arrived, and the pods that found no node."""
    plt, fig, (ax_a, ax_u, ax_f) = _axes(title)
    for name, seeds in runs.items():
        if not seeds:
            continue
        curves = [r.curve() for r in seeds]
        xs = sorted(set.intersection(*(set(c) for c in curves)))
        med = [sorted(c[x] for c in curves)[len(curves) // 2] for x in xs]
        ax_a.plot(xs, med, label=f"{name} ({len(seeds)} seeds, median)", linewidth=1)
        ax_u.plot(xs, [100 * m / x if x else 100.0 for m, x in zip(med, xs)], label=name, linewidth=1)
        r = seeds[0]
        unit = r.capacity / 100
        failed, n = [], 0
        for i, (a, u) in enumerate(zip(r.arrived, r.allocated)):
            if i and u == r.allocated[i - 1] and a != r.arrived[i - 1]:
                n += 1
            failed.append(n)
        ax_f.plot([a / unit for a in r.arrived], failed, label=f"{name} (seed {r.seed})", linewidth=1)
    ax_a.set_ylabel("allocated GPU % of capacity")
    ax_u.set_ylabel("allocated % of arrived")
    ax_f.set_ylabel("GPU pods that found no node")
    ax_f.set_xlabel("arrived GPU requests, % of capacity (the paper's virtual time)")
    for ax in (ax_a, ax_u, ax_f):
        ax.grid(alpha=0.3)
    ax_a.legend(loc="upper left", fontsize=8)
    return _save(plt, fig, path)


def _save(plt, fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
