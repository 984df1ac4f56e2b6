"""Job API (reads here; submission and cancel grow in the scheduler issue)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query

from shared.api_events import record_json
from shared.cluster import JobRecord
from shared.events import SUBJECT_PREFIX, subject_token
from shared.runtime import Service


def job_view(job: JobRecord) -> dict[str, Any]:
    return {
        "id": job.job_id,
        "name": job.spec.name,
        "queue": job.spec.queue,
        "priority": job.spec.priority,
        "state": job.state,
        "tasks": job.spec.tasks,
        "gpus_per_task": job.spec.resources.gpus,
        "spec": job.spec.model_dump(mode="json"),
        "placement": [
            {"task": p.task, "node": p.node_id, "gpus": [g.uuid for g in p.gpus], "shares": [g.milli for g in p.gpus]}
            for p in job.placements
        ],
        "reason": job.reason,
        "exit_code": job.exit_code,
        "submitted_at": job.submitted_at,
        "placed_at": job.placed_at,
        "started_at": job.started_at,
        "ended_at": job.ended_at,
        "preemptions": len(job.preemptions),
    }


def router(svc: Service) -> APIRouter:
    r = APIRouter(tags=["jobs"])
    proj = svc.projection

    @r.get("/v1/jobs")
    def list_jobs(
        queue: str | None = None,
        state: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
    ) -> list[dict[str, Any]]:
        out = []
        for job in reversed(proj.jobs.values()):
            if (queue is None or job.spec.queue == queue) and (state is None or job.state == state):
                out.append(job_view(job))
                if len(out) >= limit:
                    break
        return out

    @r.get("/v1/jobs/{job_id}")
    def get_job(job_id: str) -> dict[str, Any]:
        job = proj.jobs.get(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id}")
        return job_view(job)

    @r.get("/v1/jobs/{job_id}/events")
    async def job_events(job_id: str) -> list[dict[str, Any]]:
        if job_id not in proj.jobs:
            raise HTTPException(404, f"no job {job_id}")
        assert svc.log is not None
        subjects = [f"{SUBJECT_PREFIX}.job.{subject_token(job_id)}"]
        return [record_json(rec) async for rec in svc.log.replay(1, subjects)]

    return r
