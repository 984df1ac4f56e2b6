"""Pools and deployments (reads; scaling grows in the autoscaler issue)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from shared.runtime import Service


def router(svc: Service) -> APIRouter:
    r = APIRouter(tags=["autoscaler"])
    proj = svc.projection

    @r.get("/v1/pools")
    def list_pools() -> list[dict[str, Any]]:
        return [{"name": k, **v} for k, v in sorted(proj.pools.items())]

    @r.get("/v1/deployments")
    def list_deployments() -> list[dict[str, Any]]:
        return [{"name": k, **v} for k, v in sorted(proj.deployments.items())]

    return r
