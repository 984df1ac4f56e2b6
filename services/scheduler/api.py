"""Job API: submit, list, get, cancel, history."""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, Header, HTTPException, Query, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Discriminator, Field, StrictBool, Tag, field_validator

from services.jobfiles import Context, load_site_map
from services.scheduler.admission import admission_error
from services.scheduler.decide import decide
from services.scheduler.dryrun import place_now
from services.scheduler.jobinput import manifest_route
from services.scheduler.shapes import parse_cc
from shared import events as ev
from shared.agentctl import MAX_LOG_CHUNK, AgentError, LogRequest, ask
from shared.api_errors import errors, path_id
from shared.api_events import record_json
from shared.auth import Principal, RateLimiter, caller, job_access, submit_error
from services.scheduler.gates import dependency_verdict
from shared.cluster import CANCELLABLE, HOLDABLE, REPRIORITISABLE, TIME_LIMITED, JobRecord
from shared.eventlog import ConcurrencyConflict
from shared.events import SUBJECT_PREFIX, Envelope, new_id, subject_token
from shared.model import (
    JOB_ID, QUEUE_PATH, ArrayElement, Dependency, EnvMap, Frozen, JobSpec, JsonNumber, NoNul, Priority,
)
from shared.redact import redact
from shared.runtime import Service
from shared.telemetry import new_trace, span

if TYPE_CHECKING:
    from services.scheduler.service import Scheduler


def job_view(job: JobRecord, live_reason: str | None = None) -> dict[str, Any]:
    """``live_reason``: the scheduler's latest words for a waiting job (the log holds the latest of its kind)."""
    return {
        "id": job.job_id,
        "name": job.spec.name,
        "queue": job.spec.queue,
        "priority": job.spec.priority,
        "state": job.state,
        "tasks": job.spec.tasks,
        "gpus_per_task": job.spec.resources.gpus,
        "owner": job.owner or None,
        # the record's spec dumped once (a spec is frozen), shared: masked in a copy only where it holds secrets
        "spec": redact(job.spec_json()) if job.spec.secret_env else job.spec_json(),
        "placement": [
            {"task": p.task, "node": p.node_id, "gpus": [g.uuid for g in p.gpus], "shares": [g.milli for g in p.gpus]}
            for p in job.placements
        ],
        "reason": (live_reason if job.state == "queued" and live_reason else job.reason),
        "exit_code": job.exit_code,
        "task_exits": {str(t): code for t, code in sorted(job.tasks_exited.items())},
        "retries": job.retries,
        "lost_before_start": job.lost_before_start,
        "submitted_at": job.submitted_at,
        "placed_at": job.placed_at,
        "started_at": job.started_at,
        "ended_at": job.ended_at,
        "preemptions": len(job.preemptions),
    }


Caller = Annotated[Principal, Depends(caller)]
JobIdPath = path_id("job_id", JOB_ID, "job")
DRY_RUN = ("dry_run=true: nothing is recorded; 200 with the spec it would submit, its warnings, ``refused`` "
           "(status and why) or where it would be placed now (``placement``, else ``reason``)")
Estimate = Annotated[bool, Query(description="add ``estimated_start`` (epoch seconds, or null): when a queued job "
                                             "should start; costs one scheduling cycle")]
JobState = Literal["submitted", "queued", "held", "placed", "running", "preempting", "preempted", "succeeded",
                   "failed", "cancelled", "rejected"]


PAGE, MAX_PAGE = 100, 1000  # jobs in a page of GET /v1/jobs: by default, at most
CURSOR = r"^v1\.[0-9]{1,19}$"  # opaque to clients: the submission sequence the next page starts below


MAX_ARRAY = 10_000  # elements of one array: each is a job of its own, two events each, appended in one batch


