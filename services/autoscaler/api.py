"""Pools and inference deployments."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared import events as ev
from shared.model import GpuConstraints, TaskResources, valid_queue_path
from shared.profiles import PROFILES
from shared.runtime import Service

if TYPE_CHECKING:
    from services.autoscaler.service import Autoscaler

NAME = r"^[a-z0-9][a-z0-9-]{0,40}$"


class PoolRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    profile: str
    min_nodes: int = Field(0, ge=0, le=10_000)
    max_nodes: int = Field(ge=0, le=10_000)
    provision_delay_s: float = Field(0, ge=0, le=86400)
    idle_timeout_s: float = Field(600, ge=0, le=30 * 86400)
    cost_per_node_hour: float = Field(0.0, ge=0)
    hourly_cost_cap: float | None = Field(None, ge=0)
    provider: Literal["simulated", "command"] = "simulated"
    provision_command: list[str] = []
    terminate_command: list[str] = []

    @model_validator(mode="after")
    def _check(self) -> "PoolRequest":
        if self.min_nodes > self.max_nodes:
            raise ValueError("min_nodes is above max_nodes")
        if self.provider == "simulated" and self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; simulated profiles: {', '.join(PROFILES)}")
        if self.provider == "command" and not (self.provision_command and self.terminate_command):
            raise ValueError("a command provider needs provision_command and terminate_command")
        return self


class DeploymentRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    queue: str = "default"
    resources: TaskResources = TaskResources()
    gpu: GpuConstraints = GpuConstraints()
    command: list[str]
    env: dict[str, str] = {}
    min_replicas: int = Field(0, ge=0, le=1000)
    max_replicas: int = Field(1, ge=1, le=1000)
    target_pending_per_replica: float = Field(1.0, gt=0)
    stabilization_s: float = Field(60, ge=0, le=3600)
    scale_to_zero_after_s: float = Field(300, ge=0)

    @model_validator(mode="after")
    def _check(self) -> "DeploymentRequest":
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas is above max_replicas")
        if not valid_queue_path(self.queue):
            raise ValueError("queue is a dotted path of lowercase names")
        return self


class MetricsPost(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pending_requests: float = Field(ge=0)


def router(svc: Service, scaler: "Autoscaler") -> APIRouter:
    r = APIRouter(tags=["autoscaler"])
    proj = scaler.proj

    @r.put("/v1/pools/{name}")
    async def put_pool(name: str, body: PoolRequest) -> dict[str, Any]:
        import re

        if not re.match(NAME, name):
            raise HTTPException(422, "pool name: lowercase letters, digits and '-'")
        seq = (await svc.emit(ev.PoolDefined(pool=name, **body.model_dump())))[0]
        await svc.caught_up(seq)
        return {"name": name, **body.model_dump(), "seq": seq}

    @r.get("/v1/pools")
    def list_pools() -> list[dict[str, Any]]:
        out = []
        for name, p in sorted(proj.pools.items()):
            nodes = p["nodes"]
            out.append({"name": name, **p["spec"], "provider": p["provider"]["kind"], "nodes": nodes,
                        "in_flight": p["in_flight"], "cost_per_hour": len(nodes) * p["spec"]["cost_per_node_hour"]})
        return out

    @r.put("/v1/deployments/{name}")
    async def put_deployment(name: str, body: DeploymentRequest) -> dict[str, Any]:
        import re

        if not re.match(NAME, name):
            raise HTTPException(422, "deployment name: lowercase letters, digits and '-'")
        job = {"name": name, "queue": body.queue, "resources": body.resources.model_dump(), "gpu": body.gpu.model_dump(),
               "command": body.command, "env": body.env}
        spec = {**body.model_dump(exclude={"queue", "resources", "gpu", "command", "env"}), "job": job}
        seq = (await svc.emit(ev.DeploymentDefined(name=name, spec=spec)))[0]
        await svc.caught_up(seq)
        return {"name": name, **spec, "seq": seq}

    @r.get("/v1/deployments")
    def list_deployments() -> list[dict[str, Any]]:
        return [{"name": k, **v, "live_replicas": len(scaler.replicas_of(k)),
                 "pending_requests": scaler.metrics_in.get(k, (0.0, 0.0))[0]} for k, v in sorted(proj.deployments.items())]

    @r.post("/v1/deployments/{name}/metrics")
    def post_metrics(name: str, body: MetricsPost) -> dict[str, Any]:
        if name not in proj.deployments:
            raise HTTPException(404, f"no deployment {name}")
        scaler.metrics_in[name] = (body.pending_requests, time.time())
        return {"name": name, "pending_requests": body.pending_requests}

    return r
