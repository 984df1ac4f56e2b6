"""The dashboard: server-rendered pages over the API, for people with a browser.

Every figure comes from the API itself, asked in-process (ASGI) with the caller's own token, so a page shows
exactly what the API lets that caller see: the same role table, the same per-job visibility. The pages are
plain HTML (tables and forms work with JavaScript off); a small script (static/app.js) refreshes the live parts
of a page, follows a job's logs and shows the event stream as it arrives (server-sent events).

A browser cannot send a bearer header on navigation: ``POST /ui/login`` takes a token once and keeps it in an
HttpOnly, SameSite=Strict cookie that ``shared.auth.authorize`` accepts on the dashboard's GET routes only
(docs/dashboard.md).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import parse_qs, urlencode, urlsplit

from fastapi import APIRouter, HTTPException, Path, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse

from services.dashboard import views
from services.dashboard.pages import HERE, PageRoute, api_of, live_url, local, render, render_streamed
from services.dashboard.telemetry import LatestTelemetry
from shared.api_events import MAX_SEQ, SUBJECT, record_json, sse, subject_filter
from shared.auth import SESSION_COOKIE, Unauthenticated
from shared.eventlog import Record, Undecodable
from shared.model import JOB_ID

if TYPE_CHECKING:
    from shared.eventlog import EventLog

STATIC = {"app.js": "text/javascript", "style.css": "text/css", "favicon.svg": "image/svg+xml"}
LIVE_STATES = ("placed", "running", "preempting")
PENDING_STATES = ("submitted", "queued", "held", "preempted")
SESSION_MAX_AGE_S = 12 * 3600
LOGS_WAIT_S = 0.3  # the most a job page waits for its first log chunk (an agent answers in ms; the script follows)
LOG_PAGE_BYTES = 64 << 10  # a job page shows its log's end, this much: a long log would weigh the page down
MAX_ROWS = 1000  # jobs in one table: more are read, sorted, and cut here


def dashboard_router(get_log: Callable[[], "EventLog | None"]) -> APIRouter:
    """The pages; ``get_log``: the event log, for the live event stream and the telemetry stream."""
    r = APIRouter(route_class=PageRoute, include_in_schema=False, tags=["dashboard"])
    telemetry = LatestTelemetry(get_log)
    # a refresh of the cluster page at 1,000 nodes costs this process a few hundred ms: a big cluster's page
    # refreshes less often (every 10 s at 1,000 nodes)
    seen = {"nodes": 0}

    # --- session --------------------------------------------------------------------

    @r.get("/ui/login", response_class=HTMLResponse)
    async def login_form(request: Request, next: Annotated[str, Query(max_length=2000)] = "/") -> Response:
        return render(request, "login.html", next=local(next), error="")

    @r.post("/ui/login", response_class=HTMLResponse)
    async def login(request: Request) -> Response:
        """Check the token once, keep it in the session cookie. A form from another site is refused (login CSRF)."""
        origin = request.headers.get("origin")
        if origin and urlsplit(origin).netloc != request.headers.get("host"):
            return render(request, "error.html", 403, status=403, detail="a login form from another site is refused")
        form = parse_qs((await request.body()).decode(errors="replace")[:20_000])
        token, target = (form.get("token") or [""])[0].strip(), local((form.get("next") or ["/"])[0])
        if not token:
            return render(request, "login.html", 422, error="paste a token (gpuorch tokens create, or the admin token)",
                          next=target)
        try:
            await request.app.state.auth.principal(f"Bearer {token}")
        except (Unauthenticated, AttributeError) as e:
            return render(request, "login.html", 422, error=f"token refused: {e}", next=target)
        resp = RedirectResponse(target, 303)
        resp.set_cookie(SESSION_COOKIE, token, max_age=SESSION_MAX_AGE_S, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https", path="/")
        return resp

    @r.post("/ui/logout")
    async def logout(request: Request) -> Response:
        resp = RedirectResponse("/ui/login", 303)
        resp.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
        return resp

    @r.get("/ui/static/{name}")
    async def static(name: str) -> Response:
        if name not in STATIC:
            raise HTTPException(404, f"no file {name}")
        return FileResponse(HERE / "static" / name, media_type=STATIC[name], headers={"Cache-Control": "max-age=300"})

    # --- cluster --------------------------------------------------------------------

    @r.get("/", response_class=HTMLResponse)
    async def cluster(request: Request, model: Annotated[str, Query(max_length=100)] = "",
                      rack: Annotated[str, Query(max_length=100)] = "",
                      state: Annotated[str, Query(max_length=20)] = "",
                      part: Annotated[str, Query(max_length=20)] = "") -> Response:
        async def load() -> dict[str, Any]:
            t0 = time.perf_counter()
            async with api_of(request) as api:
                nodes, (jobs, _) = await asyncio.gather(api.get("/v1/nodes"), api.jobs(state=list(LIVE_STATES)))
            rows = views.node_rows(nodes, jobs, telemetry.latest())
            seen["nodes"] = len(rows)
            shown = [row for row in rows if views.row_matches(row, model, rack, state)]
            racks: dict[tuple[str, str], list[views.NodeRow]] = {}
            for row in shown:
                racks.setdefault((row.zone, row.rack), []).append(row)
            return dict(rows=shown, racks=racks, shown_summary=views.summary(shown), nodes=len(rows),
                        node_states=views.node_states(shown),
                        sick=views.sick_gpus([n for n in nodes if n["id"] in {row.id for row in shown}]),
                        models=sorted({m for row in rows for m in row.model.split("/")}),
                        rack_names=sorted({row.rack for row in rows if row.rack}),
                        built_ms=round((time.perf_counter() - t0) * 1000))

        context = dict(f_model=model, f_rack=rack, f_state=state, states=views.GPU_STATES + ("draining",),
                       live=live_url(request, "live"), every=max(5000, 10 * seen["nodes"]))
        if part == "live":
            return render(request, "cluster_live.html", **context, **await load())
        return render_streamed(request, "cluster.html", "cluster_live.html", load, **context)

    # --- queues ---------------------------------------------------------------------

    RANGES = {"1h": (3600, 30), "6h": (6 * 3600, 36), "24h": (86400, 48), "7d": (7 * 86400, 56)}

    @r.get("/ui/queues", response_class=HTMLResponse)
    async def queues(request: Request, window: Annotated[str, Query(alias="range", pattern="^(1h|6h|24h|7d)$")] = "1h",
                     part: Annotated[str, Query(max_length=20)] = "") -> Response:
        async def plot() -> dict[str, Any]:
            """GPUs held per queue over the window: one GET /v1/usage per interval (the exact figure of each)."""
            span, n = RANGES[window]
            now = time.time()
            edges = [now - span + span * i / n for i in range(n + 1)]
            async with api_of(request) as api:
                answers = await asyncio.gather(*(api.get("/v1/usage", since=f"{edges[i]:.3f}",
                                                         until=f"{edges[i + 1]:.3f}") for i in range(n)))
            return {"plot": views.usage_plot(edges, [{q: v["gpu_seconds"] for q, v in a["queues"].items()}
                                                     for a in answers])}

        context = dict(range=window, ranges=list(RANGES), live_table=live_url(request, "table"),
                       live_plot=live_url(request, "plot"))
        if part == "plot":
            return render(request, "queues_plot.html", **context, **await plot())
        async with api_of(request) as api:
            rows, scale = views.queue_rows(await api.get("/v1/queues"))
        if part == "table":
            return render(request, "queues_table.html", rows=rows, scale=scale, **context)
        return render_streamed(request, "queues.html", "queues_plot.html", plot, rows=rows, scale=scale, **context)

    # --- jobs -----------------------------------------------------------------------

    @r.get("/ui/jobs", response_class=HTMLResponse)
    async def jobs(request: Request, state: Annotated[str, Query(max_length=20)] = "active",
                   queue: Annotated[str, Query(max_length=200)] = "", user: Annotated[str, Query(max_length=128)] = "",
                   sort: Annotated[str, Query(pattern="^(age|state|queue|user|gpus|nodes|name)$")] = "age",
                   desc: Annotated[bool, Query()] = False,
                   part: Annotated[str, Query(max_length=20)] = "") -> Response:
        states = {"active": list(LIVE_STATES + PENDING_STATES), "pending": list(PENDING_STATES),
                  "running": list(LIVE_STATES), "finished": list(views.FINISHED), "all": []}.get(state, [state])
        me = request.state.principal

        async def load() -> dict[str, Any]:
            async with api_of(request) as api:
                found, more = await api.jobs(pages=5, state=states, queue=queue or None, owner=user or None)
            now = time.time()
            rows = views.sort_jobs([views.job_row(j, now) for j in found], sort, desc)
            owners = {j.get("owner") for j in found}
            return dict(rows=rows[:MAX_ROWS], more=more or len(rows) > MAX_ROWS,
                        show_user=me.role != "user" or len(owners) > 1 or bool(user))

        context = dict(f_state=state, f_queue=queue, f_user=user, sort=sort, desc=desc,
                       state_choices=["active", "pending", "running", "finished", "all", *LIVE_STATES,
                                      *PENDING_STATES, *views.FINISHED],
                       base={k: v for k, v in request.query_params.items() if k not in ("sort", "desc", "part")},
                       live=live_url(request, "live"))
        if part == "live":
            return render(request, "jobs_live.html", **context, **await load())
        async with api_of(request) as api:
            queue_names = [q["path"] for q in await api.get("/v1/queues")]
        return render_streamed(request, "jobs.html", "jobs_live.html", load, queues=queue_names,
                               show_user_filter=me.role != "user", **context)

    @r.get("/ui/jobs/{job_id}", response_class=HTMLResponse)
    async def job_page(request: Request, job_id: Annotated[str, Path(pattern=JOB_ID)],
                       part: Annotated[str, Query(max_length=20)] = "") -> Response:
        async with api_of(request) as api:
            job = await api.get(f"/v1/jobs/{job_id}", estimate="true")
            if "jobs" in job and "tasks" not in job:  # an array: its elements
                return render(request, "array.html", array=job)
            history = await api.get(f"/v1/jobs/{job_id}/events")
            nodes = sorted({p["node"] for p in job.get("placement") or ()})[:32]
            found = await asyncio.gather(*(api.call(f"/v1/nodes/{n}") for n in nodes))
            logs = None
            if part != "live" and (job.get("placement") or job.get("started_at")):
                try:  # the agent answers over the bus; a slow one leaves the following to the page's script
                    end = api.call(f"/v1/jobs/{job_id}/logs", task=0, tail_bytes=LOG_PAGE_BYTES)
                    resp = await asyncio.wait_for(end, LOGS_WAIT_S)
                    logs = resp.json() if resp.status_code == 200 else {"error": resp.json().get("detail"),
                                                                        "next_offset": 0}
                except TimeoutError:
                    logs = {"data": "", "next_offset": 0}
        index = {g["uuid"]: g["index"] for resp in found if resp.status_code == 200 for g in resp.json()["gpus"]}
        index |= {s["uuid"]: f"{g['index']}/{s['profile']}" for resp in found if resp.status_code == 200
                  for g in resp.json()["gpus"] for s in g.get("mig_slices") or ()}
        events = [{**e, "short": views.short_type(e.get("type", "")), "summary": views.event_summary(e)} for e in history]
        context = dict(job=job, events=events, index=index, logs=logs, live=live_url(request, "live"),
                       spec=json.dumps(job.get("spec"), indent=2), tasks=list(range(min(job.get("tasks", 1), 64))))
        return render(request, "job_live.html" if part == "live" else "job.html", **context)

    @r.get("/ui/jobs/{job_id}/logs")
    async def job_logs(request: Request, job_id: Annotated[str, Path(pattern=JOB_ID)],
                       task: Annotated[int, Query(ge=0, le=1023)] = 0,
                       stream: Annotated[str, Query(pattern="^(stdout|stderr)$")] = "stdout",
                       offset: Annotated[int, Query(ge=0, le=2**53)] = 0) -> Response:
        """The API's log chunk (JSON), for the page's live follow."""
        async with api_of(request) as api:
            resp = await api.call(f"/v1/jobs/{job_id}/logs", task=task, stream=stream, offset=offset)
        return JSONResponse(resp.json(), resp.status_code, headers={"Cache-Control": "no-store"})

    # --- events ---------------------------------------------------------------------

    @r.get("/ui/events", response_class=HTMLResponse)
    async def events(request: Request, type: Annotated[str, Query(max_length=200)] = "",
                     subject: Annotated[str, Query(max_length=200)] = "") -> Response:
        if subject and not _subject_ok(subject):
            raise HTTPException(422, f"subject must look like 'job' or 'job/<id>', got {subject[:200]!r}")
        evlog = get_log()
        head = await evlog.last_seq() if evlog is not None else 0
        async with api_of(request) as api:
            recent = await api.get("/v1/events", after=max(0, head - 200), type=type or None, subject=subject or None,
                                   limit=200)
        rows = [event_row(e) for e in reversed(recent)]
        stream = "/ui/events/stream?" + urlencode({k: v for k, v in (("type", type), ("subject", subject)) if v})
        return render(request, "events.html", rows=rows, f_type=type, f_subject=subject, stream=stream, head=head)

    @r.get("/ui/events/stream")
    async def event_stream(request: Request, type: Annotated[str | None, Query(max_length=200)] = None,
                           subject: Annotated[str | None, Query(pattern=SUBJECT)] = None,
                           after: Annotated[int | None, Query(ge=0, le=MAX_SEQ)] = None) -> Response:
        """The API's event stream (same role: operator), one JSON row per event, as the page shows it."""
        evlog = get_log()
        if evlog is None:
            raise HTTPException(503, "no event log in this process")
        last_id = request.headers.get("last-event-id", "")
        start = int(last_id) + 1 if last_id.isdigit() else (None if after is None else after + 1)
        subject_filter(subject)  # a bad subject is a 422 now, not a broken stream

        def frame(rec: Record) -> str:
            row = event_row(record_json(rec)) if not isinstance(rec, Undecodable) else \
                {"seq": rec.seq, "type": "undecodable", "summary": rec.reason}
            return f"id: {rec.seq}\ndata: {json.dumps(row)}\n\n"

        return StreamingResponse(sse(request, evlog, start, subject, type, frame, first=b"retry: 2000\n\n"),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-store"})

    return r



def _subject_ok(subject: str) -> bool:
    return re.fullmatch(SUBJECT, subject) is not None


def event_row(e: dict[str, Any]) -> dict[str, Any]:
    subject = e.get("subject") or ""
    return {"seq": e.get("seq"), "time": (e.get("time") or "")[:23].replace("T", " "),
            "type": views.short_type(e.get("type", "")), "subject": subject,
            "link": f"/ui/jobs/{subject.split('/', 1)[1]}" if subject.startswith("job/") else "",
            "summary": views.event_summary(e)}
