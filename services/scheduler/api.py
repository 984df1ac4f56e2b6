"""Job API: submit, list, get, cancel, history."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, HTTPException, Query

from services.scheduler.admission import admission_error
from shared import events as ev
from shared.api_events import record_json
from shared.cluster import ACTIVE, PENDING, JobRecord
from shared.events import SUBJECT_PREFIX, Envelope, new_id, subject_token
from shared.model import JobSpec
from shared.runtime import Service

if TYPE_CHECKING:
    from services.scheduler.service import Scheduler


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


def router(svc: Service, scheduler: "Scheduler") -> APIRouter:
    r = APIRouter(tags=["jobs"])
    proj = svc.projection

    def known(job_id: str) -> JobRecord:
        job = proj.jobs.get(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id}")
        return job

    def archived(job_id: str) -> dict[str, Any]:
        """A job no longer in memory (finished long ago), from the SQL read model."""
        row = scheduler.history.get(job_id)
        if row is None:
            raise HTTPException(404, f"no job {job_id}")
        return {**row.model_dump(), "id": row.job_id, "placement": [], "archived": True}

    @r.post("/v1/jobs", status_code=201)
    async def submit(spec: JobSpec) -> dict[str, Any]:
        """Accept a job (all tasks start together or none does); 422 with the reason if it never could run."""
        if admission_error(proj, spec):  # maybe stale: catch up with the log's head once, then judge
            assert svc.log is not None
            await svc.caught_up(await svc.log.last_seq(), timeout=2)
        if why := admission_error(proj, spec):
            raise HTTPException(422, why)
        job_id = new_id("j-")
        source = "/gpuorch/scheduler"
        assert svc.log is not None
        seqs = await svc.log.append_many([
            Envelope(ev.JobSubmitted(job_id=job_id, spec=spec), id=f"{job_id}-submitted", source=source),
            Envelope(ev.JobQueued(job_id=job_id), id=f"{job_id}-queued", source=source),
        ])
        scheduler.wake.set()
        await svc.caught_up(seqs[-1])
        job = proj.jobs.get(job_id) or JobRecord(job_id, spec, state="queued")
        return job_view(job)

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
        return job_view(job) if job is not None else archived(job_id)

    @r.delete("/v1/jobs/{job_id}")
    async def cancel(job_id: str) -> dict[str, Any]:
        job = known(job_id)
        if job.state not in ACTIVE | PENDING | {"preempted"}:
            raise HTTPException(409, f"job {job_id} is already {job.state}")
        assert svc.log is not None
        env = Envelope(ev.JobCancelled(job_id=job_id, reason="cancelled by user"), id=f"{job_id}-cancel-{job.seq}",
                       source="/gpuorch/scheduler")
        seq = await svc.log.append(env)
        scheduler.wake.set()
        await svc.caught_up(seq)
        return {**job_view(proj.jobs.get(job_id, job)), "seq": seq}

    @r.get("/v1/jobs/{job_id}/logs")
    async def job_logs(
        job_id: str,
        task: Annotated[int, Query(ge=0)] = 0,
        stream: Annotated[str, Query(pattern="^(stdout|stderr)$")] = "stdout",
        offset: Annotated[int, Query(ge=0)] = 0,
    ) -> dict[str, Any]:
        """A task's output, fetched from the agent of the node it ran on (``offset`` to follow)."""
        import httpx

        job = known(job_id)
        placement = next((p for p in job.placements if p.task == task), None)
        if placement is None:
            raise HTTPException(404, f"task {task} of job {job_id} has not been placed ({job.state})")
        node = proj.nodes.get(placement.node_id)
        if node is None or not node.info.agent_url:
            raise HTTPException(404, f"node {placement.node_id} has no agent to read logs from")
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                resp = await client.get(f"{node.info.agent_url}/v1/agent/logs/{job_id}",
                                        params={"task": task, "stream": stream, "offset": offset})
        except httpx.HTTPError as e:
            raise HTTPException(503, f"agent of {placement.node_id} unreachable: {e!r}") from None
        if resp.status_code != 200:
            raise HTTPException(resp.status_code, resp.json().get("detail", resp.text))
        return resp.json()

    @r.get("/v1/jobs/{job_id}/events")
    async def job_events(job_id: str) -> list[dict[str, Any]]:
        assert svc.log is not None
        subjects = [f"{SUBJECT_PREFIX}.job.{subject_token(job_id)}"]
        history = [record_json(rec) async for rec in svc.log.replay(1, subjects)]
        if not history:
            raise HTTPException(404, f"no job {job_id}")
        return history

    return r
