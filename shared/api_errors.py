"""How the API says no: one error body, the 4xx each route documents, the request body limit, path ids.

Every answer of 400 and above is ``ErrorBody``: ``{"detail": "a sentence"}``, or for a request
that does not validate (422) ``{"detail": [{"loc": [...], "msg": ..., "type": ...}, ...]}``, one
entry per bad field. ``document_errors`` lists in the OpenAPI document the statuses each route
can answer, from the role table (401/403), its path (404), its body (400/413/422) and what the
route itself declares with ``errors(...)`` (409, 429, ...), so a client can rely on both.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Path, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
import nats
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.auth import FORWARDED, PUBLIC, ROUTE_ROLES

MAX_BODY_BYTES = 1 << 20


class ErrorBody(BaseModel):
    """Every error answer: why, in a sentence a person can act on; or (422) one entry per bad field."""

    detail: str | list[dict[str, Any]]


WHY = {
    400: "the body is not JSON text (UTF-8)",
    401: "no token, or one that is unknown, revoked or expired (WWW-Authenticate: Bearer)",
    403: "the caller's role, groups or the queue's max_priority do not allow this",
    404: "no such object, or one the caller may not see (the same answer)",
    409: "the current state does not allow this (the reason says what to do first)",
    415: "the body's Content-Type is not one the route reads: JSON (POST /v1/jobs also reads YAML and sbatch "
         "scripts)",
    413: f"the request body is larger than the server's max_body_bytes (default {MAX_BODY_BYTES} bytes)",
    422: "a field, parameter or combination the server refuses, with the reason",
    429: "the caller submits faster than its rate (Retry-After says when to try again)",
    502: "the node agent answered something unreadable",
    503: "the event log (NATS) or the node agent is unavailable for now, or the service has not caught up with "
         "the log: retry (Retry-After)",
}


ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for statuses only this route answers (409, 429, ...), each with the error body."""
    return {code: {"model": ErrorBody, "description": WHY[code]} for code in codes}


def route_errors(method: str, path: str, operation: dict[str, Any]) -> list[int]:
    """The 4xx any operation can answer, from what it is: non-public (401, 403), looking up path ids (404),
    sent with a body (413), taking a JSON body (400, 415, 422) or parameters (422)."""
    codes = []
    if ROUTE_ROLES.get((method, path)) not in (PUBLIC, FORWARDED):
        codes += [401, 403, 503]
    if "{" in path and method != "PUT":  # a PUT creates what its path names
        codes.append(404)
    if method in ("POST", "PUT", "PATCH"):
        codes.append(413)
    if "requestBody" in operation:
        codes += [400, 415]
    if "requestBody" in operation or operation.get("parameters"):
        codes.append(422)
    return codes


def document_errors(doc: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI document with every operation's error statuses (``route_errors``, beside those it declared),
    each answering ``ErrorBody``: FastAPI's own 422 schema (a list only) is replaced."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["ErrorBody"] = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    for path, operations in doc.get("paths", {}).items():
        for method, op in operations.items():
            responses = op.setdefault("responses", {})
            for code in route_errors(method.upper(), path, op):
                if code == 422 or str(code) not in responses:
                    responses[str(code)] = {"description": WHY[code],
                                            "content": {"application/json": {"schema": ERROR_REF}}}
    for unused in ("HTTPValidationError", "ValidationError"):
        if f"#/components/schemas/{unused}" not in json.dumps(doc):
            schemas.pop(unused, None)
    return doc


# --- answers ---------------------------------------------------------------------------


def _json_safe(value: Any) -> Any:
    """A refused input echoed back: inf, NaN and bytes that are not UTF-8 are no JSON, so they are shown as text."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


SHOWN_INPUT_CHARS = 200
SECRET_FIELDS = frozenset({"secret_env", "token", "password"})


def _shown(error: dict[str, Any]) -> dict[str, Any]:
    """One refused field as answered: its own value (cut to SHOWN_INPUT_CHARS), never an object or list around it
    (a missing field's 'input' is the whole body), nor anything under a secret field."""
    out = dict(error)
    value = out.get("input")
    if isinstance(value, (dict, list, tuple)) or SECRET_FIELDS & {str(x) for x in out.get("loc", ())}:
        out.pop("input", None)
    elif isinstance(value, (str, bytes)) and len(value) > SHOWN_INPUT_CHARS:
        out["input"] = f"{_json_safe(value[:SHOWN_INPUT_CHARS])}... ({len(value)} characters)"
    return out


def body_mime(request: Request) -> str:
    """The request's Content-Type without parameters, in lower case ("" if none)."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def read_as_json(mime: str) -> bool:
    """Whether a body of this Content-Type reaches a route's model as JSON (none given: FastAPI reads JSON too)."""
    return mime in ("", "application/json") or mime.endswith("+json")


def _unread_body(request: Request, errors: Sequence[Any]) -> str | None:
    """Why the body was refused if the route never read it as JSON: sent with another Content-Type (``curl -d``
    sends a form's), it reaches the model as text, which the model refuses as 'not a dictionary'."""
    mime = body_mime(request)
    if read_as_json(mime):
        return None
    if not any(tuple(e.get("loc", ())) == ("body",) and isinstance(e.get("input"), (str, bytes)) for e in errors):
        return None
    return (f"the body was sent as {mime}, which {request.method} {request.url.path} does not read: send JSON with "
            "Content-Type: application/json (curl -d sends a form: add -H 'Content-Type: application/json')")


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    if (why := _unread_body(request, exc.errors())) is not None:
        return JSONResponse({"detail": why}, status_code=415)
    return JSONResponse({"detail": jsonable_encoder(_json_safe([_shown(e) for e in exc.errors()]))}, status_code=422)


class Unavailable(Exception):
    """A condition that passes (a service still folding the log): 503 with the reason, and Retry-After."""


async def unavailable(request: Request, exc: Unavailable) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "1"})


