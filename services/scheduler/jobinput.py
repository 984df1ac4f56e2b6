"""POST /v1/jobs bodies that are not a JobRequest in JSON: a Kubernetes-family manifest (YAML or JSON) or a
JobRequest in YAML, translated by services.jobfiles into the JobRequest JSON the route validates, with the
translation's warnings in ``request.state.jobfile_warnings`` (one list per job). A body holding several jobs
becomes a batch: the JSON list of their JobRequests."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from services.jobfiles import Context, JobFileError, is_manifest, load_documents, parse_documents

YAML = {"application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml", "application/vnd.kubernetes+yaml"}


def manifest_route(context: Callable[[], Context], path: str = "/v1/jobs") -> type[APIRoute]:
    """A route class that reads POST ``path`` bodies as manifests where they are (``context``: the cluster now)."""

    class ManifestRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
            handler = super().get_route_handler()
            if self.path != path or "POST" not in self.methods:
                return handler

            async def route(request: Request) -> Response:
                try:
                    return await handler(await as_job_request(request, context))
                except RequestValidationError as e:
                    raise RequestValidationError([untagged(err) for err in e.errors()], body=e.body) from None

            return route

    return ManifestRoute


def _docs(request: Request, body: bytes) -> list[Any] | None:
    """The body's documents if it is YAML or a JSON manifest; None to leave it to the route as it is."""
    mime = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if mime in YAML:
        try:
            text = body.decode()
        except UnicodeDecodeError:
            raise HTTPException(400, "the body is not UTF-8 text") from None
        try:
            return parse_documents(text, "the request body")
        except JobFileError as e:
            raise HTTPException(422, str(e)) from None
    if mime not in ("", "application/json") and not mime.endswith("+json"):
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None  # the route says why
    return parse_documents(body.decode(), "the request body", as_json=True) if is_manifest(doc) else None


def untagged(err: dict[str, Any]) -> dict[str, Any]:
    """An error of the one-or-batch body without the branch's tag: ``["body", "one", "command"]`` is
    ``["body", "command"]``, ``["body", "batch", 2, "command"]`` is ``["body", 2, "command"]``."""
    loc = tuple(err.get("loc", ()))
    if loc[:1] == ("body",) and loc[1:2] in (("one",), ("batch",)):
        return {**err, "loc": ("body", *loc[2:])}
    return err


async def as_job_request(request: Request, context: Callable[[], Context]) -> Request:
    body = await request.body()
    docs = _docs(request, body) if body else None
    if docs is None:
        return request
    try:
        loaded = load_documents(docs, "the request body", context())
    except JobFileError as e:
        raise HTTPException(422, str(e)) from None
    if not loaded.jobs:
        raise HTTPException(422, "the body holds no job")
    body_notes = [*loaded.notes, *(f"{q.origin}: a queue is applied with PUT /v1/queues/{q.path} (gpuorch queues "
                                   "apply -f): skipped" for q in loaded.queues)]
    warnings = [[*job.warnings, *body_notes] for job in loaded.jobs]
    jobs = [job.job for job in loaded.jobs]
    data = json.dumps(jobs[0] if len(jobs) == 1 else jobs).encode()
    request.scope["headers"] = [(k, v) for k, v in request.scope["headers"] if k not in (b"content-type",
                                                                                        b"content-length")]
    request.scope["headers"] += [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    translated = Request(request.scope, request.receive)
    translated._body = data  # what the route reads: starlette keeps a read body here
    translated.state.jobfile_warnings = warnings
    return translated
