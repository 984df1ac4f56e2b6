"""A brute-force placer: the test oracle for gang placement, written without the scheduler's code.

It reads the cluster as the projection holds it (what each node has, what is allocated), reads a job
spec as DESIGN.md states the rules (constraints, fractional GPUs, MIG, NVLink, gang level), and answers
by enumeration instead of by the scheduler's classes, capacities and scores:

    fits(state, spec)            does any placement of the whole gang exist?
    take(state, spec, tasks)     is this placement feasible (capacity, constraints, level)? then hold it
    spread(state, tasks)         the tightest level a placement reached

``fits`` enumerates, node by node, every multiset of per-task picks (a GPU set, a GPU share, a MIG
slice, or no GPU), so it is exact: nodes share nothing, so a gang fits within a group of nodes (one
node, rack, zone, the cluster) exactly when the most tasks each node can hold add up to the gang.
Meant for small clusters (a few nodes of up to 8 GPUs, gangs of a few tasks).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import combinations

from shared.cluster import ClusterProjection
from shared.events import TaskPlacement
from shared.model import JobSpec

WHOLE = 1000


def cc_tuple(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    return tuple(int(x) for x in text.split("."))


@dataclass
class Gpu:
    uuid: str
    node_id: str
    model: str
    memory_mib: int
    cc: tuple[int, ...] | None
    domain: str | None  # NVLink domain; None: PCIe only
    usable: bool  # healthy, on a node that takes work
    mig: bool
    free: int  # milli left (GPUs outside MIG mode)
    slices: dict[str, str]  # MIG slice uuid -> profile, the free ones
    mig_slices: dict[str, str]  # every MIG slice: uuid -> profile


@dataclass
class Node:
    node_id: str
    zone: str
    rack: str
    labels: dict[str, str]
    ready: bool
    cpu: int
    mem: int
    gpus: list[Gpu] = field(default_factory=list)


@dataclass
class State:
    nodes: dict[str, Node]

    def copy(self) -> "State":
        return copy.deepcopy(self)

    def gpu_of(self, node_id: str, uuid: str) -> tuple[Gpu, str | None] | None:
        """The GPU a share names on this node, and the MIG slice's profile if it names a slice."""
        for g in self.nodes[node_id].gpus:
            if g.uuid == uuid:
                return g, None
            if uuid in g.mig_slices:
                return g, g.mig_slices[uuid]
        return None


def state_of(proj: ClusterProjection, idle: bool = False) -> State:
    """What is free now (``idle``: as if nothing ran) on every node of the projection."""
    nodes = {}
    for node_id, ns in proj.nodes.items():
        info = ns.info
        ready = not (ns.cordoned or ns.draining or ns.lost)
        alloc = {} if idle else ns.gpu_alloc
        gpus = []
        for g in info.gpus:
            usable = ready and g.healthy and g.uuid not in ns.unhealthy
            parent_busy = alloc.get(g.uuid, 0) > 0
            gpu = Gpu(
                uuid=g.uuid, node_id=node_id, model=g.model, memory_mib=g.memory_mib, cc=cc_tuple(g.compute_capability),
                domain=g.nvlink_domain, usable=usable, mig=g.mig_enabled,
                free=WHOLE - alloc.get(g.uuid, 0) if not g.mig_enabled else 0,
                slices={s.uuid: s.profile for s in g.mig_slices if not parent_busy and not alloc.get(s.uuid, 0)}
                if g.mig_enabled else {},
                mig_slices={s.uuid: s.profile for s in g.mig_slices},
            )
            gpus.append(gpu)
        nodes[node_id] = Node(
            node_id, info.zone, info.rack, dict(info.labels), ready,
            info.cpu_milli - (0 if idle else ns.cpu_alloc), info.memory_mib - (0 if idle else ns.mem_alloc), gpus,
        )
    return State(nodes)


# --- what a job asks -------------------------------------------------------------------------