class ArrayRequest(Frozen):
    """A job array (Slurm's --array=0-9%2): one job per index, ids ``<array id>-<index>``."""

    indices: tuple[Annotated[int, Field(ge=0, le=1_000_000), JsonNumber], ...] = Field(
        min_length=1, max_length=MAX_ARRAY, description=f"distinct indices, at most {MAX_ARRAY}")
    max_running: Annotated[int, Field(ge=1, le=100_000), JsonNumber] | None = Field(
        default=None, description="at most this many elements placed or running at once (Slurm's %N)")

    @field_validator("indices")
    @classmethod
    def _distinct(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if len(set(v)) != len(v):
            raise ValueError("array indices must be distinct")
        return v


class JobRequest(JobSpec):
    """What POST /v1/jobs takes: a JobSpec that runs something, with POSIX environment names. (Events keep
    JobSpec's looser rules, so that every job ever logged stays readable; simulations may leave out commands.)"""

    command: tuple[NoNul, ...] = Field(min_length=1, max_length=4096, description="what each task runs (argv)")
    env: EnvMap = Field(default_factory=dict)
    secret_env: EnvMap = Field(
        default_factory=dict,
        description="stored, given to the tasks, never shown by the API or in events (env names matching the "
                    "server's secret pattern are moved here on submit)")
    array: ArrayRequest | None = Field(  # type: ignore[assignment]  # the request's shape; each element gets its own
        default=None, description="submit a job array: one job per index (the response lists their ids)")
    singleton: StrictBool = Field(default=False, description="Slurm's --dependency=singleton: waits while another "
                                                             "job of the same name and owner is placed or running")
    hold: StrictBool = Field(default=False, description="submit it held (sbatch --hold, Kubernetes' suspend): it is "
                                                        "not placed until released (POST /v1/jobs/{id}/release)")

    def to_spec(self) -> JobSpec:
        """The JobSpec it records: less what is the request's own (its array's shape, its hold)."""
        return JobSpec.model_validate(self.model_dump(exclude={"array", "hold"}))


MAX_CANCEL_IDS = 100_000  # job or array ids in one POST /v1/jobs:cancel
CANCEL_CHUNK = 1_000  # cancellations appended at once
# an answer that appended n events waits catch_up_timeout_s + n / FOLDS_PER_S (at most FOLD_WAIT_MAX_S) for their
# fold before its 503: 2,000 events fold in 0.25-0.55 s on 2 cores, several times slower in the slowest hours, when a
# flat 2 s failed 1,000-job batches that were fine
FOLDS_PER_S, FOLD_WAIT_MAX_S = 500, 20.0


def fold_wait_s(svc: Service, events: int) -> float:
    """How long an answer waits for the fold of the ``events`` its request appended."""
    return min(FOLD_WAIT_MAX_S, svc.catch_up_timeout_s + events / FOLDS_PER_S)


def _at_least_one(schema: dict[str, Any]) -> None:
    """A JobUpdate's schema: one of its fields at least, and no null default (an absent field is unchanged)."""
    schema["anyOf"] = [{"required": [name]} for name in schema["properties"]]
    for prop in schema["properties"].values():
        prop.pop("default", None)


class JobUpdate(Frozen):
    """What PATCH /v1/jobs/{id} takes (scontrol update): a waiting job's priority, a waiting or running job's time
    limit, or both (at least one; null is not a value). Only an admin raises a time limit, as in Slurm."""

    model_config = ConfigDict(**Frozen.model_config, json_schema_extra=_at_least_one)

    priority: Priority = None  # type: ignore[assignment]  # absent: unchanged
    time_limit_s: Annotated[int, Field(gt=0, le=365 * 86400), JsonNumber] = None  # type: ignore[assignment]


class CancelRequest(Frozen):
    """What POST /v1/jobs:cancel takes (scancel): job or array ids, or filters that every job cancelled matches."""

    ids: tuple[Annotated[str, Field(pattern=JOB_ID)], ...] | None = Field(
        default=None, min_length=1, max_length=MAX_CANCEL_IDS, description="these jobs, and every element of these "
                                                                           "arrays")
    name: Annotated[str, Field(max_length=256)] | None = None
    queue: Annotated[str, Field(pattern=QUEUE_PATH)] | None = None
    owner: Annotated[str, Field(max_length=256)] | None = None
    states: tuple[JobState, ...] | None = Field(default=None, min_length=1,  # empty is not "any": it would be all
                                                description="only jobs in one of these states")


MAX_BATCH = 1_000  # job requests in one POST /v1/jobs body (a JSON list): checked one by one, appended at once
IDEMPOTENCY_KEY = r"^[A-Za-z0-9._:+/=-]{1,255}$"  # a UUID, a ULID, base64, a client's own words without spaces
KEY_HELP = ("the client's name for this submission: the same request sent again with the same key (a retry after "
            "a cut-off connection) answers the jobs the first one recorded, and records nothing twice")


def keyed_id(user: str, key: str, index: int, array: bool) -> str:
    """The id of the index-th job request (a job, or an array) of a submission that ``user`` made with this
    Idempotency-Key. The request sent again makes the same ids, so its events, whose message ids are the job's, are
    stored once (JetStream's duplicate window), and once folded it is answered from what was recorded. A job and an
    array never share an id."""
    kind = "array" if array else "job"
    return "j-" + hashlib.blake2b(f"{user}\0{key}\0{index}\0{kind}".encode(), digest_size=11).hexdigest()


def _shape(body: Any) -> str:
    return "batch" if isinstance(body, list) else "one"


# One JobRequest, or a batch: a list of them. The tags name the branch in pydantic's errors; ``manifest_route``
# drops them, so that a single job's errors say ``["body", "command"]`` and a batch's ``["body", 2, "command"]``.
Submission = Annotated[
    Annotated[JobRequest, Tag("one")]
    | Annotated[list[JobRequest], Field(min_length=1, max_length=MAX_BATCH), Tag("batch")],
    Discriminator(_shape)]


def router(svc: Service, scheduler: "Scheduler") -> APIRouter:
    proj = svc.projection
    site = load_site_map(scheduler.settings.jobfile_map)

    def cluster() -> Context:
        """What a manifest's names mean here: the site map, the queues, the GPU models of the nodes."""
        models = sorted({g.model for n in proj.nodes.values() for g in n.info.gpus if g.model})
        return Context(site=site, queues=tuple(proj.queues), models=tuple(models))

    r = APIRouter(tags=["jobs"], route_class=manifest_route(cluster))
    limiter = RateLimiter(scheduler.settings.submit_rate_per_s, scheduler.settings.submit_burst)
    secret_name = re.compile(scheduler.settings.secret_env_pattern)

    def view(job: JobRecord) -> dict[str, Any]:
        return job_view(job, scheduler.live_reasons.get(job.job_id))

    def known(job_id: str, p: Principal, need: str = "read") -> JobRecord:
        """The job if this caller may ``need`` it; 404 when they may not even see it (no existence leak)."""
        job = proj.jobs.get(job_id)
        access = "none" if job is None else job_access(p, job, proj.queues)
        if job is None or access == "none":
            raise HTTPException(404, f"no job {job_id}")
        if need != "read" and access != "cancel":  # who may cancel a job may hold and release it
            raise HTTPException(403, f"{p.user} may see job {job_id} but not {need} it")
        return job

    def elements(array_id: str, p: Principal) -> list[JobRecord]:
        """The elements of an array this caller may see, by index."""
        out = [j for j in proj.array_elements(array_id) if job_access(p, j, proj.queues) != "none"]
        return sorted(out, key=lambda j: j.spec.array.index if j.spec.array else 0)

    def resolved(deps: tuple[Dependency, ...], p: Principal) -> tuple[tuple[Dependency, ...], list[str], str | None]:
        """The dependencies to keep, warnings, and why they are refused (None: they are not).

        Each must name a job or an array this caller may see, and still be possible to meet. One on a job that
        ended long ago (no longer held in memory, so the scheduler could not see it) is dropped when met."""
        keep, warnings = [], []
        for d in deps:
            label = f"{d.kind}:{d.job}"
            job = proj.jobs.get(d.job)
            seen = [job] if job is not None and job_access(p, job, proj.queues) != "none" else elements(d.job, p)
            if seen:
                verdict, why = dependency_verdict(d, tuple((j.job_id, j.state) for j in seen))
                if verdict == "never":
                    return (), [], why
                keep.append(d)
                continue
            row = scheduler.history.get(d.job) if job is None else None
            if row is not None and (p.role != "user" or row.owner == p.user):
                verdict, why = dependency_verdict(d, ((d.job, row.state),))
                if verdict == "never":
                    return (), [], why
                if verdict == "met":
                    warnings.append(f"dependency {label}: {d.job} {row.state} already: met")
                    continue
                keep.append(d)
                continue
            hint = " (a Slurm job id? name the gpuorch job id, e.g. j-...)" if d.job.isdigit() else ""
            return (), [], f"dependency {label}: no job or array {d.job}{hint}"
        return tuple(keep), warnings, None

    def archived(job_id: str, p: Principal) -> dict[str, Any]:
        """A job no longer in memory (finished long ago), from the SQL read model."""
        row = scheduler.history.get(job_id)
        if row is None or not (p.role != "user" or (row.owner and row.owner == p.user)):
            raise HTTPException(404, f"no job {job_id}")
        return row_view(row)

    def row_view(row: Any) -> dict[str, Any]:
        return redact({**row.model_dump(), "id": row.job_id, "placement": [], "archived": True})

    def with_secrets_apart(spec: JobSpec) -> JobSpec:
        """Env entries named like secrets (the server's pattern) are kept as secret_env: stored, never shown."""
        secret = {k: v for k, v in spec.env.items() if secret_name.search(k)}
        if not secret:
            return spec
        return spec.model_copy(update={"env": {k: v for k, v in spec.env.items() if k not in secret},
                                       "secret_env": {**spec.secret_env, **secret}})

    def secrets_warning(spec: JobSpec, apart: JobSpec) -> list[str]:
        moved = sorted(set(apart.secret_env) - set(spec.secret_env))
        return [f"env {', '.join(moved)}: named like secrets, kept as secret_env (stored, never shown)"] if moved else []

    judged: dict[str, str | None] = {}  # admission verdicts by shape, while the cluster's shape stays
    judged_at = [-1]  # the projection's shape_version they were judged at

    def admitted(specs: list[JobSpec]) -> list[str | None]:
        """Each spec's admission_error, judged once per shape (each judgement builds the cluster's nodes anew) and
        kept until a node, GPU, queue or pool event changes what it reads: jobs differ mostly in what no placement
        reads, their name, command and environment."""
        if proj.shape_version != judged_at[0] or len(judged) > 1024:
            judged.clear()
            judged_at[0] = proj.shape_version
        out = []
        for spec in specs:
            shape = spec.model_dump_json(exclude={"name", "command", "env", "secret_env"})
            if shape not in judged:
                judged[shape] = admission_error(proj, spec)
            out.append(judged[shape])
        return out

    gang_models: dict[tuple[int, int, str | None], tuple[str, ...]] = {}  # by the task's ask, at shape_version
    gang_models_at = [-1]

    def models_for(spec: JobSpec) -> tuple[str, ...]:
        """The GPU models of which some node holds enough GPUs for one task of ``spec`` (by count, memory and
        compute capability), kept while the cluster's shape stays."""
        if proj.shape_version != gang_models_at[0] or len(gang_models) > 256:
            gang_models.clear()
            gang_models_at[0] = proj.shape_version
        need = (math.ceil(spec.resources.gpus), spec.gpu.min_memory_mib, spec.gpu.min_compute_capability)
        if (found := gang_models.get(need)) is None:
            cc = parse_cc(need[2]) or (0, 0)
            models: set[str] = set()
            for node in proj.nodes.values():
                counts: dict[str, int] = {}
                for g in node.info.gpus:
                    if g.memory_mib >= need[1] and (parse_cc(g.compute_capability) or (0, 0)) >= cc:
                        counts[g.model] = counts.get(g.model, 0) + 1
                models.update(m for m, n in counts.items() if n >= need[0])
            found = gang_models[need] = tuple(sorted(models))
        return found

    def gang_warning(spec: JobSpec) -> list[str]:
        """A gang that names no model may be placed across models (as Slurm and Kubernetes would): say so."""
        if spec.tasks < 2 or spec.resources.gpus <= 0 or spec.gpu.models or spec.gpu.mig:
            return []
        models = models_for(spec)
        return [f"its {spec.tasks} tasks may be placed on different GPU models ({', '.join(models)}): pin one with "
                "--model (gpu.models)"] if len(models) > 1 else []

    def refusal(spec: JobSpec, p: Principal, why: str | None) -> tuple[JobSpec, list[str], tuple[int, str] | None]:
        """The spec with its dependencies resolved, their warnings, and why it is refused (status, detail) or None:
        it could never run (``why``, its admission error: 422), or this caller may not submit it (403)."""
        if why:
            return spec, [], (422, why)
        warnings: list[str] = []
        if spec.dependencies:
            deps, warnings, why = resolved(spec.dependencies, p)
            if why:
                return spec, [], (422, why)
            spec = spec.model_copy(update={"dependencies": deps})
        if denied := submit_error(p, proj.queues, spec):
            return spec, warnings, (403, denied)
        return spec, [*warnings, *gang_warning(spec)], None

    def preview(spec: JobSpec, p: Principal, refused: tuple[int, str] | None, warnings: list[str]) -> dict[str, Any]:
        """What POST without dry_run would do, appending nothing: refused (status, why), or where it goes now."""
        apart = with_secrets_apart(spec)
        body: dict[str, Any] = {"dry_run": True, "spec": redact(apart.model_dump(mode="json")),
                                "warnings": warnings + secrets_warning(spec, apart),
                                "refused": {"status": refused[0], "detail": refused[1]} if refused else None}
        if refused is None:
            body.update(place_now(proj, apart, scheduler.policy, time.time()))
        return jsonable_encoder(body)

    def job_count(batch: list[JobRequest]) -> int:
        """The jobs a request makes: an array's elements each count."""
        return sum(1 if req.array is None else len(req.array.indices) for req in batch)

    @r.post("/v1/jobs", status_code=201, responses={**errors(429), 200: {"description": DRY_RUN}})
    async def submit(body: Annotated[Submission, Body()], p: Caller, request: Request, response: Response,
                     dry_run: Annotated[bool, Query(description=DRY_RUN)] = False,
                     idempotency_key: Annotated[str | None, Header(pattern=IDEMPOTENCY_KEY, description=KEY_HELP)] = None,
                     ) -> dict[str, Any] | list[dict[str, Any]]:
        """Accept a job (all tasks start together or none does); 422 with the reason if it never could run.

        The body is a JobRequest in JSON, or in YAML (Content-Type: application/yaml), or a Kubernetes-family
        manifest (batch/v1 Job, PyTorchJob, Volcano Job, Pods of a KAI PodGroup) in JSON or YAML; ``warnings``
        says what its translation could not carry over. A JSON list of JobRequests (or a manifest holding several
        jobs) is a batch of at most MAX_BATCH: each job is checked as if alone, the first refused one refuses the
        whole batch (``jobs[i]: why``) and nothing is appended; else all are appended at once and the answer lists
        them in order. Traced, a job's trace is the request's (FastAPI's span, which continues the caller's
        ``traceparent``); a batch's jobs each get a trace of their own, linked to the request's.

        With an ``Idempotency-Key``, the same request sent again is answered (201, ``Idempotent-Replayed: true``)
        with the jobs the first one recorded, as they are now, and nothing is recorded twice; the key used before
        for another request is refused (422)."""
        one = not isinstance(body, list)
        batch: list[JobRequest] = [body] if one else body  # type: ignore[list-item]
        said = getattr(request.state, "jobfile_warnings", None) or [[] for _ in batch]
        if (jobs := job_count(batch)) > MAX_ARRAY:
            raise HTTPException(422, f"the batch makes {jobs} jobs (array elements count): at most {MAX_ARRAY} "
                                     "in one request")
        key = idempotency_key if not dry_run else None
        bases = [keyed_id(p.user, key, i, req.array is not None) for i, req in enumerate(batch)] if key else None
        specs = [req.to_spec() for req in batch]
        if key and bases and (replay := recorded_before(batch, specs, bases, said, p, key)) is not None:
            response.headers["Idempotent-Replayed"] = "true"
            return replay[0] if one else replay
        tokens = min(jobs, scheduler.settings.submit_burst)  # one per job, up to a burst: never refused for its size
        if p.role != "admin" and (wait := limiter.take(p.user, time.monotonic(), tokens)):
            raise HTTPException(429, f"{p.user} submits faster than {scheduler.settings.submit_rate_per_s:g} jobs/s",
                                headers={"Retry-After": str(max(1, math.ceil(wait)))})
        with span("scheduler.admission", attributes={"gpuorch.jobs": len(specs)}):
            if any(verdicts := admitted(specs)):  # maybe stale: catch up with the log's head once, then judge again
                assert svc.log is not None
                await svc.caught_up(await svc.log.last_seq(), timeout=2)
                verdicts = admitted(specs)
            checked = [refusal(spec, p, why) for spec, why in zip(specs, verdicts)]
        if dry_run:
            previews = [preview(spec, p, refused, [*w, *more]) for (spec, more, refused), w in zip(checked, said)]
            return JSONResponse(previews[0] if one else previews)  # type: ignore[return-value]
        for i, (_, _, refused) in enumerate(checked):
            if refused:
                raise HTTPException(refused[0], refused[1] if one else f"jobs[{i}]: {refused[1]}")
        accepted = []
        for req, (spec, more, _), w in zip(batch, checked, said):
            apart = with_secrets_apart(spec)
            accepted.append((req, apart, [*w, *more, *secrets_warning(spec, apart)]))
        answers = await record(accepted, p, bases)
        if key and bases:  # a request racing this one with another body under the key was stored first
            for (req, spec, _), base in zip(accepted, bases):
                if (job := proj.jobs.get(ids_of(req, base)[0])) is not None:
                    same_request(req, spec, job, key)
        return answers[0] if one else answers

    def ids_of(req: JobRequest, base: str) -> list[str]:
        return [base] if req.array is None else [f"{base}-{i}" for i in req.array.indices]

    def recorded_before(batch: list[JobRequest], specs: list[JobSpec], bases: list[str], said: list[list[str]],
                        p: Principal, key: str) -> list[dict[str, Any]] | None:
        """The answer to a submission whose jobs this key recorded already (each request's first job is known: in
        memory, or ended long ago and in the SQL read model), else None. 422 if the key recorded another request."""
        answers = []
        for req, spec, base, warnings in zip(batch, specs, bases, said):
            ids = ids_of(req, base)
            first = ids[0]
            if (job := proj.jobs.get(first)) is not None:
                same_request(req, with_secrets_apart(spec), job, key)
                if any(i not in proj.jobs or proj.jobs[i].state == "submitted" for i in ids):
                    return None  # an earlier try recorded part of it (an array's elements, a job.queued): the rest
                answers.append(answer(req, job.spec, warnings, base, p.user))
            elif (named := scheduler.history.name_and_queue(first)) is not None:  # ended long ago: its row
                if named != (req.name, req.queue):
                    raise HTTPException(422, reused(key, first))
                answers.append(answer(req, None, warnings, base, p.user, scheduler.history.get(first)))
            else:
                return None
        return answers

    def reused(key: str, job_id: str) -> str:
        return (f"Idempotency-Key {key!r} was used for another request (job {job_id}): send a new submission with "
                "a new key")

    def same_request(req: JobRequest, spec: JobSpec, job: JobRecord, key: str) -> None:
        """422 unless ``job``, recorded under this key, is what this request makes (resolved dependencies aside:
        they are resolved again at each try): the same spec, and for an array as many at once."""
        skip = {"dependencies", "array"}
        if job.spec.model_dump(exclude=skip) != spec.model_dump(exclude=skip) or (req.array is not None and (
                job.spec.array is None or job.spec.array.max_running != req.array.max_running)):
            raise HTTPException(422, reused(key, job.job_id))

    def answer(req: JobRequest, spec: JobSpec | None, warnings: list[str], base: str, owner: str, row: Any = None
               ) -> dict[str, Any]:
        """What POST answers for one job request: the job as it is now, or the array and its elements' ids."""
        if req.array is not None:
            named = spec or req
            return {"id": base, "array": base, "name": named.name, "queue": named.queue,
                    "state": "held" if req.hold else "queued",
                    "count": len(req.array.indices), "max_running": req.array.max_running,
                    "jobs": [f"{base}-{i}" for i in req.array.indices], "warnings": warnings}
        if row is not None:
            return {**row_view(row), "warnings": warnings}
        assert spec is not None
        return {**view(proj.jobs.get(base) or JobRecord(base, spec, state="queued", owner=owner)), "warnings": warnings}

    async def record(accepted: list[tuple[JobRequest, JobSpec, list[str]]], p: Principal,
                     bases: list[str] | None = None) -> list[dict[str, Any]]:
        """Append every job's ``job.submitted`` and ``job.queued`` (each array element a job of its own, id
        ``<array id>-<index>``) in one batch, wait once for the fold to reach the last, and answer each request.
        ``bases``: the requests' ids (an Idempotency-Key's), else new ones; a keyed job an earlier try recorded is
        not appended again (its copy would be an invalid transition once past the log's duplicate window)."""
        source, envs, made = "/gpuorch/scheduler", [], []
        for n, (req, spec, _) in enumerate(accepted):
            base = new_id("j-") if bases is None else bases[n]
            jobs = [(base, spec)] if req.array is None else [
                (f"{base}-{i}", spec.model_copy(update={"array": ArrayElement(
                    id=base, index=i, max_running=req.array.max_running)})) for i in req.array.indices]
            # one job: the request's trace; a batch: a trace per job (an array's elements share their array's)
            trace = new_trace("scheduler.submit", **{"gpuorch.job.id": base}) if len(accepted) > 1 else None
            for job_id, s in jobs:
                known = proj.jobs.get(job_id) if bases is not None else None
                if known is None:
                    envs.append(Envelope(ev.JobSubmitted(job_id=job_id, spec=s, owner=p.user),
                                         id=f"{job_id}-submitted", source=source, actor=p.user, traceparent=trace))
                if known is None or known.state == "submitted":  # its first step: queued, or held (one id: once)
                    first: ev.Event = ev.JobHeld(job_id=job_id, reason=f"held by {p.user} at submission") \
                        if req.hold else ev.JobQueued(job_id=job_id)
                    envs.append(Envelope(first, id=f"{job_id}-queued", source=source, actor=p.user, traceparent=trace))
            made.append((base, [job_id for job_id, _ in jobs]))
        assert svc.log is not None
        scheduler.traces.expect(envs)
        try:
            seqs = await svc.log.append_many(envs) if envs else []
        except BaseException:
            scheduler.traces.forget(envs)
            raise
        scheduler.wake.set()
        what = f"{'array' if accepted[0][0].array else 'job'} {made[0][0]} is" if len(made) == 1 else \
            f"the batch's {len(made)} jobs ({made[0][0]} to {made[-1][0]}) are"
        if seqs:
            await svc.caught_up(seqs[-1], fold_wait_s(svc, len(envs)), advice=f"{what} recorded: read it with GET "
                                f"/v1/jobs/{made[0][0]} rather than submitting it again")
        return [answer(req, spec, warnings, base, p.user) for (req, spec, warnings), (base, _) in zip(accepted, made)]

    @r.get("/v1/jobs")
    async def list_jobs(
        p: Caller,
        request: Request,
        response: Response,
        queue: Annotated[str | None, Query(pattern=QUEUE_PATH)] = None,
        state: Annotated[list[JobState] | None, Query(description="any of these states (repeat it)")] = None,
        name: Annotated[str | None, Query(max_length=256)] = None,
        owner: Annotated[str | None, Query(max_length=256)] = None,
        array: Annotated[str | None, Query(pattern=JOB_ID, description="only the elements of this job array")] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = PAGE,
        cursor: Annotated[str | None, Query(pattern=CURSOR, description="the X-Next-Cursor of the page before")] = None,
    ) -> list[dict[str, Any]]:
        """A page of the jobs this caller may see, newest first; ``X-Next-Cursor`` (and ``Link: rel=next``) name
        the next page while there may be one. Async on purpose: the page is read between two folds, never while one
        changes the jobs it walks."""
        after = int(cursor.removeprefix("v1.")) if cursor else None
        states = set(state) if state else None
        page: list[JobRecord] = []
        for job in reversed(proj.jobs.values()):  # submission order: stable while new jobs arrive at the front
            if after is not None and job.submitted_seq >= after:
                continue
            if (queue is None or job.spec.queue == queue) and (states is None or job.state in states) \
                    and (name is None or job.spec.name == name) and (owner is None or job.owner == owner) \
                    and (array is None or (job.spec.array is not None and job.spec.array.id == array)) \
                    and job_access(p, job, proj.queues) != "none":
                page.append(job)
                if len(page) >= limit:
                    next_cursor = f"v1.{job.submitted_seq}"
                    response.headers["X-Next-Cursor"] = next_cursor
                    query = request.url.include_query_params(cursor=next_cursor).query
                    response.headers["Link"] = f'<{request.url.path}?{query}>; rel="next"'
                    break
        return [view(job) for job in page]

    def estimated_start(job: JobRecord) -> float | None:
        """When a queued job should start: now if the cycle would place it, else its backfill reservation's start
        if it is the job next in line (None otherwise, or when it waits on jobs without a time limit). The
        reservation is never logged: the leader answers from its last cycle's plan; a standby, which runs no cycle,
        decides one on its own fold."""
        if job.state != "queued":
            return None
        if scheduler.leadership.leader.is_set():
            res = scheduler.reservation  # what the leader placed is no longer queued: no cycle again per request
        else:
            now = time.time()
            plan = decide(proj, scheduler.policy, now, scheduler.settings.half_life_s,
                          scheduler.settings.reclaim_after_s)
            if job.job_id in plan.placements:
                return now
            res = plan.reservation
        return res.start if res is not None and res.job_id == job.job_id and math.isfinite(res.start) else None

    def array_view(array_id: str, members: list[JobRecord]) -> dict[str, Any]:
        states: dict[str, int] = {}
        for j in members:
            states[j.state] = states.get(j.state, 0) + 1
        first = members[0].spec
        return {"id": array_id, "array": array_id, "name": first.name, "queue": first.queue, "count": len(members),
                "max_running": first.array.max_running if first.array else None, "states": states,
                "jobs": [j.job_id for j in members]}

    @r.get("/v1/jobs/{job_id}")
    async def get_job(job_id: JobIdPath, p: Caller, estimate: Estimate = False) -> dict[str, Any]:
        """A job; or, for an array's id, the array: its elements' ids and how many are in each state."""
        if job_id not in proj.jobs and (members := elements(job_id, p)):
            return array_view(job_id, members)
        if job_id not in proj.jobs:
            return archived(job_id, p)
        job = known(job_id, p)
        shown = view(job)
        for placed in shown["placement"]:  # each GPU's index on its node, as nvidia-smi and Slurm's IDX name it
            node = proj.nodes.get(placed["node"])
            index = {g.uuid: g.index for g in node.info.gpus} if node is not None else {}
            placed["indexes"] = [index.get(uuid) for uuid in placed["gpus"]]
        return {**shown, **({"estimated_start": estimated_start(job)} if estimate else {})}

    @r.delete("/v1/jobs/{job_id}", responses=errors(409))
    async def cancel(job_id: JobIdPath, p: Caller) -> dict[str, Any]:
        """Cancel a job; or, for an array's id, every element not ended yet."""
        if job_id not in proj.jobs and (members := elements(job_id, p)):
            return await cancel_array(job_id, members, p)
        job = known(job_id, p, "cancel")
        if job.state not in CANCELLABLE:
            raise HTTPException(409, f"job {job_id} is already {job.state}")
        assert svc.log is not None
        env = Envelope(ev.JobCancelled(job_id=job_id, reason=f"cancelled by {p.user}"), id=f"{job_id}-cancel-{job.seq}",
                       source="/gpuorch/scheduler", actor=p.user)
        seq = await svc.log.append(env)
        scheduler.wake.set()
        await svc.caught_up(seq)
        return {**view(proj.jobs.get(job_id, job)), "seq": seq}

    @r.post("/v1/jobs:cancel", responses=errors())
    async def cancel_many(req: CancelRequest, p: Caller) -> dict[str, Any]:
        """Cancel many jobs at once, as scancel does: the jobs (and array elements) named in ``ids``, or every job
        this caller may see that matches all the filters given (``name``, ``queue``, ``owner``, ``states``). Jobs
        that have ended, and jobs the caller may see but not cancel, are skipped and said why; an id the caller
        cannot see is ``unknown``. The cancellations are appended in batches: 20,000 jobs are one request, not
        20,000."""
        filters = (req.name, req.queue, req.owner, req.states)
        if (req.ids is None) == all(f is None for f in filters):
            raise HTTPException(422, "give ids, or filters (name, queue, owner, states), not both and not neither")
        picked: dict[str, JobRecord] = {}
        skipped: list[dict[str, str]] = []
        if req.ids is not None:
            for job_id in dict.fromkeys(req.ids):
                job = proj.jobs.get(job_id)
                found = [job] if job is not None else proj.array_elements(job_id)
                visible = [j for j in found if job_access(p, j, proj.queues) != "none"]
                if not visible:
                    skipped.append({"id": job_id, "why": "unknown"})
                for j in visible:
                    picked.setdefault(j.job_id, j)
        else:
            states = None if req.states is None else set(req.states)
            picked = {j.job_id: j for j in proj.jobs.values()
                      if (req.name is None or j.spec.name == req.name) and (req.queue is None or j.spec.queue == req.queue)
                      and (req.owner is None or j.owner == req.owner) and (states is None or j.state in states)
                      and j.state in CANCELLABLE and job_access(p, j, proj.queues) != "none"}
        envs = []  # made now, before any await: each event's id names the job's sequence as read (a retry's match)
        for j in picked.values():
            if j.state not in CANCELLABLE:
                skipped.append({"id": j.job_id, "why": f"already {j.state}"})
            elif job_access(p, j, proj.queues) != "cancel":
                skipped.append({"id": j.job_id, "why": f"{p.user} may see it but not cancel it"})
            else:
                envs.append(Envelope(ev.JobCancelled(job_id=j.job_id, reason=f"cancelled by {p.user}"),
                                     id=f"{j.job_id}-cancel-{j.seq}", source="/gpuorch/scheduler", actor=p.user))
        assert svc.log is not None
        seq = 0
        for i in range(0, len(envs), CANCEL_CHUNK):
            seq = (await svc.log.append_many(envs[i:i + CANCEL_CHUNK]))[-1]
        cancelled = []
        if seq:
            scheduler.wake.set()
            # folding them takes a while (20,000 cancellations: 3-4 s on 2 cores): the wait grows with their number
            await svc.caught_up(seq, fold_wait_s(svc, len(envs)),
                                advice="the cancellations are recorded and take effect as the scheduler catches up: "
                                       "GET /v1/jobs shows them; sent again, nothing is cancelled twice")
            for env in envs:  # a job that ended while the request ran was not cancelled: its cancellation came late
                job_id = env.data.job_id  # type: ignore[attr-defined]
                state = getattr(proj.jobs.get(job_id), "state", "cancelled")  # not held: ended and dropped since
                if state == "cancelled":
                    cancelled.append(job_id)
                else:
                    skipped.append({"id": job_id, "why": f"{state} meanwhile"})
        return {"cancelled": cancelled, "skipped": skipped, "seq": seq or None}

    async def cancel_array(array_id: str, members: list[JobRecord], p: Principal) -> dict[str, Any]:
        if any(job_access(p, j, proj.queues) != "cancel" for j in members):
            raise HTTPException(403, f"{p.user} may see array {array_id} but not cancel it")
        left = [j for j in members if j.state in CANCELLABLE]
        if not left:
            raise HTTPException(409, f"every job of array {array_id} has ended already")
        assert svc.log is not None
        seqs = await svc.log.append_many([
            Envelope(ev.JobCancelled(job_id=j.job_id, reason=f"array {array_id} cancelled by {p.user}"),
                     id=f"{j.job_id}-cancel-{j.seq}", source="/gpuorch/scheduler", actor=p.user) for j in left])
        scheduler.wake.set()
        await svc.caught_up(seqs[-1])
        return {"id": array_id, "array": array_id, "cancelled": [j.job_id for j in left], "seq": seqs[-1]}

    @r.post("/v1/jobs/{job_id}/hold", responses=errors(409))
    async def hold(job_id: JobIdPath, p: Caller) -> dict[str, Any]:
        """Hold a waiting job, as Slurm's scontrol hold: it is not placed, and wants nothing of quota, fair share
        or the autoscaler, until released; for an array's id, every element still waiting. A job placed already
        is 409 (cancel it, or let it run). Who may cancel a job may hold it."""
        return await hold_or_release(job_id, p, "hold")

    @r.post("/v1/jobs/{job_id}/release", responses=errors(409))
    async def release(job_id: JobIdPath, p: Caller) -> dict[str, Any]:
        """Release a held job (scontrol release): it waits in its queue again, at its first submission's place;
        for an array's id, every held element."""
        return await hold_or_release(job_id, p, "release")

    async def hold_or_release(job_id: str, p: Principal, verb: str) -> dict[str, Any]:
        want = HOLDABLE if verb == "hold" else frozenset({"held"})
        if job_id not in proj.jobs and (members := elements(job_id, p)):
            if any(job_access(p, j, proj.queues) != "cancel" for j in members):
                raise HTTPException(403, f"{p.user} may see array {job_id} but not {verb} it")
            if verb == "release" and p.role != "admin" and any(j.held_by_admin for j in members):
                raise HTTPException(403, f"jobs of array {job_id} were held by an admin: only an admin releases them")
            done = await appended_many([j for j in members if j.state in want], lambda j: hold_envelope(j, p, verb),
                                       want)
            if not done:
                raise HTTPException(409, f"no job of array {job_id} is {'waiting' if verb == 'hold' else 'held'}")
            return {"id": job_id, "array": job_id, "held" if verb == "hold" else "released": done}
        job = known(job_id, p, verb)
        if verb == "release" and job.held_by_admin and p.role != "admin":
            raise HTTPException(403, f"job {job_id} was held by an admin ({job.reason}): only an admin releases it")
        if job.state not in want or not await appended(job, lambda j: hold_envelope(j, p, verb), want):
            job = proj.jobs.get(job_id, job)
            why = "only a job that waits to be placed can be held" if verb == "hold" else "only a held job is released"
            raise HTTPException(409, f"job {job_id} is held already" if verb == "hold" and job.state == "held"
                                else f"job {job_id} is {job.state}: {why}")
        return view(proj.jobs.get(job_id, job))

    def hold_envelope(job: JobRecord, p: Principal, verb: str) -> Envelope:
        admin = p.role == "admin"
        event = ev.JobHeld(job_id=job.job_id, reason=f"held by {p.user}" + (" (an admin)" if admin else ""),
                           admin=admin) if verb == "hold" else ev.JobReleased(job_id=job.job_id)
        return Envelope(event, id=f"{job.job_id}-{verb}-{job.seq}", source="/gpuorch/scheduler", actor=p.user)

    async def appended_many(jobs: list[JobRecord], make: Callable[[JobRecord], Envelope],
                            want: frozenset[str]) -> list[str]:
        """Each job's event (an array's holds, releases, updates) in one pipelined append, each expecting its job's
        last event as ``appended`` does; a job refused for that is read again and, if still in ``want``, tried
        alone. The ids done, in order."""
        assert svc.log is not None
        if not jobs:
            return []
        seqs = await svc.log.append_many([make(j) for j in jobs], expected=[j.seq for j in jobs])
        await svc.caught_up(max(seqs) if any(seqs) else await svc.log.last_seq())
        done = []
        for j, seq in zip(jobs, seqs):
            now = proj.jobs.get(j.job_id)
            if seq or (now is not None and now.state in want and await appended(now, make, want)):
                done.append(j.job_id)
        return done

    async def appended(job: JobRecord, make: Callable[[JobRecord], Envelope], want: frozenset[str]) -> bool:
        """Append the job's event (hold, release, update), expecting its last event to be the one it was read at: a
        placement appended meanwhile makes a hold fail (the job moved) rather than land on a running job. False
        when the job left ``want`` meanwhile; a reason logged meanwhile (the job did not move) is read, then tried
        again."""
        assert svc.log is not None
        for _ in range(3):
            env = make(job)
            try:
                seq = await svc.log.append(env, expected_last_subject_seq=job.seq)
            except ConcurrencyConflict:
                await svc.caught_up(await svc.log.last_seq())
                moved = proj.jobs.get(job.job_id)
                if moved is None or moved.state not in want:
                    return False
                job = moved
                continue
            await svc.caught_up(seq)  # its fold wakes the scheduler (a wake before the fold could pass it over)
            return True
        raise HTTPException(503, f"job {job.job_id} kept changing: try again")

    @r.patch("/v1/jobs/{job_id}", responses=errors(409))
    async def update(job_id: JobIdPath, change: JobUpdate, p: Caller) -> dict[str, Any]:
        """Change a job, as Slurm's scontrol update: its priority while it waits (up to what its queue lets the
        caller submit at), its time limit while it waits or runs (only an admin raises one). Who may cancel a job
        may change it. An array's id changes every element that may be changed."""
        if change.priority is None and change.time_limit_s is None:
            raise HTTPException(422, "nothing to change: give priority, time_limit_s or both")
        want = TIME_LIMITED if change.priority is None else REPRIORITISABLE
        array = job_id not in proj.jobs and (members := elements(job_id, p))
        jobs = members if array else [known(job_id, p, "change")]
        if array and any(job_access(p, j, proj.queues) != "cancel" for j in jobs):
            raise HTTPException(403, f"{p.user} may see array {job_id} but not change it")
        todo = [j for j in jobs if j.state in want]
        for j in todo:  # every element checked before any is changed (an ended one is not changed: not checked)
            if (why := update_error(j, change, p)) is not None:
                raise HTTPException(403, why)

        def make(j: JobRecord) -> Envelope:  # checked again here: a job read again after a race may have changed
            if (why := update_error(j, change, p)) is not None:
                raise HTTPException(403, why)
            return Envelope(ev.JobUpdated(job_id=j.job_id, priority=change.priority, time_limit_s=change.time_limit_s),
                            id=f"{j.job_id}-update-{j.seq}-{change.priority}-{change.time_limit_s}",
                            source="/gpuorch/scheduler", actor=p.user)
        done = await appended_many(todo, make, want)
        if not done:
            field, what = ("priority", "waits") if change.priority is not None else ("time limit", "waits or runs")
            if array:
                raise HTTPException(409, f"no job of array {job_id} {what}")
            state = proj.jobs.get(job_id, jobs[0]).state
            raise HTTPException(409, f"job {job_id} is {state}: a job's {field} is changed only while it {what}")
        return {"id": job_id, "array": job_id, "updated": done} if array else view(proj.jobs.get(job_id, jobs[0]))

    def update_error(job: JobRecord, change: JobUpdate, p: Principal) -> str | None:
        """Why this caller may not make this change to this job (None: it may)."""
        if p.role == "admin":
            return None
        old = job.spec.time_limit_s
        if change.time_limit_s is not None and old is not None and change.time_limit_s > old:
            return f"only an admin raises a job's time limit (job {job.job_id}: {old} s, asked {change.time_limit_s} s)"
        if change.priority is not None:
            return submit_error(p, proj.queues, job.spec.model_copy(update={"priority": change.priority}))
        return None

    @r.get("/v1/jobs/{job_id}/logs", responses=errors(502, 503))
    async def job_logs(
        job_id: JobIdPath,
        p: Caller,
        task: Annotated[int, Query(ge=0, le=1023)] = 0,
        stream: Literal["stdout", "stderr"] = "stdout",
        offset: Annotated[int, Query(ge=0, le=2**53)] = 0,
        tail_bytes: Annotated[int | None, Query(ge=1, le=MAX_LOG_CHUNK)] = None,
    ) -> dict[str, Any]:
        """A task's output, asked of the agent of the node it ran on, over the bus: at most 1 MiB from ``offset``
        (``next_offset`` to read on, or follow), or its last ``tail_bytes`` bytes. A chunk ends on a whole UTF-8
        character."""
        if job_id not in proj.jobs and (members := elements(job_id, p)):  # an array has no output of its own
            first, last = members[0].job_id, members[-1].job_id
            raise HTTPException(404, f"{job_id} is an array of {len(members)} jobs: ask for one of them"
                                     f" ({first}{' to ' + last if last != first else ''})")
        job = known(job_id, p)
        placement = next((q for q in job.placements + job.last_placements if q.task == task), None)
        if placement is None:
            raise HTTPException(404, f"task {task} of job {job_id} has not been placed ({job.state})")
        assert svc.log is not None
        try:
            return await ask(svc.log.nc, placement.node_id, "logs",
                             LogRequest(job_id=job_id, task=task, stream=stream, offset=offset,
                                        **({"limit": tail_bytes, "tail": True} if tail_bytes else {})))
        except AgentError as e:
            raise HTTPException(e.status, e.detail) from None

    @r.get("/v1/jobs/{job_id}/events")
    async def job_events(job_id: JobIdPath, p: Caller) -> list[dict[str, Any]]:
        if job_id in proj.jobs:
            known(job_id, p)
        elif p.role == "user":  # an archived job's history: its owner is in its first event
            archived(job_id, p)
        assert svc.log is not None
        subjects = [f"{SUBJECT_PREFIX}.job.{subject_token(job_id)}"]
        history = [record_json(rec) async for rec in svc.log.replay(1, subjects)]
        if not history:
            raise HTTPException(404, f"no job {job_id}")
        return history

    return r
