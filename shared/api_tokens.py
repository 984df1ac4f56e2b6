"""The token API (admins): issue, list and revoke API tokens; each issue and revocation is an event (audit)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from shared import events as ev
from shared.api_errors import path_id
from shared.auth import NAME, Principal, Role, TokenRecord, caller
from shared.eventlog import EventLog
from shared.events import Envelope
from shared.model import JsonNumber

TokenId = path_id("token_id", r"^[0-9a-f]{12}$", "token")


class TokenRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user: str = Field(pattern=NAME)
    groups: list[Annotated[str, Field(pattern=NAME)]] = Field(default=[], max_length=64)
    role: Role = "user"
    name: str = Field("", max_length=200)
    expires_in_s: Annotated[int, Field(ge=60, le=10 * 366 * 86400), JsonNumber] | None = None


def token_view(rec: TokenRecord) -> dict[str, Any]:
    return rec.model_dump(mode="json")


def tokens_router(get_log: Callable[[], EventLog]) -> APIRouter:
    r = APIRouter(tags=["tokens"])

    @r.post("/v1/tokens", status_code=201)
    async def issue(body: TokenRequest, request: Request, p: Annotated[Principal, Depends(caller)]) -> dict[str, Any]:
        """A new token for a user; the token is shown once, in this answer, and stored only as its hash."""
        expires = time.time() + body.expires_in_s if body.expires_in_s else None
        token, rec = await request.app.state.auth.tokens.create(body.user, body.groups, body.role, name=body.name,
                                                               expires_at=expires)
        await get_log().append(Envelope(ev.TokenIssued(token_id=rec.id, user=rec.user, groups=rec.groups, role=rec.role,
                                                       expires_at=rec.expires_at),
                                        source="/gpuorch/api", actor=p.user))
        return {"token": token, **token_view(rec)}

    @r.get("/v1/tokens")
    async def list_tokens(request: Request) -> list[dict[str, Any]]:
        return [token_view(rec) for _, rec in await request.app.state.auth.tokens.records()]

    @r.delete("/v1/tokens/{token_id}")
    async def revoke(token_id: TokenId, request: Request, p: Annotated[Principal, Depends(caller)]) -> dict[str, Any]:
        rec = await request.app.state.auth.tokens.revoke(token_id)
        if rec is None:
            raise HTTPException(404, f"no token {token_id}")
        await get_log().append(Envelope(ev.TokenRevoked(token_id=rec.id, user=rec.user), source="/gpuorch/api", actor=p.user))
        return {**token_view(rec), "revoked": True}

    return r