@dataclass(frozen=True)
class Need:
    tasks: int
    gpus: int  # GPUs per task (a MIG slice counts as one)
    milli: int  # per GPU: 1000 whole, less: a share
    mig: str | None
    cpu: int
    mem: int
    models: tuple[str, ...]
    min_memory_mib: int
    min_cc: tuple[int, ...] | None
    selector: dict[str, str]
    nvlink: bool  # each task's GPUs in one NVLink domain
    level: str  # how far the gang may spread: node | rack | zone | any

    @staticmethod
    def of(spec: JobSpec) -> "Need":
        milli = spec.resources.gpu_milli
        if spec.gpu.mig:
            gpus, milli = 1, WHOLE
        elif milli >= WHOLE:
            gpus, milli = milli // WHOLE, WHOLE
        else:
            gpus = 1 if milli else 0
        return Need(
            spec.tasks, gpus, milli, spec.gpu.mig, spec.resources.cpu_milli, spec.resources.memory_mib,
            tuple(spec.gpu.models), spec.gpu.min_memory_mib, cc_tuple(spec.gpu.min_compute_capability),
            dict(spec.node_selector), spec.topology == "nvlink", "any" if spec.topology == "nvlink" else spec.topology,
        )

    def gpu_ok(self, g: Gpu) -> bool:
        return (
            g.usable
            and (not self.models or g.model in self.models)
            and g.memory_mib >= self.min_memory_mib
            and (self.min_cc is None or (g.cc is not None and g.cc >= self.min_cc))
            and g.mig == bool(self.mig)
        )

    def node_ok(self, n: Node) -> bool:
        return n.ready and all(n.labels.get(k) == v for k, v in self.selector.items())


# --- enumeration ------------------------------------------------------------------------------

Pick = tuple[str, ...]  # the uuids (GPUs or one MIG slice) one task takes; () for no GPU


def picks(node: Node, need: Need) -> list[Pick]:
    """Every GPU set one task could take on this node in some state at least this free."""
    if not need.node_ok(node):
        return []
    if need.gpus == 0:
        return [()]
    ok = [g for g in node.gpus if need.gpu_ok(g)]
    if need.mig:
        return [(s,) for g in ok for s, p in g.slices.items() if p == need.mig]
    if need.milli < WHOLE:
        return [(g.uuid,) for g in ok if g.free >= need.milli]
    out = []
    for combo in combinations([g for g in ok if g.free >= WHOLE], need.gpus):
        if need.nvlink and need.gpus > 1 and (combo[0].domain is None or len({g.domain for g in combo}) > 1):
            continue
        out.append(tuple(g.uuid for g in combo))
    return out


def _room(node: Node) -> tuple[dict[str, int], set[str]]:
    return {g.uuid: g.free for g in node.gpus}, {s for g in node.gpus for s in g.slices}


def node_capacity(node: Node, need: Need, limit: int) -> int:
    """The most tasks (up to ``limit``) this node holds at once: every multiset of picks, depth first."""
    options = picks(node, need)
    if not options or node.cpu < need.cpu or node.mem < need.mem:
        return 0
    free, slices = _room(node)
    best = 0
    seen: set[tuple] = set()

    def dfs(start: int, count: int, cpu: int, mem: int) -> None:
        nonlocal best
        best = max(best, count)
        if best >= limit:
            return
        key = (start, cpu, mem, tuple(sorted(free.items())), tuple(sorted(slices)))
        if key in seen:
            return
        seen.add(key)
        if cpu < need.cpu or mem < need.mem:
            return
        for i in range(start, len(options)):
            pick = options[i]
            if need.mig:
                if pick[0] not in slices:
                    continue
                slices.discard(pick[0])
                dfs(i, count + 1, cpu - need.cpu, mem - need.mem)
                slices.add(pick[0])
            else:
                if any(free[u] < need.milli for u in pick):
                    continue
                for u in pick:
                    free[u] -= need.milli
                dfs(i, count + 1, cpu - need.cpu, mem - need.mem)
                for u in pick:
                    free[u] += need.milli
            if best >= limit:
                return

    dfs(0, 0, node.cpu, node.mem)
    return best


def groups(state: State, level: str) -> Iterator[list[Node]]:
    """The groups of nodes a gang may spread over at this level; a node without rack or zone sits in the unnamed one."""
    keyed: dict[object, list[Node]] = {}
    for n in state.nodes.values():
        key = {"node": n.node_id, "rack": (n.zone, n.rack), "zone": n.zone}.get(level, "")
        keyed.setdefault(key, []).append(n)
    yield from keyed.values()


def fits(state: State, spec: JobSpec, level: str | None = None) -> bool:
    """Does any placement of the whole gang exist (within ``level`` if given, else the job's own)?"""
    need = Need.of(spec)
    caps = {n.node_id: node_capacity(n, need, need.tasks) for n in state.nodes.values()}
    return any(sum(caps[n.node_id] for n in group) >= need.tasks for group in groups(state, level or need.level))


# --- checking a placement -------------------------------------------------------------------------


