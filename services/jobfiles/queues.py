"""Queue manifests -> queues PUT /v1/queues/{path} takes: KAI Queue, Kueue ClusterQueue / LocalQueue / Cohort,
Volcano Queue. gpuorch queues divide GPUs: guaranteed (nominal quota, deserved), limit, weight, priority.

Hierarchy becomes the dotted path: a KAI parentQueue, a Kueue cohort (its ClusterQueues below it, a
LocalQueue below its ClusterQueue), a Volcano parent or volcano.sh/hierarchy annotation. A parent is
guaranteed at least what its children are (gpuorch checks that children fit in their parent).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.jobfiles.common import Context, JobFileError, Notes, QueueDef, k8s_quantity, queue_path

GPU_NAMES = ("nvidia.com/gpu", "gpu", "nvidia.com/gpu.shared")


@dataclass
class _Queue:
    name: str
    parent: str | None  # a name (resolved to a path later), or None for the top
    guaranteed: float | None = 0.0  # None: "all it can get" (KAI's -1): at least its children's
    limit: float | None = None
    weight: float | None = None
    priority: int | None = None
    origin: str = ""
    notes: Notes = field(default_factory=Notes)
    path: str = ""
    ancestors: dict[str, float] = field(default_factory=dict)  # a Volcano hierarchy's parents: path -> weight


def _gpus(resources: Any, where: str) -> float | None:
    if not isinstance(resources, dict):
        return None
    for key in GPU_NAMES:
        if key in resources:
            return k8s_quantity(resources[key], f"{where} {key}")
    return None


def _others(resources: Any, where: str, notes: Notes) -> None:
    other = sorted(k for k in (resources or {}) if k not in GPU_NAMES)
    if other:
        notes.add(f"{where}: {', '.join(other)} not divided here (gpuorch queues divide GPUs): ignored")


def kai_queue(doc: dict[str, Any]) -> _Queue:
    name, origin = _name(doc)
    spec = doc.get("spec") or {}
    q = _Queue(name, spec.get("parentQueue"), origin=origin)
    gpu = (spec.get("resources") or {}).get("gpu") or {}
    quota, limit, weight = gpu.get("quota"), gpu.get("limit"), gpu.get("overQuotaWeight")
    if quota is not None:
        q.guaranteed = None if float(quota) < 0 else float(quota)
    if limit is not None and float(limit) >= 0:
        q.limit = float(limit)
    if weight is not None:
        if float(weight) <= 0:  # never more than its quota
            q.limit = q.guaranteed or 0.0
            q.notes.add(f"{origin}: overQuotaWeight {weight}: it never borrows here (limit = quota)")
        else:
            q.weight = float(weight)
    if spec.get("priority") is not None:
        q.priority = int(spec["priority"])
    for res in ("cpu", "memory"):
        if (spec.get("resources") or {}).get(res):
            q.notes.add(f"{origin}: {res} quota not divided here (gpuorch queues divide GPUs): ignored")
    return q


def kueue_cluster_queue(doc: dict[str, Any], kind: str) -> _Queue:
    name, origin = _name(doc)
    spec = doc.get("spec") or {}
    parent = spec.get("cohort") or spec.get("cohortName") or spec.get("parentName") or spec.get("parent")
    q = _Queue(name, parent, origin=origin)
    nominal = borrow = 0.0
    unbounded = False
    flavors = []
    for group in spec.get("resourceGroups") or []:
        for flavor in group.get("flavors") or []:
            for res in flavor.get("resources") or []:
                if res.get("name") in GPU_NAMES:
                    flavors.append(str(flavor.get("name")))
                    nominal += k8s_quantity(res.get("nominalQuota", 0), f"{origin}: nominalQuota")
                    if res.get("borrowingLimit") is None:
                        unbounded = True
                    else:
                        borrow += k8s_quantity(res["borrowingLimit"], f"{origin}: borrowingLimit")
                    if res.get("lendingLimit") is not None:
                        q.notes.add(f"{origin}: lendingLimit: ignored (idle GPUs are lent here while unused)")
                elif res.get("name"):
                    q.notes.add(f"{origin}: {res['name']} quota not divided here (gpuorch queues divide GPUs): ignored")
    if len(flavors) > 1:
        q.notes.add(f"{origin}: GPU quotas of flavors {', '.join(flavors)} add up here (a queue does not divide "
                    "them by GPU model)")
    q.guaranteed = nominal
    if kind == "ClusterQueue":
        q.limit = None if (parent and unbounded) else nominal + borrow
    weight = (spec.get("fairSharing") or {}).get("weight")
    if weight is not None:
        if k8s_quantity(weight, f"{origin}: fairSharing.weight") <= 0:
            q.notes.add(f"{origin}: fairSharing.weight 0: weight 0.001 here")
            q.weight = 0.001
        else:
            q.weight = k8s_quantity(weight, f"{origin}: fairSharing.weight")
    if spec.get("preemption"):
        q.notes.add(f"{origin}: preemption policy: gpuorch reclaims borrowed GPUs and preempts lower priorities "
                    "by its own rules")
    return q


def kueue_local_queue(doc: dict[str, Any]) -> _Queue:
    name, origin = _name(doc)
    cq = (doc.get("spec") or {}).get("clusterQueue")
    if not cq:
        raise JobFileError(f"{origin}: spec.clusterQueue: name the ClusterQueue it feeds")
    q = _Queue(name, str(cq), origin=origin)
    q.notes.add(f"{origin}: a leaf below ClusterQueue {cq}; jobs labelled kueue.x-k8s.io/queue-name: {name} go there")
    return q


def volcano_queue(doc: dict[str, Any]) -> _Queue:
    name, origin = _name(doc)
    spec = doc.get("spec") or {}
    meta = doc.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    parent = spec.get("parent")
    hierarchy = [p for p in str(annotations.get("volcano.sh/hierarchy", "")).split("/") if p]
    weights = [w for w in str(annotations.get("volcano.sh/hierarchy-weights", "")).split("/") if w]
    q = _Queue(name, None if parent in (None, "root") else str(parent), origin=origin)
    if hierarchy:
        if hierarchy[0] == "root":
            hierarchy, weights = hierarchy[1:], weights[1:]
        q.name = hierarchy[-1] if hierarchy else name
        q.parent = ".".join(hierarchy[:-1]) or None
        q.path = ".".join(hierarchy)
        if weights:
            q.weight = float(weights[-1])
            q.ancestors = {".".join(hierarchy[:i + 1]): float(w) for i, w in enumerate(weights[:-1])}
    deserved, guarantee = _gpus(spec.get("deserved"), origin), _gpus((spec.get("guarantee") or {}).get("resource"),
                                                                     origin)
    q.guaranteed = deserved if deserved is not None else (guarantee or 0.0)
    if deserved is not None and guarantee:
        q.notes.add(f"{origin}: guarantee (held back for it alone) is not kept here; deserved {deserved:g} GPUs is "
                    "its guarantee (lent while unused)")
    capability = _gpus(spec.get("capability"), origin)
    if capability is not None:
        q.limit = capability
    if spec.get("weight") is not None and not weights:
        q.weight = float(spec["weight"])
    if spec.get("priority") is not None:
        q.priority = int(spec["priority"])
    if spec.get("reclaimable") is False:
        q.notes.add(f"{origin}: reclaimable: false: gpuorch reclaims what a queue borrows above its guarantee")
    for key in ("capability", "deserved"):
        _others(spec.get(key), f"{origin}: {key}", q.notes)
    return q


def _name(doc: dict[str, Any]) -> tuple[str, str]:
    name = str((doc.get("metadata") or {}).get("name") or "")
    origin = f"{doc.get('apiVersion')} {doc.get('kind')} {name}"
    if not name:
        raise JobFileError(f"{origin}: metadata.name: a queue needs a name")
    return name, origin


def queue_defs(found: list[_Queue], ctx: Context) -> list[QueueDef]:
    """Paths from the parents (in the file, or known here), parents first, each guaranteed at least what its
    children are; QueueSpec bodies."""
    by_name = {q.name: q for q in found}
    done: dict[str, str] = {}

    def path_of(q: _Queue, seen: tuple[str, ...] = ()) -> str:
        if q.name in done:
            return done[q.name]
        if q.name in seen:
            raise JobFileError(f"{q.origin}: its parents form a loop ({' -> '.join(seen)})")
        if q.path:
            path = q.path
        elif q.parent is None:
            path = q.name
        elif q.parent in by_name:
            path = path_of(by_name[q.parent], (*seen, q.name)) + "." + q.name
        else:
            parent, _ = queue_path(q.parent, ctx, f"{q.origin}: parent")
            path = f"{parent}.{q.name}"
        path, _ = queue_path(path, Context(), q.origin)
        done[q.name] = path
        return path

    for q in found:
        q.path = path_of(q)
    paths = {q.path: q for q in found}
    for q in found:  # parents a Volcano hierarchy names but the file does not define
        parts = q.path.split(".")
        for i in range(1, len(parts)):
            p = ".".join(parts[:i])
            if p not in paths and p not in (ctx.queues or ()):  # a queue the cluster has stays as it is
                paths[p] = _Queue(parts[i - 1], ".".join(parts[:i - 1]) or None, origin=f"parent of {q.path}", path=p,
                                  weight=q.ancestors.get(p))
    for path in sorted(paths, key=lambda p: -p.count(".")):  # children first: a parent covers them
        q = paths[path]
        kids = sum((c.guaranteed or 0.0) for c in paths.values() if c.path.rpartition(".")[0] == path)
        if q.guaranteed is None or q.guaranteed < kids:
            if q.guaranteed is not None and q.guaranteed < kids:
                q.notes.add(f"{q.origin}: guaranteed {kids:g} GPUs, what its children are guaranteed")
            q.guaranteed = kids
        if q.limit is not None and q.limit < q.guaranteed:
            q.notes.add(f"{q.origin}: limit {q.limit:g} is below its guarantee: limit {q.guaranteed:g}")
            q.limit = q.guaranteed
    out = []
    for path in sorted(paths, key=lambda p: (p.count("."), p)):
        q = paths[path]
        spec: dict[str, Any] = {"guaranteed": {"gpus": _num(q.guaranteed or 0.0)}}
        if q.limit is not None:
            spec["limit"] = {"gpus": _num(q.limit)}
        if q.weight is not None:
            spec["weight"] = _num(q.weight)
        if q.priority is not None:
            spec["priority"] = q.priority
        out.append(QueueDef(path, spec, q.origin, tuple(q.notes)))
    return out


def _num(x: float) -> float | int:
    return int(x) if x == int(x) else x
