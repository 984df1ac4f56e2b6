"""Why a job waits, in words a person can act on."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from services.scheduler.gang import capacity, widest
from services.scheduler.snapshot import GpuSnap, NodeSnap
from services.scheduler.equivalence import NodeClass
from services.scheduler.shapes import TaskShape, parse_cc
from services.scheduler.workstate import NOW, UNBOUNDED, WorkState
from shared.model import MILLI


def describe_task(s: TaskShape) -> str:
    if s.mig:
        what = f"a MIG {s.mig} slice"
    elif s.gpus == 0:
        what = "no GPU"
        if s.selector:
            what += " on nodes labelled " + ", ".join(f"{k}={v}" for k, v in s.selector)
        return what
    elif s.milli < MILLI:
        what = f"{s.milli / MILLI:g} of a GPU"
    else:
        what = f"{s.gpus} GPU{'s' if s.gpus > 1 else ''}"
    if s.models:
        what += f" of model {' or '.join(s.models)}"
    if s.min_memory_mib:
        what += f" with at least {s.min_memory_mib} MiB"
    if s.min_cc:
        what += f" with compute capability {s.min_cc[0]}.{s.min_cc[1]} or newer"
    if s.one_domain and s.gpus > 1 and s.milli == MILLI:
        what += " in one NVLink domain"
    if s.selector:
        what += " on nodes labelled " + ", ".join(f"{k}={v}" for k, v in s.selector)
    return what


def describe(s: TaskShape, tasks: int, topology: str) -> str:
    level = widest(topology)
    if tasks == 1:
        return describe_task(s)
    within = "" if level == "any" else f" within one {level}"
    if s.per_node and tasks > s.per_node:
        within = f", {s.per_node} on each of {tasks // s.per_node} nodes" + within
    return f"{tasks} tasks × {describe_task(s)}{within}"


def _block(ws: WorkState, cls: NodeClass, sid: int) -> int:
    """The largest free piece of the shape's kind on a class: GPUs (in one domain if required), milli, or slices."""
    s = ws.shapes[sid]
    ok = ws.eligible(cls.type, sid)
    if ok is None or s.gpus == 0:
        return 0
    if s.mig or s.milli < MILLI:
        return ws.gpu_cap(cls, sid) if s.mig else max((r for r, e in zip(cls.free, ok) if e), default=0)
    per: dict[int, int] = {}
    for r, e, d in zip(cls.free, ok, cls.type.domains):
        if e and r >= MILLI:
            key = d if s.one_domain else 0
            per[key] = per.get(key, 0) + 1
    return max(per.values(), default=0)


def _classes(ws: WorkState, mode: str) -> list[tuple[NodeClass, int]]:
    out = [(c, ws.first_member(c)) for c in ws.nonempty.values()]
    out += [(ws.effective_class(i, mode), i) for i in ws.reserved]
    return out


def _largest(ws: WorkState, sid: int, mode: str) -> str:
    s = ws.shapes[sid]
    best = (0, 0, "")
    for cls, idx in _classes(ws, mode):
        node = ws.nodes[idx]
        b = _block(ws, cls, sid)
        if (b, -node.prio) > best[:2]:
            best = (b, -node.prio, node.node_id)
    n, _, where = best
    kind = " of that kind" if s.models or s.min_memory_mib or s.min_cc or s.selector else ""
    if s.mig:
        return f"no {s.mig} slice is free" if n == 0 else f"{n} free {s.mig} slices on {where}"
    if s.milli < MILLI:
        return f"no GPU{kind} has room" if n == 0 else f"largest free share is {n / MILLI:g} of a GPU on {where}"
    if n == 0:
        return f"no GPU{kind} is free"
    return f"largest free block is {n} on {where}"


def _cpu_mem(ws: WorkState, sid: int, mode: str, need_tasks: int) -> str:
    """If GPUs would do somewhere but CPU or memory would not, say which and how much."""
    s = ws.shapes[sid]
    for cls, idx in _classes(ws, mode):
        if ws.gpu_cap(cls, sid) >= need_tasks and ws.cap(cls, sid) < need_tasks:
            short = []
            if cls.cpu < s.cpu * need_tasks:
                short.append(f"{cls.cpu} mCPU free (needs {s.cpu * need_tasks})")
            if cls.mem < s.mem * need_tasks:
                short.append(f"{cls.mem} MiB free (needs {s.mem * need_tasks})")
            return f"; {ws.nodes[idx].node_id} has the GPUs but only " + " and ".join(short)
    return ""


def _gpu_filters(s: TaskShape) -> list[tuple[str, Callable[[GpuSnap], bool]]]:
    filters: list[tuple[str, Callable[[GpuSnap], bool]]] = []
    if s.gpus == 0:
        return filters
    if s.models:
        filters.append((f"GPU model {' or '.join(s.models)}", lambda g: g.model in s.models))
    if s.min_memory_mib:
        filters.append((f"GPUs with at least {s.min_memory_mib} MiB", lambda g: g.memory_mib >= s.min_memory_mib))
    if s.min_cc:
        want = s.min_cc
        filters.append(
            (f"compute capability {want[0]}.{want[1]}", lambda g: (parse_cc(g.compute_capability) or (0, 0)) >= want)
        )
    if s.mig:
        filters.append((f"MIG {s.mig} slices", lambda g: g.mig_enabled and any(x.profile == s.mig for x in g.mig_slices)))
    elif s.gpus:
        filters.append(("GPUs outside MIG mode", lambda g: not g.mig_enabled))
    return filters


