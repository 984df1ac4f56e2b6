"""Operator actions on nodes: cordon, drain, resume."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from shared import events as ev
from shared.api_errors import path_id
from shared.auth import Principal, caller
from shared.model import NODE_ID, Int
from shared.runtime import Service


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grace_s: Int = Field(default=300, ge=0, le=86400)
    reason: str = Field(default="operator", max_length=500)


class CordonRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field(default="operator", max_length=500)


Caller = Annotated[Principal, Depends(caller)]
NodeIdPath = path_id("node_id", NODE_ID, "node")


def router(svc: Service) -> APIRouter:
    r = APIRouter(tags=["nodes"])
    proj = svc.projection

    def _known(node_id: str) -> None:
        if node_id not in proj.nodes:
            raise HTTPException(404, f"no node {node_id}")

    @r.post("/v1/nodes/{node_id}/cordon")
    async def cordon(node_id: NodeIdPath, p: Caller, body: CordonRequest | None = None) -> dict[str, Any]:
        """Stop placing work on the node and keep it so (health's rules will not resume it); a node an operator
        already holds cordoned changes nothing (``changed``)."""
        _known(node_id)
        if proj.nodes[node_id].cordoned and node_id in proj.manual:
            return {"node": node_id, "cordoned": True, "seq": proj.seq, "changed": False}
        seq = (await svc.emit(ev.NodeCordoned(node_id=node_id, reason=(body or CordonRequest()).reason), actor=p.user))[0]
        await svc.caught_up(seq)
        return {"node": node_id, "cordoned": True, "seq": seq, "changed": True}

    @r.post("/v1/nodes/{node_id}/drain")
    async def drain(node_id: NodeIdPath, p: Caller, body: DrainRequest | None = None) -> dict[str, Any]:
        _known(node_id)
        body = body or DrainRequest()
        seq = (await svc.emit(ev.NodeDrainRequested(node_id=node_id, grace_s=body.grace_s, reason=body.reason), actor=p.user))[0]
        await svc.caught_up(seq)
        return {"node": node_id, "draining": True, "grace_s": body.grace_s, "seq": seq}

    @r.post("/v1/nodes/{node_id}/resume")
    async def resume(node_id: NodeIdPath, p: Caller) -> dict[str, Any]:
        """Make the node schedulable again (and forget its sick GPUs); one that is already changes nothing."""
        _known(node_id)
        node = proj.nodes[node_id]
        if not (node.cordoned or node.draining or node.unhealthy):
            return {"node": node_id, "cordoned": False, "seq": proj.seq, "changed": False}
        seq = (await svc.emit(ev.NodeResumed(node_id=node_id), actor=p.user))[0]
        await svc.caught_up(seq)
        return {"node": node_id, "cordoned": False, "seq": seq, "changed": True}

    return r
