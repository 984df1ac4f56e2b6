"""Gang placement: all tasks of a job at once, as tight as topology allows, or nothing.

Nodes without a rack (zone) label count as one unnamed rack (zone): a cluster
that never labelled its racks is treated as flat.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import NamedTuple
from dataclasses import dataclass, replace

from services.scheduler.equivalence import Cand, Pick, Site
from services.scheduler.workstate import NOW, WorkState
from shared.model import MILLI

LEVELS = ("node", "rack", "zone", "any")  # how far a gang may spread, tightest first


def widest(topology: str) -> str:
    """The loosest gang spread a topology allows; nvlink constrains each task, not the gang."""
    return "any" if topology == "nvlink" else topology


@dataclass(frozen=True, slots=True)
class Capacity:
    """How many tasks of a shape fit now in the best node, rack, zone, and the whole cluster."""

    node: int = 0
    node_id: str = ""
    rack: int = 0
    rack_site: Site = ("", "")
    zone: int = 0
    zone_name: str = ""
    total: int = 0

    def at(self, level: str) -> int:
        return {"node": self.node, "rack": self.rack, "zone": self.zone}.get(level, self.total)

    def fits(self, tasks: int, topology: str) -> bool:
        return self.at(widest(topology)) >= tasks


class Unit(NamedTuple):
    """Nodes of one class in one site (or one reserved node), each holding ``cap`` tasks."""

    cap: int
    site: Site
    cand: Cand
    count: int


def _units(ws: WorkState, cands: list[Cand]) -> Iterator[Unit]:
    for c in cands:
        if c.node >= 0:
            yield Unit(c.cap, ws.nodes[c.node].site, c, 1)
        else:
            for site, members in c.cls.sites.items():
                yield Unit(c.cap, site, c, len(members))


def capacity(ws: WorkState, sid: int, mode: str = NOW, cands: list[Cand] | None = None) -> Capacity:
    cands = ws.candidates(sid, mode) if cands is None else cands
    best = (0, 0, "")
    sites: dict[Site, int] = {}
    zones: dict[str, int] = {}
    for c in cands:
        node = ws.nodes[c.node if c.node >= 0 else ws.first_member(c.cls)]
        if (c.cap, -node.prio) > best[:2]:
            best = (c.cap, -node.prio, node.node_id)
    for u in _units(ws, cands):
        sites[u.site] = sites.get(u.site, 0) + u.cap * u.count
        zones[u.site[0]] = zones.get(u.site[0], 0) + u.cap * u.count
    rack_site, rack = max(sites.items(), key=lambda kv: (kv[1], kv[0]), default=(("", ""), 0))
    zone_name, zone = max(zones.items(), key=lambda kv: (kv[1], kv[0]), default=("", 0))
    return Capacity(best[0], best[2], rack, rack_site, zone, zone_name, sum(zones.values()))


@dataclass(frozen=True, slots=True)
class GangFit:
    """Where each task goes: (node index, pick) in task order, the undos to discard it, and the spread reached."""

    tasks: tuple[tuple[int, Pick], ...]
    undo: tuple[tuple, ...]
    spread: str


def _prio(ws: WorkState, c: Cand) -> int:
    return ws.nodes[c.node].prio if c.node >= 0 else ws.nodes[ws.first_member(c.cls)].prio


def _fill(ws: WorkState, sid: int, plan: list[tuple[int, int]], mode: str) -> tuple[list[tuple[int, Pick]], list[tuple]]:
    """Take ``n`` tasks on each planned node, one at a time, re-reading the node's state after each."""
    tasks, undo = [], []
    for idx, n in plan:
        for _ in range(n):
            pick = ws.pick(ws.effective_class(idx, mode), sid)
            assert pick is not None, "capacity said the task fits"
            undo.append(ws.take(idx, sid, pick, mode))
            tasks.append((idx, pick))
    return tasks, undo


def _one_node(ws: WorkState, sid: int, tasks: int, cands: list[Cand]) -> int | None:
    """The node to hold the whole gang: best score, ties to the smallest priority (random: a uniform draw)."""
    fitting = [c for c in cands if c.cap >= tasks]
    if not fitting:
        return None
    if not ws.scorer.deterministic:
        pools = [[c.node] if c.node >= 0 else c.cls.members for c in fitting]
        r = ws.scorer.rng.randrange(sum(len(p) for p in pools))
        for pool in pools:
            if r < len(pool):
                return next(islice(pool, r, None))
            r -= len(pool)
    best = max(fitting, key=lambda c: (ws.score(c.cls, sid), -_prio(ws, c)))
    return best.node if best.node >= 0 else ws.first_member(best.cls)


def _members(ws: WorkState, u: Unit) -> list[int]:
    if u.cand.node >= 0:
        return [u.cand.node]
    return sorted(u.cand.cls.sites[u.site], key=lambda i: ws.nodes[i].prio)


