from typing import Any

from services.autoscaler.scaling import DeploymentSpec, PoolSpec, PoolState
from shared import events as ev
from shared.cluster import ClusterProjection
from shared.events import Envelope, TaskPlacement


class AutoscalerProjection(ClusterProjection):
    name = "autoscaler"
    SNAPSHOT_VERSION = 1

    def __init__(self) -> None:
        super().__init__()
        self.pools: dict[str, dict[str, Any]] = {}  # name -> {"spec": {...}, "provider": name, "nodes": [...], "in_flight": n}
        self.deployments: dict[str, dict[str, Any]] = {}  # name -> {"spec": {...}, "replicas": n}
        self.deleted_deployments: dict[str, str | None] = {}  # name -> its owner: their replicas are cancelled
        self.lost_since: dict[str, float] = {}  # node -> when it was found lost (until it registers again)
        self.idle_since: dict[str, float] = {}  # node -> when it last became empty

    def pool_states(self) -> list[PoolState]:
        return [PoolState(PoolSpec(name=k, **v["spec"]), tuple(v["nodes"]), v["in_flight"]) for k, v in sorted(self.pools.items())]

    def deployment_spec(self, name: str) -> DeploymentSpec:
        spec = self.deployments[name]["spec"]
        keys = ("min_replicas", "max_replicas", "target_pending_per_replica", "stabilization_s", "scale_to_zero_after_s")
        return DeploymentSpec(name=name, **{k: spec[k] for k in keys if k in spec})

    # --- pools -------------------------------------------------------------------------

    def on_pool_defined(self, env: Envelope, e: ev.PoolDefined) -> None:
        super().on_pool_defined(env, e)
        old = self.pools.get(e.pool, {"nodes": [], "in_flight": 0})
        spec = e.model_dump(mode="json", exclude={"pool", "provider"})
        self.pools[e.pool] = {"spec": spec, "provider": e.provider, "nodes": old["nodes"], "in_flight": old["in_flight"]}

    def on_pool_deleted(self, env: Envelope, e: ev.PoolDeleted) -> None:
        super().on_pool_deleted(env, e)
        pool = self.pools.pop(e.pool, None)
        if pool is None:
            self.invalid(env, f"unknown pool {e.pool}")
        elif pool["nodes"]:
            self.invalid(env, f"pool {e.pool} deleted with nodes {', '.join(pool['nodes'])}")

    def on_pool_scale_requested(self, env: Envelope, e: ev.PoolScaleRequested) -> None:
        if e.pool not in self.pools:
            self.invalid(env, f"unknown pool {e.pool}")
        else:  # a negative delta takes back a request whose provisioning failed
            self.pools[e.pool]["in_flight"] = max(0, self.pools[e.pool]["in_flight"] + e.delta)

    def on_pool_node_provisioned(self, env: Envelope, e: ev.PoolNodeProvisioned) -> None:
        pool = self.pools.get(e.pool)
        if pool is None:
            self.invalid(env, f"unknown pool {e.pool}")
            return
        pool["in_flight"] = max(0, pool["in_flight"] - 1)
        if e.node_id not in pool["nodes"]:
            pool["nodes"].append(e.node_id)

    def on_pool_node_terminated(self, env: Envelope, e: ev.PoolNodeTerminated) -> None:
        super().on_pool_node_terminated(env, e)
        self.lost_since.pop(e.node_id, None)
        nodes = self.pools.get(e.pool, {}).get("nodes", [])
        if e.node_id in nodes:
            nodes.remove(e.node_id)
        self.idle_since.pop(e.node_id, None)

    # --- idleness ------------------------------------------------------------------------

    def on_node_lost(self, env: Envelope, e: ev.NodeLost) -> None:
        super().on_node_lost(env, e)
        if e.node_id in self.nodes:
            self.lost_since.setdefault(e.node_id, env.timestamp)

    def on_node_registered(self, env: Envelope, e: ev.NodeRegistered) -> None:
        super().on_node_registered(env, e)
        self.lost_since.pop(e.node_id, None)
        node = self.nodes[e.node_id]
        if not node.gpu_alloc and not node.cpu_alloc:
            self.idle_since.setdefault(e.node_id, env.timestamp)

    def _reserve(self, p: TaskPlacement, sign: int) -> None:
        super()._reserve(p, sign)
        node = self.nodes.get(p.node_id)
        if node is None:
            return
        if node.gpu_alloc or node.cpu_alloc:
            self.idle_since.pop(p.node_id, None)
        else:
            self.idle_since[p.node_id] = self.now

    # --- deployments ---------------------------------------------------------------------

    def on_deployment_defined(self, env: Envelope, e: ev.DeploymentDefined) -> None:
        self.deployments[e.name] = {"spec": e.spec, "replicas": self.deployments.get(e.name, {}).get("replicas", 0)}
        self.deleted_deployments.pop(e.name, None)

    def on_deployment_deleted(self, env: Envelope, e: ev.DeploymentDeleted) -> None:
        dep = self.deployments.pop(e.name, None)
        if dep is None:
            self.invalid(env, f"unknown deployment {e.name}")
            return
        self.deleted_deployments[e.name] = dep["spec"].get("owner")

    def on_deployment_scaled(self, env: Envelope, e: ev.DeploymentScaled) -> None:
        if e.name not in self.deployments:
            self.invalid(env, f"unknown deployment {e.name}")
            return
        self.deployments[e.name]["replicas"] = e.replicas

    def state(self) -> dict[str, Any]:
        return {**super().state(), "pools": self.pools, "deployments": self.deployments, "idle_since": self.idle_since,
                "deleted_deployments": self.deleted_deployments, "lost_since": self.lost_since}

    def load(self, state: dict[str, Any]) -> None:
        super().load(state)
        self.pools, self.deployments, self.idle_since = state["pools"], state["deployments"], state["idle_since"]
        self.deleted_deployments = state.get("deleted_deployments", {})  # absent from older snapshots
        self.lost_since = state.get("lost_since", {})
        for pool in self.pools.values():  # a snapshot from before pool.defined v2 held commands: keep the name only
            if isinstance(pool["provider"], dict):
                pool["provider"] = pool["provider"]["kind"]