def _no_match(s: TaskShape, nodes: Sequence[NodeSnap]) -> str:
    """Name the first requirement that no schedulable node meets, and where a match sits idle."""
    up = [n for n in nodes if n.schedulable]
    if not up:
        parked = [n.node_id for n in nodes]
        return "no schedulable node" + (f" (cordoned, draining or lost: {', '.join(parked[:5])})" if parked else " yet")
    labelled = [n for n in up if all(n.labels.get(k) == v for k, v in s.selector)]
    if not labelled:
        wanted = ", ".join(f"{k}={v}" for k, v in s.selector)
        return f"no schedulable node is labelled {wanted}"
    gpus = [g for n in labelled for g in n.gpus if g.healthy]
    for what, keep in _gpu_filters(s):
        left = [g for g in gpus if keep(g)]
        if not left:
            have = ", ".join(sorted({g.model for g in gpus})) or "none"
            parked = [n.node_id for n in nodes if not n.schedulable and any(keep(g) for g in n.gpus)]
            hint = f"; matching but unavailable: {', '.join(parked[:5])}" if parked else ""
            return f"no schedulable node offers {what} (schedulable GPU models: {have}){hint}"
        gpus = left
    return "no schedulable node offers it"


def explain(
    ws: WorkState, empty: WorkState, sid: int, tasks: int, topology: str, nodes: Sequence[NodeSnap], mode: str = NOW
) -> str:
    """Why the gang does not fit: never (and what the cluster lacks) or not now (and the best on offer)."""
    s = ws.shapes[sid]
    level = widest(topology)
    what = f"needs {describe(s, tasks, topology)}"
    per_node = tasks if level == "node" else 1
    ever = capacity(empty, sid)
    if not ever.fits(tasks, topology):
        if ever.total == 0:
            if all(empty.eligible(c.type, sid) is None for c in empty.nonempty.values()):
                return f"{what}; {_no_match(s, nodes)}"
            if not any(empty.gpu_cap(c, sid) for c in empty.nonempty.values()):
                return f"{what}; it can never fit: {_largest(empty, sid, NOW)} even when idle"
            return f"{what}; no node has the CPU and memory for a task, even when idle" + _cpu_mem(empty, sid, NOW, 1)
        scope = "the whole cluster" if level == "any" else f"one {level}"
        return f"{what}; the cluster can never hold it: at most {ever.at(level)} such tasks fit in {scope}, even empty"
    now = capacity(ws, sid, mode)
    if tasks == 1 or level == "node":
        return f"{what}; {_largest(ws, sid, mode)}" + _cpu_mem(ws, sid, mode, per_node)
    fit = now.at(level)
    where = {"rack": f" (rack {now.rack_site[1] or '-'})", "zone": f" (zone {now.zone_name or '-'})"}.get(level, "")
    scope = f"one {level}" if level != "any" else "the cluster"
    tail = "" if now.node >= UNBOUNDED else f"; at most {now.node} on one node ({now.node_id or 'none'})"
    short = f"only {min(fit, UNBOUNDED)} of {tasks} tasks fit in {scope} now{where}{tail}"
    return f"{what}; {short}" + _cpu_mem(ws, sid, mode, 1)


def held_back(job_id: str, start: float, now: float, nodes: Sequence[str], limit: int | None) -> str:
    """A job that fits, but only on what the reserved job needs, and may still run when it starts."""
    where = ", ".join(nodes[:4]) + ("…" if len(nodes) > 4 else "")
    if math.isinf(start):
        return f"the free capacity it fits is held for {job_id} on {where}, which waits for jobs without a time limit"
    wait = max(0, int(start - now))
    ask = "a time limit" if limit is None else f"a time limit under {wait} s (it has {limit} s)"
    return f"the free capacity it fits is held for {job_id} on {where}, which starts there in {wait} s; with {ask} it " \
           "could backfill"


# --- which reasons the log records ---------------------------------------------------------------------------------


POOL_NOTE = "may add nodes for it"  # a job no node could run, that a node pool's new nodes could


def reason_class(reason: str) -> str:
    """The kind of wait a reason names: what a person (or a system reading the log) acts on. The details
    (how many GPUs are free, on which node) change with every job that starts or ends elsewhere."""
    if reason.startswith("waiting for dependency"):
        return "dependency"
    if reason.startswith("array "):
        return "array"
    if reason.startswith("singleton:"):
        return "singleton"
    if "at its limit of" in reason or "above the limit of queue" in reason:
        return "queue limit"
    if reason.startswith("waiting for preemption") or "to leave: reclaimed" in reason:
        return "evictions"
    if POOL_NOTE in reason:  # it waits for nodes the autoscaler adds: not stuck
        return "no room now"
    if any(w in reason for w in ("can never", "no schedulable node", "even when idle", "even empty",
                                 "no node could ever")):
        return "never fits"
    # a job held back for a reservation waits for room too: which of the two it is flips for the whole queue
    # each time a large job reaches or leaves the head of it (bench.e2e: 58 reason events per job at 500 jobs)
    return "no room now"


def worth_logging(logged: str, logged_at: float | None, reason: str, now: float, refresh_s: float) -> bool:
    """Whether a waiting job's new reason goes to the log: when its class changes, or when its words changed
    and the last one logged is at least ``refresh_s`` old. Otherwise it is state: the API serves the latest."""
    if reason == logged:
        return False
    if not logged or reason_class(reason) != reason_class(logged):
        return True
    return logged_at is None or now - logged_at >= refresh_s