def take(state: State, spec: JobSpec, tasks: Iterable[TaskPlacement]) -> list[str]:
    """What is wrong with this placement of ``spec`` on ``state`` (nothing: []); what it holds is taken from ``state``."""
    need = Need.of(spec)
    tasks = list(tasks)
    wrong = []
    if [t.task for t in tasks] != list(range(need.tasks)):
        wrong.append(f"tasks {[t.task for t in tasks]}, wanted 0..{need.tasks - 1}")
    for t in tasks:
        node = state.nodes.get(t.node_id)
        if node is None:
            wrong.append(f"task {t.task} on unknown node {t.node_id}")
            continue
        if not need.node_ok(node):
            wrong.append(f"task {t.task} on {t.node_id}: not ready or labels {node.labels} miss {need.selector}")
        if (t.cpu_milli, t.memory_mib) != (need.cpu, need.mem):
            wrong.append(f"task {t.task} holds cpu/mem {(t.cpu_milli, t.memory_mib)}, asked {(need.cpu, need.mem)}")
        node.cpu -= t.cpu_milli
        node.mem -= t.memory_mib
        if node.cpu < 0 or node.mem < 0:
            wrong.append(f"{t.node_id} over-committed: cpu {node.cpu}, memory {node.mem} left")
        uuids = [s.uuid for s in t.gpus]
        if len(set(uuids)) != len(uuids) or len(uuids) != need.gpus:
            wrong.append(f"task {t.task} holds {uuids}, asked {need.gpus} distinct GPUs")
        held = []
        for share in t.gpus:
            found = state.gpu_of(t.node_id, share.uuid)
            if found is None:
                wrong.append(f"task {t.task}: {share.uuid} is not on {t.node_id}")
                continue
            g, profile = found
            held.append(g)
            if not need.gpu_ok(g):
                wrong.append(f"task {t.task}: {g.uuid} ({g.model}, {g.memory_mib} MiB, cc {g.cc}, mig {g.mig}, "
                             f"usable {g.usable}) does not meet the job's constraints")
            if need.mig:
                if profile != need.mig or share.mig_profile != need.mig or share.uuid not in g.slices:
                    wrong.append(f"task {t.task}: {share.uuid} is not a free {need.mig} slice")
                g.slices.pop(share.uuid, None)
            else:
                if profile is not None or share.milli != need.milli:
                    wrong.append(f"task {t.task}: share {share.milli} milli of {share.uuid}, asked {need.milli}")
                g.free -= share.milli
                if g.free < 0:
                    wrong.append(f"{g.uuid} on {t.node_id} over-committed: {g.free} milli left")
        if need.nvlink and len(held) > 1 and (held[0].domain is None or len({g.domain for g in held}) > 1):
            wrong.append(f"task {t.task}: GPUs {uuids} span NVLink domains {[g.domain for g in held]}")
    nodes = [state.nodes[t.node_id] for t in tasks if t.node_id in state.nodes]
    key = {"node": lambda n: n.node_id, "rack": lambda n: (n.zone, n.rack), "zone": lambda n: n.zone}.get(need.level)
    if key is not None and len({key(n) for n in nodes}) > 1:
        wrong.append(f"topology {need.level}, placed on {[(n.node_id, n.zone, n.rack) for n in nodes]}")
    return wrong


def release(state: State, tasks: Iterable[TaskPlacement]) -> None:
    """Give back what these tasks hold (a job that leaves)."""
    for t in tasks:
        node = state.nodes[t.node_id]
        node.cpu += t.cpu_milli
        node.mem += t.memory_mib
        for share in t.gpus:
            found = state.gpu_of(t.node_id, share.uuid)
            if found is None:
                continue
            g, profile = found
            if profile is not None:
                g.slices[share.uuid] = profile
            else:
                g.free = min(WHOLE, g.free + share.milli)


def spread(state: State, tasks: Iterable[TaskPlacement]) -> str:
    """The tightest level these tasks sit within: one NVLink domain (or one GPU), a node, a rack, a zone, or any."""
    tasks = list(tasks)
    nodes = {state.nodes[t.node_id].node_id: state.nodes[t.node_id] for t in tasks}
    if len(nodes) == 1:
        gpus = {}
        for t in tasks:
            for share in t.gpus:
                found = state.gpu_of(t.node_id, share.uuid)
                if found is not None:
                    gpus[found[0].uuid] = found[0]
        domains = {g.domain if g.domain is not None else g.uuid for g in gpus.values()}
        return "nvlink" if len(domains) == 1 else "node"
    if len({(n.zone, n.rack) for n in nodes.values()}) == 1:
        return "rack"
    return "zone" if len({n.zone for n in nodes.values()}) == 1 else "any"