def _nodes_needed(units: list[Unit], tasks: int) -> int:
    nodes = 0
    for u in sorted(units, key=lambda u: -u.cap):
        if tasks <= u.cap * u.count:
            return nodes + -(-tasks // u.cap)
        nodes += u.count
        tasks -= u.cap * u.count
    return 1 << 30


def _spread_plan(ws: WorkState, sid: int, tasks: int, level: str, units: list[Unit]) -> list[tuple[int, int]] | None:
    """Nodes for a gang that no single node holds, in the tightest group the level allows.

    1. Group by rack, then zone, then the whole cluster, stopping at ``level``.
    2. Within the first level that has room, take the group needing the fewest nodes.
    3. Fill nodes biggest capacity first (fewest nodes), then from the fullest rack
       (fewest racks), then by score and node priority.
    """
    groupings = [("rack", lambda s: s), ("zone", lambda s: s[0]), ("any", lambda s: "")]
    for name, group_of in groupings:
        if LEVELS.index(name) > LEVELS.index(level):
            return None
        groups: dict[object, list[Unit]] = {}
        for u in units:
            groups.setdefault(group_of(u.site), []).append(u)
        fitting = [(g, us) for g, us in groups.items() if sum(u.cap * u.count for u in us) >= tasks]
        if not fitting:
            continue
        _, chosen = min(fitting, key=lambda gu: (_nodes_needed(gu[1], tasks), str(gu[0])))
        rack_total: dict[Site, int] = {}
        for u in chosen:
            rack_total[u.site] = rack_total.get(u.site, 0) + u.cap * u.count
        det = ws.scorer.deterministic

        def preference(u: Unit) -> tuple:
            score = _neg(ws.score(u.cand.cls, sid)) if det else 0
            return (-u.cap, -rack_total[u.site], u.site, score, _prio(ws, u.cand))

        order = sorted(chosen, key=preference)
        plan, left = [], tasks
        for u in order:
            for idx in _members(ws, u):
                n = min(u.cap, left)
                plan.append((idx, n))
                left -= n
                if not left:
                    return plan
    return None


def _neg(score: object) -> object:
    return tuple(-x for x in score) if isinstance(score, tuple) else -score  # type: ignore[operator]


def spread_of(ws: WorkState, tasks: list[tuple[int, Pick]]) -> str:
    nodes = {idx for idx, _ in tasks}
    if len(nodes) == 1:
        t = ws.nodes[next(iter(nodes))].type
        domains = {t.domains[g] for _, pick in tasks for g, _ in pick}
        return "nvlink" if len(domains) == 1 else "node"
    sites = {ws.nodes[i].site for i in nodes}
    if len(sites) == 1:
        return "rack"
    return "zone" if len({s[0] for s in sites}) == 1 else "any"


def place_gang(ws: WorkState, sid: int, tasks: int, topology: str, mode: str = NOW) -> GangFit | None:
    """Place every task of a gang on ``ws`` (kept; undo with ``ws.undo(fit.undo)``), or change nothing.

    A multi-GPU task prefers GPUs in one NVLink domain: it is first placed as if
    that were required, unless that would split a gang that one node can hold.
    """
    s = ws.shapes[sid]
    if s.gpus > 1 and s.milli == MILLI and not s.one_domain:
        strict = ws.shape_id(replace(s, one_domain=True))
        if tasks == 1 or _most(ws, strict, mode) >= tasks or _most(ws, sid, mode) < tasks:
            fit = _place(ws, strict, tasks, topology, mode)
            if fit is not None:
                return fit
    return _place(ws, sid, tasks, topology, mode)


def _most(ws: WorkState, sid: int, mode: str) -> int:
    return max((c.cap for c in ws.candidates(sid, mode)), default=0)


def _place(ws: WorkState, sid: int, tasks: int, topology: str, mode: str) -> GangFit | None:
    """1. Capacity per class is exact for identical tasks, so "does it fit" is
       answered before any node is touched: no partial gang is ever built.
    2. One node if any node holds the whole gang (the policy scores the node).
    3. Else the tightest rack / zone / cluster allowed, fewest nodes first.
    """
    level = widest(topology)
    cands = ws.candidates(sid, mode)
    if not cands:
        return None
    idx = _one_node(ws, sid, tasks, cands)
    if idx is not None:
        plan = [(idx, tasks)]
    elif level == "node":
        return None
    else:
        units = list(_units(ws, cands))
        if sum(u.cap * u.count for u in units) < tasks:
            return None
        found = _spread_plan(ws, sid, tasks, level, units)
        if found is None:
            return None
        plan = found
    placed, undo = _fill(ws, sid, plan, mode)
    return GangFit(tuple(placed), tuple(undo), spread_of(ws, placed))
