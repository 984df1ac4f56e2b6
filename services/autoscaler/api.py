"""Pools and inference deployments."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path
from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared import events as ev
from shared.api_errors import errors, path_id
from shared.redact import redact
from shared.auth import Principal, caller
from shared.model import (MAX_ENV_BYTES, QUEUE_PATH, RESOURCE_NAME, EnvMap, Float, GpuConstraints, Int, JsonNumber,
                          NoNul, TaskResources, env_bytes)
from shared.profiles import PROFILES
from shared.runtime import Service

if TYPE_CHECKING:
    from services.autoscaler.service import Autoscaler

NAME = RESOURCE_NAME  # the events carry the same constraint
NamePath = Annotated[str, Path(pattern=NAME, description="lowercase letters, digits and '-'")]
KnownDeployment = path_id("name", NAME, "deployment")
KnownPool = path_id("name", NAME, "pool")
REQUEST = ConfigDict(extra="forbid", allow_inf_nan=False)


class PoolRequest(BaseModel):
    model_config = REQUEST
    profile: str
    min_nodes: Int = Field(0, ge=0, le=10_000)
    max_nodes: Int = Field(ge=0, le=10_000)
    provision_delay_s: Float = Field(0, ge=0, le=86400)
    idle_timeout_s: Float = Field(600, ge=0, le=30 * 86400)
    cost_per_node_hour: Float = Field(0.0, ge=0, le=1e6)
    hourly_cost_cap: Annotated[float, Field(ge=0, le=1e9), JsonNumber] | None = None
    provider: str = "simulated"  # a provider's name: its commands live in the server's providers file, never here

    @model_validator(mode="after")
    def _check(self) -> "PoolRequest":
        if self.min_nodes > self.max_nodes:
            raise ValueError("min_nodes is above max_nodes")
        if self.profile not in PROFILES:  # planning needs the node's shape, whoever provides it
            raise ValueError(f"unknown profile {self.profile!r}; profiles: {', '.join(PROFILES)}")
        return self


class DeploymentRequest(BaseModel):
    model_config = REQUEST
    queue: str = Field("default", pattern=QUEUE_PATH)
    resources: TaskResources = TaskResources()
    gpu: GpuConstraints = GpuConstraints()
    command: list[NoNul] = Field(min_length=1, max_length=4096)
    env: EnvMap = {}
    secret_env: EnvMap = Field({}, description="given to replicas, never shown")
    min_replicas: Int = Field(0, ge=0, le=1000)
    max_replicas: Int = Field(1, ge=1, le=1000)
    target_pending_per_replica: Float = Field(1.0, gt=0, le=1e6)
    stabilization_s: Float = Field(60, ge=0, le=3600)
    scale_to_zero_after_s: Float = Field(300, ge=0, le=30 * 86400)

    @model_validator(mode="after")
    def _check(self) -> "DeploymentRequest":
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas is above max_replicas")
        if (n := env_bytes(self.env, self.secret_env)) > MAX_ENV_BYTES:  # as JobSpec: each replica is a job
            raise ValueError(f"env and secret_env take {n} bytes as NAME=value; at most {MAX_ENV_BYTES} (128 KiB)")
        return self


class MetricsPost(BaseModel):
    model_config = REQUEST
    pending_requests: Float = Field(ge=0, le=1e9)


def router(svc: Service, scaler: "Autoscaler") -> APIRouter:
    r = APIRouter(tags=["autoscaler"])
    secret_name = re.compile(scaler.settings.secret_env_pattern)
    proj = scaler.proj

    @r.put("/v1/pools/{name}")
    async def put_pool(name: NamePath, body: PoolRequest, p: Annotated[Principal, Depends(caller)]) -> dict[str, Any]:
        if body.provider not in scaler.provider_names():
            raise HTTPException(422, f"unknown provider {body.provider!r}; configured providers: {', '.join(scaler.provider_names())}")
        seq = (await svc.emit(ev.PoolDefined(pool=name, **body.model_dump()), actor=p.user))[0]
        await svc.caught_up(seq)
        return {"name": name, **body.model_dump(), "seq": seq}

    @r.delete("/v1/pools/{name}", responses=errors(409))
    async def delete_pool(name: KnownPool, p: Annotated[Principal, Depends(caller)]) -> dict[str, Any]:
        pool = proj.pools.get(name)
        if pool is None:
            raise HTTPException(404, f"no pool {name}")
        if pool["nodes"] or pool["in_flight"]:
            raise HTTPException(409, f"pool {name} still has {len(pool['nodes'])} node(s) and {pool['in_flight']} "
                                     "coming: set its min_nodes and max_nodes to 0 (gpuorch pools set "
                                     f"{name} --min 0 --max 0), and delete it once its nodes are gone (they go when "
                                     "idle for its idle_timeout_s)")
        seq = (await svc.emit(ev.PoolDeleted(pool=name), actor=p.user))[0]
        await svc.caught_up(seq)
        return {"name": name, "deleted": True, "seq": seq}

    @r.get("/v1/pools")
    async def list_pools() -> list[dict[str, Any]]:
        out = []
        for name, p in sorted(proj.pools.items()):
            nodes = p["nodes"]
            out.append({"name": name, **p["spec"], "provider": p["provider"], "provider_error": scaler.provider_error(name),
                        "nodes": nodes, "in_flight": p["in_flight"],
                        "cost_per_hour": len(nodes) * p["spec"]["cost_per_node_hour"]})
        return out

    @r.put("/v1/deployments/{name}")
    async def put_deployment(name: NamePath, body: DeploymentRequest, p: Annotated[Principal, Depends(caller)]) -> dict[str, Any]:
        secret = {k: v for k, v in body.env.items() if secret_name.search(k)}
        job = {"name": name, "queue": body.queue, "resources": body.resources.model_dump(), "gpu": body.gpu.model_dump(),
               "command": body.command, "env": {k: v for k, v in body.env.items() if k not in secret},
               "secret_env": {**body.secret_env, **secret}}
        spec = {**body.model_dump(exclude={"queue", "resources", "gpu", "command", "env", "secret_env"}), "job": job,
                "owner": p.user}
        seq = (await svc.emit(ev.DeploymentDefined(name=name, spec=spec), actor=p.user))[0]
        await svc.caught_up(seq)
        return redact({"name": name, **spec, "seq": seq})

    @r.delete("/v1/deployments/{name}")
    async def delete_deployment(name: KnownDeployment, p: Annotated[Principal, Depends(caller)]) -> dict[str, Any]:
        if name not in proj.deployments:
            raise HTTPException(404, f"no deployment {name}")
        replicas = len(scaler.replicas_of(name))
        seq = (await svc.emit(ev.DeploymentDeleted(name=name), actor=p.user))[0]
        await scaler.forget_load(name)
        await svc.caught_up(seq)
        return {"name": name, "deleted": True, "replicas": replicas, "seq": seq}

    @r.get("/v1/deployments")
    async def list_deployments() -> list[dict[str, Any]]:
        return redact([{"name": k, **v, "live_replicas": len(scaler.replicas_of(k)),
                        "pending_requests": await scaler.load_of(k)} for k, v in sorted(proj.deployments.items())])

    @r.post("/v1/deployments/{name}/metrics")
    async def post_metrics(name: KnownDeployment, body: MetricsPost) -> dict[str, Any]:
        if name not in proj.deployments:
            raise HTTPException(404, f"no deployment {name}")
        await scaler.post_load(name, body.pending_requests)
        return {"name": name, "pending_requests": body.pending_requests}

    return r
