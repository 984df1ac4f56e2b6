"""The cluster as health sees it: plus each node's registration, drain request, last fault, and who cordoned it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from services.health.rules import ACTIVE, JobView, NodeView
from shared import events as ev
from shared.cluster import ClusterProjection
from shared.events import Envelope

SOURCE = "/gpuorch/health"


def decided_by_health(env: Envelope) -> bool:
    """The health leader's decisions carry its lease epoch; operator actions through its API do not."""
    return env.source == SOURCE and env.epoch is not None


class HealthProjection(ClusterProjection):
    name = "health"
    SNAPSHOT_VERSION = 1

    def __init__(self) -> None:
        super().__init__()
        self.registrations: dict[str, int] = {}  # node -> sequence of its last node.registered
        self.drains: dict[str, dict[str, Any]] = {}  # node -> {grace_s, reason, seq} of the drain in progress
        self.faulted_at: dict[str, float] = {}  # node -> time of its last gpu.unhealthy
        self.manual: dict[str, None] = {}  # nodes cordoned or drained by someone other than health's rules

    def on_node_registered(self, env: Envelope, e: ev.NodeRegistered) -> None:
        super().on_node_registered(env, e)
        self.registrations[e.node_id] = env.seq

    def on_node_cordoned(self, env: Envelope, e: ev.NodeCordoned) -> None:
        super().on_node_cordoned(env, e)
        if e.node_id in self.nodes and not decided_by_health(env):
            self.manual[e.node_id] = None

    def on_node_drain_requested(self, env: Envelope, e: ev.NodeDrainRequested) -> None:
        super().on_node_drain_requested(env, e)
        if e.node_id in self.nodes:
            self.drains[e.node_id] = {"grace_s": e.grace_s, "reason": e.reason, "seq": env.seq}
            if not decided_by_health(env):
                self.manual[e.node_id] = None

    def on_node_drained(self, env: Envelope, e: ev.NodeDrained) -> None:
        super().on_node_drained(env, e)
        self.drains.pop(e.node_id, None)

    def on_node_resumed(self, env: Envelope, e: ev.NodeResumed) -> None:
        super().on_node_resumed(env, e)
        self.drains.pop(e.node_id, None)
        self.manual.pop(e.node_id, None)
        self.faulted_at.pop(e.node_id, None)

    def on_gpu_unhealthy(self, env: Envelope, e: ev.GpuUnhealthy) -> None:
        super().on_gpu_unhealthy(env, e)
        if e.node_id in self.nodes:
            self.faulted_at[e.node_id] = env.timestamp

    # --- views for the rules -----------------------------------------------------------

    def job_views(self, states: frozenset[str] = ACTIVE, ids: Iterable[str] | None = None) -> list[JobView]:
        """Jobs in these states (only these ids, if given) as the rules see them."""
        jobs = self.jobs.values() if ids is None else [self.jobs[i] for i in ids if i in self.jobs]
        return [
            JobView(
                job_id=j.job_id, state=j.state, nodes=frozenset(p.node_id for p in j.placements), started_at=j.started_at,
                time_limit_s=j.spec.time_limit_s, timed_out=j.timed_out, retries=j.retries, max_retries=j.spec.max_retries,
                lost_before_start=j.lost_before_start,
            )
            for j in jobs
            if j.state in states
        ]

    def node_view(self, node_id: str, last_fault_seen: float | None = None) -> NodeView:
        n = self.nodes[node_id]
        recorded = self.faulted_at.get(node_id)
        last = max((t for t in (recorded, last_fault_seen) if t is not None), default=None)
        return NodeView(node_id, n.cordoned, n.draining, n.lost, bool(n.unhealthy), node_id in self.manual, last)

    # --- state -------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {
            **super().state(),
            "registrations": self.registrations,
            "drains": self.drains,
            "faulted_at": self.faulted_at,
            "manual": list(self.manual),
        }

    def load(self, state: dict[str, Any]) -> None:
        super().load(state)
        self.registrations = dict(state.get("registrations", {}))
        self.drains = dict(state.get("drains", {}))
        self.faulted_at = dict(state.get("faulted_at", {}))
        self.manual = dict.fromkeys(state.get("manual", []))
