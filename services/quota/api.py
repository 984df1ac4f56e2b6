"""Queue API: the queue tree with guarantees, limits, weights, entitlements and usage; accounting."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query

from shared import events as ev
from shared.api_errors import errors, path_id
from shared.auth import Principal, caller
from shared.cluster import ACTIVE, DEFAULT_QUEUE, PENDING, ClusterProjection
from shared.fairshare import GPUS_ONLY, children, divide, parent_of
from shared.model import QUEUE_PATH, QueueSpec
from shared.runtime import Service
from shared.timespec import ACCEPTED, TimeSpecError, parse_window

WINDOW_DOC = f"{ACCEPTED}; default: 24h (since), now (until)"
Since = Annotated[str | None, Query(min_length=1, max_length=40, description=f"start of the window: {WINDOW_DOC}")]
Until = Annotated[str | None, Query(min_length=1, max_length=40, description=f"end of the window: {WINDOW_DOC}")]


def window(since: str | None, until: str | None, now: float) -> tuple[float, float]:
    """[since, until) in epoch seconds from what the caller typed; 422 naming the accepted forms if unreadable."""
    try:
        return parse_window(since, until, now, typed=False)
    except TimeSpecError as e:
        raise HTTPException(422, str(e)) from None


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


QueuePathParam = Annotated[str, Path(pattern=QUEUE_PATH, description="a dotted path of lowercase names")]
KnownQueuePath = path_id("path", QUEUE_PATH, "queue")


def router(svc: Service, half_life_s: float, clock: Callable[[], float] = time.time) -> APIRouter:
    """``clock``: "now" for fair share and usage (epoch seconds)."""
    r = APIRouter(tags=["queues"])
    proj: ClusterProjection = svc.projection  # type: ignore[assignment]

    @r.get("/v1/queues")
    async def list_queues(since: Since = None, until: Until = None) -> list[dict[str, Any]]:
        """Every queue; amounts in GPUs, and for fair share (entitlement, fair share, dominant_gpus) in
        GPU-equivalents of the dominant resource: the same as GPUs unless a queue's jobs take a larger share
        of the cluster's CPU or memory than of its GPUs. Usage: ``gpu_hours`` held in [since, until) (the
        figure /v1/usage gives), and ``gpu_hours_decayed`` over all time with the half-life (what fair share
        weighs). ``overcommitted`` is true on every top-level queue when their guarantees add up to more GPUs
        than the cluster can divide now: not every guarantee can be met."""
        # it walks every job: in a thread while no fold runs (in FastAPI's pool, folds changed what it walked)
        return await svc.read_in_thread(lambda: queue_table(since, until))

    def queue_table(since: str | None, until: str | None) -> list[dict[str, Any]]:
        now = clock()
        top_guaranteed = sum(spec.guaranteed.gpus for q, spec in proj.queues.items() if "." not in q)
        overcommitted = top_guaranteed > proj.capacity_gpus() + 1e-9
        lo, hi = window(since, until, now)
        used = proj.gpu_seconds(lo, hi, now)
        load, in_gpus = proj.queue_loads_in(proj.share_ratios(), GPUS_ONLY)  # in dominant shares and in GPUs, one pass
        alloc, pending = load.alloc, load.pending
        gpus_held, gpus_wanted = in_gpus.alloc, in_gpus.pending
        division = proj.division(now, half_life_s, load)
        # the static share: what each queue would get if every queue wanted everything
        fair = divide(proj.capacity_gpus(), proj.queues, {q: 1e12 for q in proj.queues}).entitlement
        usage = proj.decayed_usage(now, half_life_s)
        tree = children(proj.queues)

        def subtree(p: str, table: dict[str, float]) -> float:
            kids = tree.get(p)
            return sum(subtree(k, table) for k in kids) if kids else table.get(p, 0.0)

        return [
            {"path": path, **spec.model_dump(mode="json"), "leaf": path not in tree,
             "overcommitted": overcommitted and "." not in path,
             "allocated": {"gpus": subtree(path, gpus_held), "dominant_gpus": round(subtree(path, alloc), 3)},
             "pending": {"gpus": subtree(path, gpus_wanted), "dominant_gpus": round(subtree(path, pending), 3)},
             "entitlement": {"gpus": round(division.entitlement.get(path, 0.0), 3)},
             "fair_share": {"gpus": round(fair.get(path, 0.0), 3)},
             "usage": {"gpu_hours": round(subtree(path, used) / 3600, 4), "since": lo, "until": hi,
                       "gpu_hours_decayed": round(subtree(path, usage) / 3600, 4), "half_life_s": half_life_s}}
            for path, spec in sorted(proj.queues.items())
        ]

    @r.put("/v1/queues/{path}", status_code=200, responses=errors(409))
    async def put_queue(path: QueuePathParam, spec: QueueSpec, p: Annotated[Principal, Depends(caller)]) -> dict[str, Any]:
        """Create or update a queue; the same spec again changes nothing and appends nothing (``changed``)."""
        if proj.queues.get(path) == spec:
            return {"path": path, **spec.model_dump(mode="json"), "seq": proj.seq, "changed": False}
        if why := tree_error(proj.queues, path, spec):
            raise HTTPException(422, why)
        parent = parent_of(path)
        if parent == DEFAULT_QUEUE:
            raise HTTPException(409, f"queue {DEFAULT_QUEUE} stays a leaf: jobs submitted without a queue go there")
        if parent and parent in proj.queues and _has_jobs(proj, parent):
            raise HTTPException(409, f"queue {parent} holds jobs: it cannot get child queues")
        event = ev.QueueUpdated(path=path, spec=spec) if path in proj.queues else ev.QueueDefined(path=path, spec=spec)
        seq = (await svc.emit(event, actor=p.user))[0]
        await svc.caught_up(seq)
        return {"path": path, **spec.model_dump(mode="json"), "seq": seq, "changed": True}

    @r.delete("/v1/queues/{path}", responses=errors(409))
    async def delete_queue(path: KnownQueuePath, p: Annotated[Principal, Depends(caller)]) -> dict[str, Any]:
        if path not in proj.queues:
            raise HTTPException(404, f"no queue {path}")
        if path == DEFAULT_QUEUE:
            raise HTTPException(409, f"queue {DEFAULT_QUEUE} cannot be deleted: jobs submitted without a queue go there")
        kids = children(proj.queues).get(path)
        if kids:
            raise HTTPException(409, f"queue {path} has child queues ({', '.join(kids[:5])}): delete them first")
        if _has_jobs(proj, path):
            raise HTTPException(409, f"queue {path} still has pending or running jobs")
        seq = (await svc.emit(ev.QueueDeleted(path=path), actor=p.user))[0]
        await svc.caught_up(seq)
        return {"path": path, "deleted": True, "seq": seq}

    @r.get("/v1/usage")
    async def usage(by: Annotated[str, Query(pattern="^queue$")] = "queue", since: Since = None,
                    until: Until = None) -> dict[str, Any]:
        """GPU-seconds held per queue in [since, until), like sreport: exactly what was held in the window
        (running jobs up to now)."""
        now = clock()
        lo, hi = window(since, until, now)
        secs = await svc.read_in_thread(lambda: proj.gpu_seconds(lo, hi, now))
        return {"by": by, "since": lo, "until": hi,
                "queues": {q: {"gpu_hours": round(v / 3600, 4), "gpu_seconds": round(v, 3)}
                           for q, v in sorted(secs.items())}}

    return r


def _has_jobs(proj: ClusterProjection, path: str) -> bool:
    """Jobs submitted to exactly this queue that have not ended."""
    live = ACTIVE | PENDING | {"preempted", "held"}
    return any(j.state in live and j.spec.queue == path for j in proj.jobs.values())
