"""Operator actions on nodes: cordon, drain, resume."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from shared import events as ev
from shared.runtime import Service


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grace_s: int = Field(default=300, ge=0, le=86400)
    reason: str = Field(default="operator", max_length=500)


class CordonRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field(default="operator", max_length=500)


def router(svc: Service) -> APIRouter:
    r = APIRouter(tags=["nodes"])
    proj = svc.projection

    def _known(node_id: str) -> None:
        if node_id not in proj.nodes:
            raise HTTPException(404, f"no node {node_id}")

    @r.post("/v1/nodes/{node_id}/cordon")
    async def cordon(node_id: str, body: CordonRequest | None = None) -> dict[str, Any]:
        _known(node_id)
        seq = (await svc.emit(ev.NodeCordoned(node_id=node_id, reason=(body or CordonRequest()).reason)))[0]
        await svc.caught_up(seq)
        return {"node": node_id, "cordoned": True, "seq": seq}

    @r.post("/v1/nodes/{node_id}/drain")
    async def drain(node_id: str, body: DrainRequest | None = None) -> dict[str, Any]:
        _known(node_id)
        body = body or DrainRequest()
        seq = (await svc.emit(ev.NodeDrainRequested(node_id=node_id, grace_s=body.grace_s, reason=body.reason)))[0]
        await svc.caught_up(seq)
        return {"node": node_id, "draining": True, "grace_s": body.grace_s, "seq": seq}

    @r.post("/v1/nodes/{node_id}/resume")
    async def resume(node_id: str) -> dict[str, Any]:
        _known(node_id)
        seq = (await svc.emit(ev.NodeResumed(node_id=node_id)))[0]
        await svc.caught_up(seq)
        return {"node": node_id, "cordoned": False, "seq": seq}

    return r
