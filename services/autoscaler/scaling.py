"""Autoscaling decisions. Pure: the snapshot, the pools and ``now`` come in; counts come out.

Scale-up asks the real placement core: the waiting gangs are placed on the cluster
plus k hypothetical empty nodes of a pool's profile, for the smallest k that places
all the gangs that pool can ever hold. So a gang's topology, constraints and
all-or-nothing rule are respected exactly as the scheduler will respect them.

(The one import across services in the code base: the scheduler's *pure* core, a
library of functions with no state; the services still talk through events only.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from services.scheduler.core import Policy, run_cycle
from services.scheduler.snapshot import PendingJob, Snapshot, node_snap
from shared.cluster import NodeState
from shared.model import NodeInfo


@dataclass(frozen=True)
class PoolSpec:
    name: str
    profile: str
    min_nodes: int = 0
    max_nodes: int = 0
    provision_delay_s: float = 0
    idle_timeout_s: float = 600
    cost_per_node_hour: float = 0.0
    hourly_cost_cap: float | None = None

    def affordable(self, nodes: int) -> int:
        """The most nodes this pool may have at once: max, and the cost cap if any."""
        cap = self.max_nodes
        if self.hourly_cost_cap is not None and self.cost_per_node_hour > 0:
            cap = min(cap, math.floor(self.hourly_cost_cap / self.cost_per_node_hour + 1e-9))
        return cap


@dataclass(frozen=True)
class PoolState:
    spec: PoolSpec
    nodes: tuple[str, ...] = ()  # provisioned (registered or not yet)
    in_flight: int = 0  # requested, not provisioned yet

    @property
    def size(self) -> int:
        return len(self.nodes) + self.in_flight


def scale_up(
    snapshot: Snapshot,
    pools: Sequence[PoolState],
    waiting: Sequence[PendingJob],
    make_node: Callable[[str, str], NodeInfo],
    policy: Policy | None = None,
) -> dict[str, int]:
    """Nodes to add per pool so that waiting gangs become placeable; fewest nodes, whole gangs in one pool.

    1. Gangs that fit the cluster as it is are not a reason to buy (the scheduler will place them).
    2. Pools are tried in name order; for each, the smallest k (up to what the pool may still add)
       that places the most remaining gangs on the cluster plus k empty nodes wins.
    3. Gangs placed by a pool's new nodes are not counted again for the next pool.
    """
    policy = replace(policy or Policy(name="bestfit"), backfill=False, preempt=False)
    if not waiting:
        return {}
    base = run_cycle(replace(snapshot, pending=tuple(waiting)), policy, snapshot.taken_at)
    left = [j for j in waiting if j.job_id not in base.placements]
    out: dict[str, int] = {}
    for pool in sorted(pools, key=lambda p: p.spec.name):
        room = pool.spec.affordable(pool.size) - pool.size
        if room <= 0 or not left:
            continue
        extra: tuple = ()
        best_k, best_placed = 0, frozenset()
        for k in range(1, room + 1):
            extra += (node_snap(NodeState(info=make_node(pool.spec.profile, f"{pool.spec.name}-hyp-{k}"))),)
            trial = replace(snapshot, nodes=snapshot.nodes + extra, pending=tuple(left))
            placed = frozenset(run_cycle(trial, policy, snapshot.taken_at).placements)
            if len(placed) > len(best_placed):
                best_k, best_placed = k, placed
            if len(placed) == len(left):
                break
        if best_k:
            out[pool.spec.name] = best_k
            left = [j for j in left if j.job_id not in best_placed]
    return out


def scale_down(
    pools: Sequence[PoolState],
    busy: Mapping[str, bool],
    idle_since: Mapping[str, float],
    now: float,
) -> dict[str, list[str]]:
    """Idle pool nodes past their pool's timeout, never below min, never one with running tasks."""
    out: dict[str, list[str]] = {}
    for pool in pools:
        removable = pool.size - pool.spec.min_nodes
        victims = []
        for node_id in sorted(pool.nodes, key=lambda n: (idle_since.get(n, now), n)):
            if len(victims) >= removable:
                break
            if busy.get(node_id, False) or node_id not in idle_since:
                continue
            if now - idle_since[node_id] >= pool.spec.idle_timeout_s:
                victims.append(node_id)
        if victims:
            out[pool.spec.name] = victims
    return out


def lost_to_replace(
    pools: Sequence[PoolState],
    busy: Mapping[str, bool],
    lost_since: Mapping[str, float],
    now: float,
    after_s: float,
) -> dict[str, list[str]]:
    """Pool nodes lost (silent) for ``after_s`` and holding no work: to terminate, min or not, so that they stop
    counting toward their pool's size and it buys what it still needs (a lost node would hold a pool at its min
    for ever)."""
    out: dict[str, list[str]] = {}
    for pool in pools:
        gone = [n for n in pool.nodes if n in lost_since and now - lost_since[n] >= after_s and not busy.get(n, False)]
        if gone:
            out[pool.spec.name] = sorted(gone)
    return out


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    min_replicas: int = 0
    max_replicas: int = 1
    target_pending_per_replica: float = 1.0
    stabilization_s: float = 60.0
    scale_to_zero_after_s: float = 300.0


@dataclass
class ReplicaHistory:
    """Recent desired counts, for the stabilization window (as the Kubernetes HPA keeps them)."""

    samples: list[tuple[float, int]] = field(default_factory=list)
    last_change: float = -math.inf
    last_busy: float = -math.inf


def desired_replicas(spec: DeploymentSpec, current: int, pending_requests: float, now: float,
                     history: ReplicaHistory) -> int:
    """ceil(pending / target), clamped, changed at most once per stabilization window; zero after idle."""
    raw = math.ceil(pending_requests / spec.target_pending_per_replica) if pending_requests > 0 else 0
    if pending_requests > 0:
        history.last_busy = now
    floor = spec.min_replicas
    if raw == 0 and now - history.last_busy < spec.scale_to_zero_after_s:
        floor = max(floor, 1 if current > 0 else 0)
    want = max(floor, min(spec.max_replicas, raw))
    history.samples = [(t, n) for t, n in history.samples if now - t < spec.stabilization_s] + [(now, want)]
    if want == current or now - history.last_change < spec.stabilization_s:
        return current
    # scale down only to the highest recommendation in the window, up to the lowest: no flapping
    recent = [n for _, n in history.samples]
    target = max(recent) if want < current else min(recent)
    if target != current:
        history.last_change = now
    return target
