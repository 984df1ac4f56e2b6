"""One scheduling cycle from the folded cluster: fair share and reclaim, the queues' policy, then the core.

Pure, like the core: the service, the simulator and the what-if replay call ``decide`` with the projection,
the time and the configured policy, and get the plan back; only the service commits it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from services.scheduler.core import Plan, Policy, ReclaimRequest, run_cycle
from services.scheduler.snapshot import Snapshot, snapshot_from_cluster
from shared.cluster import ClusterProjection
from shared.fairshare import leaves, reclaim_requests
from shared.model import QueueSpec
from shared.settings import Settings


def configured_policy(settings: Settings) -> Policy:
    """The policy the operator configured (GPUORCH_POLICY, GPUORCH_RECLAIM_GRACE_S, ...); ValueError naming the
    policies if the name is unknown."""
    return Policy(name=settings.policy, reclaim_grace_s=settings.reclaim_grace_s,
                  max_preemptions_per_hour=settings.max_preemptions_per_hour)


def effective_priority(queues: Mapping[str, QueueSpec], path: str) -> int:
    """A leaf's reclaim priority: its own, else its nearest ancestor's (production > research > exploration)."""
    while path:
        spec = queues.get(path)
        if spec is not None and spec.priority:
            return spec.priority
        path = path.rsplit(".", 1)[0] if "." in path else ""
    return 0


def queue_policy(policy: Policy, queues: Mapping[str, QueueSpec]) -> Policy:
    """The configured policy with what the queue specs add: each queue's minimum runtime before it may be
    preempted, and the priority reclaim takes from (lowest first)."""
    return replace(
        policy,
        min_runtime_s={q: s.preempt_min_runtime_s for q, s in queues.items() if s.preempt_min_runtime_s},
        queue_priority={q: effective_priority(queues, q) for q in queues},
    )


@dataclass(frozen=True)
class CycleInput:
    """What one cycle reads of the folded cluster, copied out of it: the core decides on it while folds go on."""

    snapshot: Snapshot
    policy: Policy
    now: float
    reclaims: Sequence[ReclaimRequest | tuple[str, float]]

    def decide(self) -> Plan:
        return run_cycle(self.snapshot, self.policy, self.now, self.reclaims)


def cycle_input(proj: ClusterProjection, policy: Policy, now: float, half_life_s: float,
                reclaim_after_s: float = 0.0) -> CycleInput:
    """Entitlements and reclaim requests from the fair share, the snapshot and the queues' policy, at ``now``: the
    part of a cycle that reads the projection (the service holds its folds meanwhile, and only meanwhile)."""
    queues = proj.queues
    # 1. entitlements: the fair-share division of what the cluster holds now, by decayed usage
    load = proj.queue_loads(waited_before=now - reclaim_after_s)
    division = proj.division(now, half_life_s, load)
    leaf_ent = {q: division.entitlement.get(q, 0.0) for q in leaves(queues)}
    # 2. reclaim only for work that has waited a while: ordinary churn often frees the GPUs first, without evicting
    reclaims = reclaim_requests(queues, load.alloc, load.waited, leaf_ent, load.smallest)
    # 3. what reclaim may not take a queue (or a parent) below: its guarantee, where its share is not smaller
    floors = {q: min(queues[q].guaranteed.gpus if q in queues else 0.0, e) for q, e in division.entitlement.items()}
    return CycleInput(snapshot_from_cluster(proj, now, leaf_ent, floors), queue_policy(policy, queues), now,
                      tuple(reclaims))


def decide(proj: ClusterProjection, policy: Policy, now: float, half_life_s: float,
           reclaim_after_s: float = 0.0) -> Plan:
    """One cycle from the folded state at ``now``: entitlements and reclaim requests from the fair share, then the
    core with the queues' policy (on a copy: ``cycle_input``)."""
    return cycle_input(proj, policy, now, half_life_s, reclaim_after_s).decide()
