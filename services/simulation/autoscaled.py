"""A replay with a node pool that grows and shrinks: the autoscaler's pure planning inside the simulator.

Nodes of the pool are bought with the real ``scale_up`` (waiting gangs placed on
hypothetical nodes with the real core), arrive after the pool's provision delay,
and are terminated by the real ``scale_down`` once idle past the timeout. The
result adds node-hours bought to the usual queueing metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from services.autoscaler.scaling import PoolSpec, PoolState, scale_down, scale_up
from services.scheduler.core import Plan
from services.scheduler.snapshot import PendingJob, node_snap, snapshot_from_cluster
from services.simulation.engine import Simulation
from services.simulation.traces import TraceJob
from shared import events as ev
from shared.cluster import NodeState
from shared.model import NodeInfo
from shared.profiles import build

TICK = "tick"


@dataclass
class PoolLedger:
    spec: PoolSpec
    nodes: dict[str, float]  # node -> when it was registered
    in_flight: int = 0
    node_seconds: float = 0.0
    bought: int = 0


class AutoscaledSimulation(Simulation):
    def __init__(self, nodes: Sequence[NodeInfo], jobs: Sequence[TraceJob], policy, pool: PoolSpec,
                 tick_s: float = 60.0, **kw) -> None:
        super().__init__(nodes, jobs, policy, **kw)
        self.pool = PoolLedger(pool, {})
        self.tick_s = tick_s
        self.idle_since: dict[str, float] = {}
        self.last_t = min((j.submit for j in jobs), default=0.0)
        self._push(self.last_t, TICK, "")

    def _state(self) -> PoolState:
        return PoolState(self.pool.spec, tuple(self.pool.nodes), self.pool.in_flight)

    def _handle(self, t: float, kind: str, job_id: str, arg: int) -> bool:
        self.last_t = t
        if kind == TICK:
            self._scale_down(t)
            if self.pool.in_flight < self.pool.spec.min_nodes - len(self.pool.nodes):
                self._buy(t, self.pool.spec.min_nodes - len(self.pool.nodes) - self.pool.in_flight)
            if self._more():  # keep ticking while anything is left to happen
                self._push(t + self.tick_s, TICK, "")
            return False  # a tick changes no job: nodes arriving or leaving wake the cycle themselves
        react = super()._handle(t, kind, job_id, arg)
        if kind == "infra" and isinstance(self.infra[arg][1], ev.NodeRegistered):
            node_id = self.infra[arg][1].node_id
            if node_id.startswith(f"{self.pool.spec.name}-"):
                self.pool.in_flight -= 1
                self.pool.nodes[node_id] = t
                self.idle_since[node_id] = t
        return react

    def _commit(self, plan: Plan, now: float, pending: Sequence[PendingJob]) -> None:
        super()._commit(plan, now, pending)
        for node_id in self.pool.nodes:
            node = self.proj.nodes.get(node_id)
            if node is not None and (node.gpu_alloc or node.cpu_alloc):
                self.idle_since.pop(node_id, None)
        waiting = [PendingJob(j, self.proj.jobs[j].spec, self.proj.jobs[j].submitted_at) for j in sorted(self.queued)
                   if j not in plan.placements]
        if not waiting:
            return
        snap = snapshot_from_cluster(self.proj, now)
        # nodes on their way count as present: never buy twice for one gang
        coming = tuple(node_snap(NodeState(info=build(self.pool.spec.profile, f"coming-{i}"))) for i in range(self.pool.in_flight))
        want = scale_up(replace(snap, nodes=snap.nodes + coming), [self._state()], waiting, build)
        if want.get(self.pool.spec.name):
            self._buy(now, want[self.pool.spec.name])

    def _buy(self, now: float, k: int) -> None:
        for _ in range(k):
            self.pool.bought += 1
            node = build(self.pool.spec.profile, f"{self.pool.spec.name}-{self.pool.bought}")
            self.pool.in_flight += 1
            self.infra.append((now + self.pool.spec.provision_delay_s, ev.NodeRegistered(node_id=node.node_id, node=node)))
            self._push(now + self.pool.spec.provision_delay_s, "infra", "", len(self.infra) - 1)

    def _scale_down(self, now: float) -> None:
        busy = {}
        for node_id in self.pool.nodes:
            node = self.proj.nodes.get(node_id)
            busy[node_id] = bool(node and (node.gpu_alloc or node.cpu_alloc))
            if not busy[node_id]:
                self.idle_since.setdefault(node_id, now)
        for node_id in scale_down([self._state()], busy, self.idle_since, now).get(self.pool.spec.name, []):
            self.pool.node_seconds += now - self.pool.nodes.pop(node_id)
            self.idle_since.pop(node_id, None)
            self._fold(ev.PoolNodeTerminated(pool=self.pool.spec.name, node_id=node_id), now)
            self.dead.pop(node_id, None)
            self._nodes_changed()

    def _max_gpus(self) -> int:
        return self.static_gpus + self.pool.spec.max_nodes * len(build(self.pool.spec.profile, "largest").gpus)

    def node_hours(self) -> float:
        live = sum(self.last_t - t for t in self.pool.nodes.values())
        return (self.pool.node_seconds + live) / 3600
