"""The control plane's heap out of the cyclic collector's sight (shared.aio.freeze_survivors): after each collection
of the older generations its survivors are frozen, so that a full collection walks only what is new, not a
backlog's long-lived objects; garbage cycles are freed by the collection first, and frozen ones at the thaw."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from shared import aio
from tests.support import eventually


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def freezer():
    """The callback installed, and only the tests' own collections run: an automatic one of an older generation (the
    thresholds count the allocations of every test before) froze survivors before the test looked (failed in CI)."""
    enabled = gc.isenabled()
    gc.disable()
    gc.unfreeze()
    gc.callbacks.append(aio.freeze_survivors)
    try:
        yield
    finally:
        gc.callbacks.remove(aio.freeze_survivors)
        gc.unfreeze()
        gc.collect()
        if enabled:
            gc.enable()


def test_survivors_of_an_older_collection_are_frozen_and_garbage_cycles_freed_first(freezer):
    kept = [Node() for _ in range(1000)]
    dropped = cycle()  # garbage already: the collection frees it, the freeze never sees it
    gc.collect(0)
    assert gc.get_freeze_count() == 0, "a collection of the youngest generation freezes nothing"
    gc.collect(1)
    assert dropped() is None
    assert gc.get_freeze_count() >= len(kept)
    held = cycle()
    live = [held()]
    gc.collect(1)  # survives: frozen
    live.clear()  # garbage now, but frozen: no collection sees it
    gc.collect()
    assert held() is not None, "a frozen cycle waits for the thaw"


async def test_the_thaw_frees_a_cycle_that_became_garbage_while_frozen(freezer):
    ref = cycle()
    obj = [ref()]
    gc.collect(1)
    obj.clear()
    gc.collect()
    assert ref() is not None  # frozen: out of sight
    thaws = asyncio.create_task(aio.thaw_hourly(every_s=0.05))
    try:
        await eventually(lambda: ref() is None, timeout=5, what="the thaw's full collection to free the cycle")
        assert gc.get_freeze_count() > 0, "the thaw's survivors frozen again"
    finally:
        thaws.cancel()
        await asyncio.gather(thaws, return_exceptions=True)


def test_every_process_run_through_shared_aio_freezes_its_survivors_and_leaves_no_callback():
    gc.unfreeze()

    async def main() -> int:
        kept = [Node() for _ in range(100)]
        gc.collect(1)
        return gc.get_freeze_count() - len(kept)
    try:
        assert aio.run(main()) >= 0
        assert aio.freeze_survivors not in gc.callbacks
    finally:
        gc.unfreeze()
