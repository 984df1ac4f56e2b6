"""Queue API: the queue tree with guarantees, limits, weights, entitlements and usage; accounting."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query

from shared import events as ev
from shared.cluster import ACTIVE, PENDING, ClusterProjection
from shared.fairshare import Ratios, children, divide, parent_of
from shared.model import QueueSpec, valid_queue_path
from shared.runtime import Service


def tree_error(queues: dict[str, QueueSpec], path: str, spec: QueueSpec) -> str | None:
    """Guarantees must fit inside the parent's; a queue with jobs cannot become a parent."""
    proposed = {**queues, path: spec}
    tree = children(proposed)
    for parent, kids in tree.items():
        if parent and parent in proposed:
            total = sum(proposed[k].guaranteed.gpus for k in kids if k in proposed)
            if total > proposed[parent].guaranteed.gpus + 1e-9:
                return (f"children of {parent} would be guaranteed {total:g} GPUs, above its own "
                        f"guarantee of {proposed[parent].guaranteed.gpus:g}")
    return None


def router(svc: Service, half_life_s: float) -> APIRouter:
    r = APIRouter(tags=["queues"])
    proj: ClusterProjection = svc.projection  # type: ignore[assignment]

    @r.get("/v1/queues")
    def list_queues() -> list[dict[str, Any]]:
        """Every queue; amounts in GPUs, and for fair share (entitlement, fair share, dominant_gpus) in
        GPU-equivalents of the dominant resource: the same as GPUs unless a queue's jobs take a larger share
        of the cluster's CPU or memory than of its GPUs."""
        now = time.time()
        alloc, pending = proj.queue_load()
        gpus_held, gpus_wanted = proj.queue_load(ratios=Ratios())
        division = proj.division(now, half_life_s)
        # the static share: what each queue would get if every queue wanted everything
        fair = divide(proj.capacity_gpus(), proj.queues, {q: 1e12 for q in proj.queues}).entitlement
        usage = proj.decayed_usage(now, half_life_s)
        tree = children(proj.queues)

        def subtree(p: str, table: dict[str, float]) -> float:
            kids = tree.get(p)
            return sum(subtree(k, table) for k in kids) if kids else table.get(p, 0.0)

        return [
            {"path": path, **spec.model_dump(mode="json"), "leaf": path not in tree,
             "allocated": {"gpus": subtree(path, gpus_held), "dominant_gpus": round(subtree(path, alloc), 3)},
             "pending": {"gpus": subtree(path, gpus_wanted), "dominant_gpus": round(subtree(path, pending), 3)},
             "entitlement": {"gpus": round(division.entitlement.get(path, 0.0), 3)},
             "fair_share": {"gpus": round(fair.get(path, 0.0), 3)},
             "usage": {"gpu_hours_decayed": round(subtree(path, usage) / 3600, 3), "half_life_s": half_life_s}}
            for path, spec in sorted(proj.queues.items())
        ]

    @r.put("/v1/queues/{path}", status_code=200)
    async def put_queue(path: str, spec: QueueSpec) -> dict[str, Any]:
        if not valid_queue_path(path):
            raise HTTPException(422, "queue path is a dotted path of lowercase names, e.g. research.nlp")
        if why := tree_error(proj.queues, path, spec):
            raise HTTPException(422, why)
        parent = parent_of(path)
        if parent and parent in proj.queues and _has_jobs(proj, parent):
            raise HTTPException(409, f"queue {parent} holds jobs: it cannot get child queues")
        event = ev.QueueUpdated(path=path, spec=spec) if path in proj.queues else ev.QueueDefined(path=path, spec=spec)
        seq = (await svc.emit(event))[0]
        await svc.caught_up(seq)
        return {"path": path, **spec.model_dump(mode="json"), "seq": seq}

    @r.delete("/v1/queues/{path}")
    async def delete_queue(path: str) -> dict[str, Any]:
        if path not in proj.queues:
            raise HTTPException(404, f"no queue {path}")
        kids = children(proj.queues).get(path)
        if kids:
            raise HTTPException(409, f"queue {path} has child queues ({', '.join(kids[:5])}): delete them first")
        if _has_jobs(proj, path):
            raise HTTPException(409, f"queue {path} still has pending or running jobs")
        seq = (await svc.emit(ev.QueueDeleted(path=path)))[0]
        await svc.caught_up(seq)
        return {"path": path, "deleted": True, "seq": seq}

    @r.get("/v1/usage")
    def usage(
        by: Annotated[str, Query(pattern="^queue$")] = "queue",
        since: Annotated[float | None, Query(description="epoch seconds; default: 24 hours ago")] = None,
        until: Annotated[float | None, Query(description="epoch seconds; default: now")] = None,
    ) -> dict[str, Any]:
        now = time.time()
        lo, hi = (now - 86400 if since is None else since), (now if until is None else until)
        if hi < lo:
            raise HTTPException(422, "until is before since")
        secs = proj.gpu_seconds(lo, hi)
        return {"by": by, "since": lo, "until": hi,
                "queues": {q: {"gpu_hours": round(v / 3600, 4)} for q, v in sorted(secs.items())}}

    return r


def _has_jobs(proj: ClusterProjection, path: str) -> bool:
    """Jobs submitted to exactly this queue that have not ended."""
    live = ACTIVE | PENDING | {"preempted"}
    return any(j.state in live and j.spec.queue == path for j in proj.jobs.values())
