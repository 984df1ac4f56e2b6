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

from services.jobfiles import (Context, JobFileError, Loaded, is_manifest, is_sbatch, load_documents, load_text,
                               parse_documents)
from shared.api_errors import body_mime, read_as_json

YAML = {"application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml", "application/vnd.kubernetes+yaml"}
SHELL = {"text/x-shellscript", "application/x-shellscript", "application/x-sh", "text/x-sh"}  # an sbatch script
READ = ("a JobRequest or a Kubernetes manifest as JSON (Content-Type: application/json) or YAML (application/yaml), "
        "or an sbatch script (text/x-shellscript)")


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


def _text(body: bytes) -> str:
    try:
        return body.decode()
    except UnicodeDecodeError:
        raise HTTPException(400, "the body is not UTF-8 text") from None


def _loaded(request: Request, body: bytes, context: Callable[[], Context]) -> Loaded | None:
    """The body's jobs if it is YAML, an sbatch script or a JSON manifest; None to leave it to the route as it is
    (a JobRequest or a list of them, in JSON). Another Content-Type is 415: ``curl -d`` sends a form's."""
    mime = body_mime(request)
    try:
        if mime in SHELL:
            text = _text(body)
            if not is_sbatch(text):
                raise JobFileError("the body is not an sbatch script: it starts with no #! line and holds no "
                                   "#SBATCH line")
            return load_text(text, "sbatch", context())
        if mime in YAML:
            docs = parse_documents(_text(body), "the request body")
        elif read_as_json(mime):
            try:
                doc = json.loads(body)
            except ValueError:
                return None  # the route says why
            if not is_manifest(doc):
                return None
            docs = parse_documents(body.decode(), "the request body", as_json=True)
        else:
            raise HTTPException(415, f"the body was sent as {mime}, which POST /v1/jobs does not read: send {READ} "
                                     "(curl -d sends a form: add -H 'Content-Type: application/json')")
        return load_documents(docs, "the request body", context())
    except JobFileError as e:
        raise HTTPException(422, str(e)) from None


def untagged(err: dict[str, Any]) -> dict[str, Any]:
    """An error of the one-or-batch body without the branch's tag: ``["body", "one", "command"]`` is
    ``["body", "command"]``, ``["body", "batch", 2, "command"]`` is ``["body", 2, "command"]``."""
    loc = tuple(err.get("loc", ()))
    if loc[:1] == ("body",) and loc[1:2] in (("one",), ("batch",)):
        return {**err, "loc": ("body", *loc[2:])}
    return err


async def as_job_request(request: Request, context: Callable[[], Context]) -> Request:
    body = await request.body()
    loaded = _loaded(request, body, context) if body else None
    if loaded is None:
        return request
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
