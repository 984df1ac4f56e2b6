"""Node inventory API: every node with its GPUs, links, health and allocation."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException

from shared.agentctl import AgentError, XidRequest, ask
from shared.api_errors import errors, path_id
from shared.cluster import NodeState
from shared.model import NODE_ID
from shared.runtime import Service


def node_state(node: NodeState) -> str:
    if node.lost:
        return "lost"
    if node.draining:
        return "draining"
    if node.cordoned:
        return "cordoned"
    return "allocated" if node.gpu_alloc else "idle"


def node_view(node: NodeState) -> dict[str, Any]:
    info = node.info
    domains = sorted({g.nvlink_domain for g in info.gpus if g.nvlink_domain})
    return {
        "id": info.node_id,
        "state": node_state(node),
        "labels": info.labels,
        "rack": info.rack,
        "zone": info.zone,
        "pool": info.pool,
        "agent_url": info.agent_url or None,
        "cpu_milli": info.cpu_milli,
        "memory_mib": info.memory_mib,
        "cpu_allocated": node.cpu_alloc,
        "memory_allocated": node.mem_alloc,
        "nvlink_domains": domains,
        "gpus": [
            {
                **g.model_dump(mode="json"),
                "mig_slices": [{**m.model_dump(mode="json"), "allocated": m.uuid in node.gpu_alloc} for m in g.mig_slices],
                "allocated_milli": node.gpu_alloc.get(g.uuid, 0),
                "health": "unhealthy" if g.uuid in node.unhealthy or not g.healthy else "healthy",
                "health_reason": node.unhealthy.get(g.uuid, g.error or ""),
            }
            for g in info.gpus
        ],
    }


NodeIdPath = path_id("node_id", NODE_ID, "node")


def router(svc: Service) -> APIRouter:
    r = APIRouter(tags=["nodes"])
    proj = svc.projection

    @r.get("/v1/nodes")
    async def list_nodes() -> list[dict[str, Any]]:
        # thousands of nodes: their views in a thread while no fold runs (the loop answers meanwhile)
        return await svc.read_in_thread(lambda: [node_view(n) for n in proj.nodes.values()])

    @r.get("/v1/nodes/{node_id}")
    async def get_node(node_id: NodeIdPath) -> dict[str, Any]:
        node = proj.nodes.get(node_id)
        if node is None:
            raise HTTPException(404, f"no node {node_id}")
        return node_view(node)

    @r.post("/v1/nodes/{node_id}/inject-xid", responses=errors(502, 503))
    async def inject_xid(node_id: NodeIdPath, body: XidRequest) -> dict[str, Any]:
        """Simulated nodes only: one of its GPUs reports this XID as a driver would (watch health act)."""
        if node_id not in proj.nodes:
            raise HTTPException(404, f"no node {node_id}")
        assert svc.log is not None
        try:
            return await ask(svc.log.nc, node_id, "inject-xid", body)
        except AgentError as e:
            raise HTTPException(e.status, e.detail) from None

    return r
