"""The history API: ``GET /v1/events`` (paged) and ``GET /v1/events/stream`` (server-sent events)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import StreamingResponse

from shared.eventlog import EventLog, Record, Undecodable
from shared.events import CE_PREFIX, SUBJECT_PREFIX, subject_token
from shared.redact import redact


def record_json(rec: Record) -> dict[str, Any]:
    """One stored event as the API shows it: its sequence and CloudEvent, secret values masked."""
    if isinstance(rec, Undecodable):
        return {"seq": rec.seq, "undecodable": rec.reason}
    return {"seq": rec.seq, **redact(rec.to_cloudevent())}


# an aggregate, or an aggregate and its id: never a NATS wildcard, a space or an empty token
SUBJECT = r"^[a-z_]{1,40}(/[A-Za-z0-9_][A-Za-z0-9_.:@+-]{0,127})?$"
MAX_SEQ = 2**53  # stream sequences are below this (and stay exact in JSON numbers)


def subject_filter(subject: str | None) -> list[str] | None:
    """``job/j-1`` or ``job`` (CloudEvents subject or aggregate) -> NATS subject filters."""
    if not subject:
        return None
    if not re.fullmatch(SUBJECT, subject):
        raise HTTPException(422, f"subject must look like 'job' or 'job/<id>', got {subject[:300]!r}")
    aggregate, _, ident = subject.partition("/")
    return [f"{SUBJECT_PREFIX}.{aggregate}.{subject_token(ident) if ident else '>'}"]


async def sse(request: Request, log: EventLog, start: int | None, subject: str | None, type_: str | None,
              frame: Callable[[Record], str], first: bytes = b"") -> AsyncIterator[bytes]:
    """Server-sent events: the log's events from ``start`` (None: only new ones) on ``subject``, of ``type_``,
    each written by ``frame``; a comment keeps an idle connection open; it ends when the client leaves."""
    subjects = subject_filter(subject)
    follower = log.follow(start, subjects[0] if subjects else f"{SUBJECT_PREFIX}.>")
    try:
        if first:
            yield first
        async for rec in follower:
            if await request.is_disconnected():
                break
            if rec is None:
                yield b": keep-alive\n\n"
            elif type_matches(rec, type_):
                yield frame(rec).encode()
    finally:
        await follower.aclose()


def type_matches(rec: Record, type_: str | None) -> bool:
    if not type_:
        return True
    if isinstance(rec, Undecodable):
        return False
    return rec.type == type_ or rec.type.startswith(f"{CE_PREFIX}{type_}.v") or rec.data.TYPE == type_


def events_router(get_log: Callable[[], EventLog]) -> APIRouter:
    r = APIRouter(tags=["events"])

    @r.get("/v1/events")
    async def list_events(
        after: Annotated[int, Query(ge=0, le=MAX_SEQ)] = 0,
        type: Annotated[str | None, Query(max_length=200)] = None,
        subject: Annotated[str | None, Query(pattern=SUBJECT)] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    ) -> list[dict[str, Any]]:
        log = get_log()
        out: list[dict[str, Any]] = []
        async for rec in log.replay(after + 1, subject_filter(subject), batch=min(1000, max(limit, 100))):
            if type_matches(rec, type):
                out.append(record_json(rec))
                if len(out) >= limit:
                    break
        return out

    @r.get("/v1/events/stream")
    async def stream_events(
        request: Request,
        after: Annotated[int | None, Query(ge=0, le=MAX_SEQ, description="default: only new events")] = None,
        type: Annotated[str | None, Query(max_length=200)] = None,
        subject: Annotated[str | None, Query(pattern=SUBJECT)] = None,
    ) -> StreamingResponse:
        subject_filter(subject)  # a bad subject is a 422 now, not a broken stream

        def frame(rec: Record) -> str:
            kind = "undecodable" if isinstance(rec, Undecodable) else rec.type
            return f"id: {rec.seq}\nevent: {kind}\ndata: {json.dumps(record_json(rec))}\n\n"

        return StreamingResponse(sse(request, get_log(), None if after is None else after + 1, subject, type, frame),
                                 media_type="text/event-stream")

    return r
