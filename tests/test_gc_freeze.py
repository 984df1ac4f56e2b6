"""The control plane's heap out of the cyclic collector's sight (shared.aio.keep_heap_frozen): each second's
survivors are frozen, so that a full collection walks only what is new, not a backlog's long-lived objects; garbage
cycles are freed before they could be frozen, and frozen ones at the thaw."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from shared import aio
from shared.aio import keep_heap_frozen
from tests.support import eventually


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


async def test_survivors_are_frozen_and_garbage_cycles_are_freed_before_and_after_a_freeze():
    gc.unfreeze()
    keeper = asyncio.create_task(keep_heap_frozen(every_s=0.05, thaw_every_s=3600))
    try:
        kept = [Node() for _ in range(1000)]
        dropped = cycle()  # garbage at once: the next tick frees it, never freezes it
        await eventually(lambda: gc.get_freeze_count() > 0 and dropped() is None, timeout=5,
                         what="a tick to free the garbage cycle and freeze the rest")
        held = [cycle()]
        live = [held[0]()]  # survives a tick: frozen with the rest
        frozen = gc.get_freeze_count()
        await eventually(lambda: gc.get_freeze_count() > frozen, timeout=5, what="the next freeze")
        live.clear()  # now garbage, but frozen: no collection sees it
        gc.collect()
        assert held[0]() is not None, "a frozen cycle waits for the thaw"
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
        gc.unfreeze()
        gc.collect()
    assert held[0]() is None


async def test_the_thaw_frees_a_cycle_that_became_garbage_while_frozen():
    gc.unfreeze()
    ref = cycle()
    obj = [ref()]
    gc.freeze()
    obj.clear()
    gc.collect()
    assert ref() is not None  # frozen: out of sight
    keeper = asyncio.create_task(keep_heap_frozen(every_s=0.05, thaw_every_s=0.0))
    try:
        await eventually(lambda: ref() is None, timeout=5, what="the thaw's full collection to free the cycle")
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
        gc.unfreeze()


def test_every_process_run_through_shared_aio_keeps_its_heap_frozen(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(aio, "FREEZE_EVERY_S", 0.05)
    gc.unfreeze()

    async def main() -> int:
        kept = [Node() for _ in range(100)]
        for _ in range(100):
            if gc.get_freeze_count() >= len(kept):
                break
            await asyncio.sleep(0.05)
        return gc.get_freeze_count()
    try:
        assert aio.run(main()) >= 100
    finally:
        gc.unfreeze()
