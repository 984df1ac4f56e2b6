"""Node equivalence classes: the static make-up of a node, its free state, and the per-shape memo of a class."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from services.scheduler.placement import NodeFree
from shared.model import MILLI

Site = tuple[str, str]  # (zone, rack)
Pick = tuple[tuple[int, int], ...]  # per GPU used: (gpu index, MIG slice bit or 0)


@dataclass(frozen=True, slots=True, eq=False)
class NodeType:
    """The static make-up of a node; nodes of one type differ only in what is free."""

    id: int
    models: tuple[str, ...]
    memory: tuple[int, ...]
    cc: tuple[tuple[int, int] | None, ...]
    domains: tuple[int, ...]  # NVLink domain number per GPU; a GPU without one is alone
    mig: tuple[tuple[str, ...] | None, ...]  # MIG slice profiles per GPU; None: not in MIG mode
    labels: tuple[tuple[str, str], ...]
    usable: tuple[bool, ...]

    @property
    def model(self) -> str:
        for m, ok in zip(self.models, self.usable):
            if ok:
                return m
        return self.models[0] if self.models else ""


class NodeClass:
    """Nodes in one free state. Capacity, score and GPU pick per task shape are memoised here."""

    __slots__ = ("key", "type", "free", "cpu", "mem", "mig", "tags", "whole", "max_free", "members", "sites",
                 "heap", "caps", "scores", "picks", "rep")

    def __init__(self, key: tuple, type_: NodeType, free: tuple[int, ...], cpu: int, mem: int,
                 mig: tuple[int, ...], tags: tuple[tuple[str, int], ...]) -> None:
        self.key, self.type, self.free, self.cpu, self.mem, self.mig, self.tags = key, type_, free, cpu, mem, mig, tags
        self.whole = sum(1 for r in free if r >= MILLI)
        self.max_free = max(free, default=0)
        self.members: dict[int, None] = {}
        self.sites: dict[Site, dict[int, None]] = {}
        self.heap: list[tuple[int, int]] = []
        self.caps: dict[int, int] = {}
        self.scores: dict[int, object] = {}
        self.picks: dict[int, Pick | None] = {}
        self.rep = NodeFree("", 0, type_.model, cpu, mem, list(free), dict(tags))


class WNode:
    __slots__ = ("idx", "node_id", "prio", "type", "site", "free", "cpu", "mem", "mig", "tags", "cls", "slack",
                 "gpu_uuids", "slice_uuids")

    def __init__(self, idx: int, node_id: str, type_: NodeType, site: Site, free: list[int], cpu: int, mem: int,
                 mig: list[int], gpu_uuids: tuple[str, ...], slice_uuids: tuple[tuple[str, ...], ...]) -> None:
        self.idx, self.node_id, self.type, self.site = idx, node_id, type_, site
        self.prio = 0
        self.free, self.cpu, self.mem, self.mig = free, cpu, mem, mig
        self.tags: dict[str, int] = {}
        self.cls: NodeClass | None = None
        self.slack: tuple[list[int], int, int, list[int]] | None = None  # held for the reservation
        self.gpu_uuids, self.slice_uuids = gpu_uuids, slice_uuids


@dataclass(frozen=True, slots=True)
class Cand:
    """Somewhere a shape fits ``cap`` times: a class (all its members) or one reserved node."""

    cls: NodeClass
    cap: int
    node: int = -1


def node_priorities(node_ids: Iterable[str], seed: int) -> dict[str, int]:
    """A fixed pseudo-random node order (the simulator's permuted name prefix), stable as nodes come and go."""
    def h(n: str) -> bytes:
        return hashlib.blake2b(f"{seed}:{n}".encode(), digest_size=8).digest()

    return {n: rank for rank, n in enumerate(sorted(node_ids, key=lambda n: (h(n), n)))}
