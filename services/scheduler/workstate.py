"""The cycle's working copy of free capacity, with nodes grouped into equivalence classes by free state.

Nodes with the same static make-up (GPU models, memory, compute capability,
NVLink layout, MIG layout, labels) and the same free state (per-GPU milli, free
MIG slices, CPU, memory) are interchangeable for every decision except the
tie-break, so capacity, score and GPU choice are computed once per class and
memoised there. Rack and zone are not part of a class (scores ignore them): a
class keeps its members per (zone, rack) for gangs that must stay together.
Classes are indexed by their largest free block; a shape only scans the classes
that can hold it. Every mutation returns its undo.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from services.scheduler.equivalence import Cand, NodeClass, NodeType, Pick, WNode, node_priorities
from services.scheduler.placement import NodeScorer, pick_whole
from services.scheduler.shapes import ShapeBook, TaskShape, parse_cc
from services.scheduler.snapshot import NodeSnap, RunningJob
from shared.model import MILLI, JobSpec

NOW, LONG = "now", "long"  # a job that ends before the reservation sees NOW; one that may not, sees LONG
UNBOUNDED = 1 << 30
Footprint = tuple[tuple[int, tuple[tuple[int, int, int], ...], int, int, str | None], ...]


class WorkState:
    """Free capacity of the schedulable nodes, as classes; what one cycle tries, keeps and undoes."""

    def __init__(
        self, nodes: Sequence[NodeSnap], scorer: NodeScorer, seed: int = 0, empty: bool = False,
        book: ShapeBook | None = None,
    ) -> None:
        """Schedulable nodes only. ``empty``: as if nothing ran (to tell "never fits" from "not now")."""
        self.scorer = scorer
        self.book = book or ShapeBook()
        self.shapes, self.pods = self.book.shapes, self.book.pods
        self.tagged = scorer.needs_tags
        self.nodes: list[WNode] = []
        self.index_of: dict[str, int] = {}
        self.uuid_at: dict[str, tuple[int, int, int]] = {}  # uuid -> (node, gpu, MIG bit or 0)
        self.classes: dict[tuple, NodeClass] = {}
        self.max_gpus = max((len(n.gpus) for n in nodes), default=0)
        self.by_whole: list[dict[tuple, NodeClass]] = [{} for _ in range(self.max_gpus + 1)]
        self.partial: dict[tuple, NodeClass] = {}
        self.by_mig: dict[str, dict[tuple, NodeClass]] = {}
        self.nonempty: dict[tuple, NodeClass] = {}
        self.reserved: list[int] = []
        self._types: dict[tuple, NodeType] = {}
        self._elig: dict[tuple[int, int], tuple[bool, ...] | None] = {}
        prio = node_priorities((n.node_id for n in nodes if n.schedulable), seed)
        for snap in nodes:
            if snap.schedulable:
                self._add(snap, prio[snap.node_id], empty)

    # --- building -------------------------------------------------------------------

    def _type(self, snap: NodeSnap) -> NodeType:
        local: dict[str, int] = {}
        domains = []
        for g in snap.gpus:
            key = g.nvlink_domain if g.nvlink_domain is not None else f"\0{g.index}"
            domains.append(local.setdefault(key, len(local)))
        sig = (
            tuple(g.model for g in snap.gpus),
            tuple(g.memory_mib for g in snap.gpus),
            tuple(g.compute_capability for g in snap.gpus),
            tuple(domains),
            tuple(tuple(s.profile for s in g.mig_slices) if g.mig_enabled else None for g in snap.gpus),
            tuple(sorted(snap.labels.items())),
            tuple(g.healthy for g in snap.gpus),
        )
        t = self._types.get(sig)
        if t is None:
            models, memory, cc, *rest = sig
            t = self._types[sig] = NodeType(len(self._types), models, memory, tuple(parse_cc(c) for c in cc), *rest)
        return t

    def _add(self, snap: NodeSnap, prio: int, empty: bool) -> None:
        idx = len(self.nodes)
        t = self._type(snap)
        if empty:
            free = [MILLI if ok and m is None else 0 for ok, m in zip(t.usable, t.mig)]
            mig = [(1 << len(g.mig_slices)) - 1 if ok else 0 for ok, g in zip(t.usable, snap.gpus)]
            cpu, mem = snap.cpu_total, snap.mem_total
        else:
            free = [g.free_milli for g in snap.gpus]
            mig = [sum(1 << b for b, s in enumerate(g.mig_slices) if s.free) for g in snap.gpus]
            cpu, mem = snap.cpu_free, snap.mem_free
        node = WNode(idx, snap.node_id, t, (snap.zone, snap.rack), free, cpu, mem, mig,
                     tuple(g.uuid for g in snap.gpus), tuple(tuple(s.uuid for s in g.mig_slices) for g in snap.gpus))
        node.prio = prio
        self.nodes.append(node)
        self.index_of[snap.node_id] = idx
        for gi, g in enumerate(snap.gpus):
            self.uuid_at[g.uuid] = (idx, gi, 0)
            for b, s in enumerate(g.mig_slices):
                self.uuid_at[s.uuid] = (idx, gi, 1 << b)
        self._place(node)

    def shape_id(self, shape: TaskShape) -> int:
        return self.book.id(shape)

    # --- classes and their index -----------------------------------------------------

    def _key(
        self, t: NodeType, free: Sequence[int], cpu: int, mem: int, mig: Sequence[int], tags: dict[str, int]
    ) -> tuple:
        tag_key = tuple(sorted((k, v) for k, v in tags.items() if v)) if self.tagged else ()
        return (t.id, tuple(free), cpu, mem, tuple(mig), tag_key)

    def class_of(
        self, t: NodeType, free: Sequence[int], cpu: int, mem: int, mig: Sequence[int], tags: dict[str, int]
    ) -> NodeClass:
        key = self._key(t, free, cpu, mem, mig, tags)
        cls = self.classes.get(key)
        if cls is None:
            cls = self.classes[key] = NodeClass(key, t, key[1], cpu, mem, key[4], key[5])
        return cls

    def _index(self, cls: NodeClass, add: bool) -> None:
        buckets = [self.nonempty]
        if cls.whole:
            buckets.append(self.by_whole[cls.whole])
        if cls.max_free:
            buckets.append(self.partial)
        for gi, mask in enumerate(cls.mig):
            profiles = cls.type.mig[gi]
            if mask and profiles:
                for b, p in enumerate(profiles):
                    if mask >> b & 1:
                        buckets.append(self.by_mig.setdefault(p, {}))
        for b in buckets:
            if add:
                b[cls.key] = cls
            else:
                b.pop(cls.key, None)

    def _place(self, node: WNode) -> None:
        """Move a node to the class of its current free state (reserved nodes stay out of the index)."""
        old = node.cls
        if old is not None:
            del old.members[node.idx]
            site = old.sites[node.site]
            del site[node.idx]
            if not site:
                del old.sites[node.site]
            if not old.members:
                self._index(old, add=False)
            node.cls = None
        if node.slack is not None:
            return
        cls = self.class_of(node.type, node.free, node.cpu, node.mem, node.mig, node.tags)
        if not cls.members:
            self._index(cls, add=True)
        cls.members[node.idx] = None
        cls.sites.setdefault(node.site, {})[node.idx] = None
        heapq.heappush(cls.heap, (node.prio, node.idx))
        node.cls = cls

    def first_member(self, cls: NodeClass) -> int:
        """The member with the smallest priority (lazy deletion: stale heap entries are dropped here)."""
        heap = cls.heap
        while heap[0][1] not in cls.members:
            heapq.heappop(heap)
        return heap[0][1]

    # --- per class, per shape ----------------------------------------------------------

    def eligible(self, t: NodeType, sid: int) -> tuple[bool, ...] | None:
        """Which GPUs of a node type a shape may use; None if the node is out (labels, or no GPU qualifies)."""
        key = (t.id, sid)
        if key in self._elig:
            return self._elig[key]
        s = self.shapes[sid]
        labels = dict(t.labels)
        ok: tuple[bool, ...] | None
        if any(labels.get(k) != v for k, v in s.selector):
            ok = None
        elif s.gpus == 0:
            ok = ()
        else:
            ok = tuple(
                usable
                and (not s.models or model in s.models)
                and mem >= s.min_memory_mib
                and (s.min_cc is None or (cc is not None and cc >= s.min_cc))
                and ((mig is not None and s.mig in mig) if s.mig else mig is None)
                for model, mem, cc, mig, usable in zip(t.models, t.memory, t.cc, t.mig, t.usable)
            )
            if not any(ok):
                ok = None
        self._elig[key] = ok
        return ok

    def gpu_cap(self, cls: NodeClass, sid: int) -> int:
        """How many tasks of the shape the class's GPUs hold, ignoring CPU and memory."""
        s = self.shapes[sid]
        ok = self.eligible(cls.type, sid)
        if ok is None:
            return 0
        if s.gpus == 0:
            return UNBOUNDED
        if s.mig:
            n = 0
            for gi, profiles in enumerate(cls.type.mig):
                if ok[gi] and profiles:
                    mask = cls.mig[gi]
                    n += sum(1 for b, p in enumerate(profiles) if p == s.mig and mask >> b & 1)
            return n
        if s.milli < MILLI:
            return sum(r // s.milli for r, e in zip(cls.free, ok) if e)
        if s.one_domain:
            per: dict[int, int] = {}
            for r, e, d in zip(cls.free, ok, cls.type.domains):
                if e and r >= MILLI:
                    per[d] = per.get(d, 0) + 1
            return sum(n // s.gpus for n in per.values())
        return sum(1 for r, e in zip(cls.free, ok) if e and r >= MILLI) // s.gpus

    def cap(self, cls: NodeClass, sid: int) -> int:
        c = cls.caps.get(sid)
        if c is None:
            s = self.shapes[sid]
            c = self.gpu_cap(cls, sid)
            if s.cpu:
                c = min(c, cls.cpu // s.cpu)
            if s.mem:
                c = min(c, cls.mem // s.mem)
            if s.per_node:  # a node holds exactly per_node tasks of the gang, or none
                c = s.per_node if c >= s.per_node else 0
            cls.caps[sid] = c
        return c

    def score(self, cls: NodeClass, sid: int) -> object:
        s = cls.scores.get(sid)
        if s is None:
            s = cls.scores[sid] = self.scorer.score(cls.rep, self.pods[sid], self.eligible(cls.type, sid) or None)
        return s

    def pick(self, cls: NodeClass, sid: int) -> Pick | None:
        """The GPUs (or MIG slice) one task takes in this class's free state."""
        if self.scorer.deterministic and sid in cls.picks:
            return cls.picks[sid]
        s = self.shapes[sid]
        ok = self.eligible(cls.type, sid)
        pick: Pick | None
        if ok is None:
            pick = None
        elif s.gpus == 0:
            pick = ()
        elif s.mig:
            pick = next(
                (((gi, 1 << b),) for gi, profiles in enumerate(cls.type.mig) if ok[gi] and profiles
                 for b, p in enumerate(profiles) if p == s.mig and cls.mig[gi] >> b & 1),
                None,
            )
        elif s.milli < MILLI:
            g = self.scorer.shared_gpu(cls.rep, self.pods[sid], ok)
            pick = None if g is None else ((g, 0),)
        else:
            gs = pick_whole(cls.free, s.gpus, MILLI, ok, cls.type.domains, s.one_domain)
            pick = None if gs is None else tuple((g, 0) for g in gs)
        if self.scorer.deterministic:
            cls.picks[sid] = pick
        return pick

    # --- candidates -------------------------------------------------------------------

    def _scan(self, sid: int) -> Iterable[NodeClass]:
        s = self.shapes[sid]
        if s.gpus == 0:
            return self.nonempty.values()
        if s.mig:
            return self.by_mig.get(s.mig, {}).values()
        if s.milli < MILLI:
            return [c for c in self.partial.values() if c.max_free >= s.milli]
        if s.gpus > self.max_gpus:
            return ()
        return [c for b in self.by_whole[s.gpus:] for c in b.values()]

    def effective_class(self, idx: int, mode: str) -> NodeClass:
        """The class of what a job in ``mode`` may use on a node: held-back capacity is invisible to LONG jobs."""
        n = self.nodes[idx]
        if n.slack is None:
            assert n.cls is not None
            return n.cls
        if mode == NOW:
            return self.class_of(n.type, n.free, n.cpu, n.mem, n.mig, n.tags)
        sf, sc, sm, smig = n.slack
        return self.class_of(
            n.type, [min(a, b) for a, b in zip(n.free, sf)], min(n.cpu, sc), min(n.mem, sm),
            [a & b for a, b in zip(n.mig, smig)], n.tags,
        )

    def candidates(self, sid: int, mode: str = NOW) -> list[Cand]:
        out = [Cand(c, cap) for c in self._scan(sid) if (cap := self.cap(c, sid)) > 0]
        for idx in self.reserved:
            cls = self.effective_class(idx, mode)
            if (cap := self.cap(cls, sid)) > 0:
                out.append(Cand(cls, cap, idx))
        return out

    # --- mutations (each returns its undo) ---------------------------------------------

    def _save(self, n: WNode) -> tuple:
        slack = None if n.slack is None else (list(n.slack[0]), n.slack[1], n.slack[2], list(n.slack[3]))
        return (n.idx, list(n.free), n.cpu, n.mem, list(n.mig), dict(n.tags), slack)

    def take(self, idx: int, sid: int, pick: Pick, mode: str = NOW) -> tuple:
        n = self.nodes[idx]
        undo = self._save(n)
        s = self.shapes[sid]
        targets = [(n.free, n.mig)]
        if n.slack is not None and mode == LONG:
            targets.append((n.slack[0], n.slack[3]))
        for free, mig in targets:
            for g, bit in pick:
                if bit:
                    mig[g] &= ~bit
                else:
                    free[g] -= s.milli
        n.cpu -= s.cpu
        n.mem -= s.mem
        if n.slack is not None and mode == LONG:
            f, c, m, mg = n.slack
            n.slack = (f, c - s.cpu, m - s.mem, mg)
        if self.tagged and (tag := self.pods[sid].tag):
            n.tags[tag] = n.tags.get(tag, 0) + 1
        self._place(n)
        return undo

    def give(self, footprint: Footprint) -> tuple:
        """Hand back what a running job holds (for "what if it ended" questions)."""
        undo = []
        for idx, gpus, cpu, mem, tag in footprint:
            n = self.nodes[idx]
            undo.append(self._save(n))
            for g, bit, milli in gpus:
                if not n.type.usable[g]:
                    continue
                if bit:
                    n.mig[g] |= bit
                elif n.type.mig[g] is None:
                    n.free[g] = min(MILLI, n.free[g] + milli)
            n.cpu += cpu
            n.mem += mem
            if self.tagged and tag and n.tags.get(tag):
                n.tags[tag] -= 1
            self._place(n)
        return undo

    def undo(self, undos: Iterable[tuple]) -> None:
        for idx, free, cpu, mem, mig, tags, slack in reversed(list(undos)):
            n = self.nodes[idx]
            n.free, n.cpu, n.mem, n.mig, n.tags, n.slack = free, cpu, mem, mig, tags, slack
            self._place(n)

    def hold(self, slack: dict[int, tuple[list[int], int, int, list[int]]]) -> None:
        """Keep the reservation's share of these nodes from jobs that may outlast its start."""
        for idx, s in slack.items():
            n = self.nodes[idx]
            n.slack = s
            self._place(n)
            self.reserved.append(idx)

    def footprint(self, job: RunningJob, pods: dict[str, str | None] | None = None) -> Footprint:
        """Where a running job's tasks sit in this state (tasks on nodes outside it are skipped)."""
        tag = self._tag(job.spec) if self.tagged else None
        out = []
        for p in job.placements:
            idx = self.index_of.get(p.node_id)
            if idx is None:
                continue
            gpus = []
            for share in p.gpus:
                at = self.uuid_at.get(share.uuid)
                if at is not None and at[0] == idx:
                    gpus.append((at[1], at[2], share.milli))
            out.append((idx, tuple(gpus), p.cpu_milli, p.memory_mib, tag))
        return tuple(out)

    def _tag(self, spec: JobSpec) -> str | None:
        return TaskShape.of(spec).pod.tag

    def note_running(self, jobs: Iterable[RunningJob]) -> None:
        """Count running pods' GPU-shape tags on their nodes (GpuClustering only)."""
        if not self.tagged:
            return
        for job in jobs:
            tag = self._tag(job.spec)
            if not tag:
                continue
            for p in job.placements:
                idx = self.index_of.get(p.node_id)
                if idx is not None:
                    n = self.nodes[idx]
                    n.tags[tag] = n.tags.get(tag, 0) + 1
                    self._place(n)
