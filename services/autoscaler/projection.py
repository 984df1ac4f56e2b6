from typing import Any

from shared import events as ev
from shared.cluster import ClusterProjection
from shared.events import Envelope


class AutoscalerProjection(ClusterProjection):
    name = "autoscaler"

    def __init__(self) -> None:
        super().__init__()
        self.pools: dict[str, dict[str, Any]] = {}
        self.deployments: dict[str, dict[str, Any]] = {}

    def on_pool_defined(self, env: Envelope, e: ev.PoolDefined) -> None:
        nodes = self.pools.get(e.pool, {}).get("nodes", [])
        self.pools[e.pool] = {**e.model_dump(mode="json", exclude={"pool"}), "nodes": nodes}

    def on_pool_node_provisioned(self, env: Envelope, e: ev.PoolNodeProvisioned) -> None:
        if e.pool not in self.pools:
            self.invalid(env, f"unknown pool {e.pool}")
            return
        self.pools[e.pool]["nodes"].append(e.node_id)

    def on_pool_node_terminated(self, env: Envelope, e: ev.PoolNodeTerminated) -> None:
        nodes = self.pools.get(e.pool, {}).get("nodes", [])
        if e.node_id not in nodes:
            self.invalid(env, f"node {e.node_id} is not in pool {e.pool}")
            return
        nodes.remove(e.node_id)

    def on_deployment_defined(self, env: Envelope, e: ev.DeploymentDefined) -> None:
        self.deployments[e.name] = {"spec": e.spec, "replicas": self.deployments.get(e.name, {}).get("replicas", 0)}

    def on_deployment_scaled(self, env: Envelope, e: ev.DeploymentScaled) -> None:
        if e.name not in self.deployments:
            self.invalid(env, f"unknown deployment {e.name}")
            return
        self.deployments[e.name]["replicas"] = e.replicas

    def state(self) -> dict[str, Any]:
        return {**super().state(), "pools": self.pools, "deployments": self.deployments}

    def load(self, state: dict[str, Any]) -> None:
        super().load(state)
        self.pools, self.deployments = state["pools"], state["deployments"]
