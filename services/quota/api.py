"""Queue API: define and read the queue tree."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException

from shared import events as ev
from shared.model import QueueSpec, valid_queue_path
from shared.runtime import Service


def router(svc: Service) -> APIRouter:
    r = APIRouter(tags=["queues"])
    proj = svc.projection

    @r.get("/v1/queues")
    def list_queues() -> list[dict[str, Any]]:
        alloc: dict[str, int] = {}
        pending: dict[str, int] = {}
        for job in proj.jobs.values():
            q = job.spec.queue
            if job.state in ("placed", "running", "preempting"):
                alloc[q] = alloc.get(q, 0) + job.gpu_milli_total
            elif job.state in ("submitted", "queued"):
                pending[q] = pending.get(q, 0) + job.gpu_milli_total
        return [
            {"path": path, **spec.model_dump(mode="json"), "allocated": {"gpus": alloc.get(path, 0) / 1000},
             "pending": {"gpus": pending.get(path, 0) / 1000}}
            for path, spec in sorted(proj.queues.items())
        ]

    @r.put("/v1/queues/{path}", status_code=200)
    async def put_queue(path: str, spec: QueueSpec) -> dict[str, Any]:
        if not valid_queue_path(path):
            raise HTTPException(422, "queue path is a dotted path of lowercase names, e.g. research.nlp")
        event = ev.QueueUpdated(path=path, spec=spec) if path in proj.queues else ev.QueueDefined(path=path, spec=spec)
        seq = (await svc.emit(event))[0]
        await svc.caught_up(seq)
        return {"path": path, **spec.model_dump(mode="json"), "seq": seq}

    return r