BUS_ERRORS = (TimeoutError, ConnectionError, nats.errors.Error)  # asyncio.TimeoutError is TimeoutError (3.11)


async def bus_unavailable(request: Request, exc: Exception) -> JSONResponse:
    """The event log did not answer (a NATS failover, an outage): nothing was promised, the client retries."""
    return JSONResponse({"detail": f"the event log is unavailable for now ({type(exc).__name__}); retry"},
                        status_code=503, headers={"Retry-After": "1"})


async def http_error(request: Request, exc: StarletteHTTPException) -> Any:
    """FastAPI's answer, except that a 405 names every method of the path (Starlette names one route's)."""
    if exc.status_code == 405:
        exc.headers = {**(exc.headers or {}), "Allow": ", ".join(allowed_methods(request))}
    return await http_exception_handler(request, exc)


def allowed_methods(request: Request) -> list[str]:
    """The methods some route serves at this request's path."""
    scope = {"type": "http", "path": request.scope["path"], "root_path": request.scope.get("root_path", "")}
    return [m for m in ("GET", "POST", "PUT", "PATCH", "DELETE")
            if any(r.matches({**scope, "method": m})[0] == Match.FULL for r in request.app.router.routes)]


class BodyLimit:
    """413 for a request body above ``max_bytes``: at once when Content-Length says so, else as soon as
    the bytes read pass it, before anything parses them (one request becomes one event on the bus)."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            refusal = JSONResponse({"detail": self.detail}, 413, headers={"connection": "close"})
            return await refusal(scope, receive, send)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPException(413, self.detail)  # FastAPI passes an HTTPException from the body through
            return message

        await self.app(scope, limited, send)

    @property
    def detail(self) -> str:
        return f"the request body is larger than {self.max_bytes} bytes (max_body_bytes)"


def install(app: FastAPI, max_body_bytes: int = MAX_BODY_BYTES) -> None:
    """The error body everywhere, the body limit, and the statuses in the OpenAPI document (of every route,
    also those added after this call)."""
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    for error in BUS_ERRORS:
        app.add_exception_handler(error, bus_unavailable)
    app.add_exception_handler(Unavailable, unavailable)  # type: ignore[arg-type]
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document_errors(FastAPI.openapi(app))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# --- path ids --------------------------------------------------------------------------


def path_id(name: str, pattern: str, noun: str) -> Any:
    """A path parameter documented with ``pattern``; a value that could not name one answers 404, as one
    that does not exist does (same body), before it reaches a lookup or a NATS subject."""
    rx = re.compile(pattern)

    async def check(value: str) -> str:  # async: a plain def would run in the thread pool, a handoff per request
        if not rx.fullmatch(value):
            raise HTTPException(404, f"no {noun} {value}")
        return value

    check.__annotations__["value"] = Annotated[str, Path(alias=name, json_schema_extra={"pattern": pattern})]
    return Annotated[str, Depends(check)]
