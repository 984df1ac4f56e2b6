"""asyncio helpers."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
GC_THRESHOLD = (50_000, 20, 10)  # allocations before a young collection (Python's default: 700, 10, 10)
FREEZE_EVERY_S = 1.0  # the survivors of each second move out of the collector's sight (keep_heap_frozen)
THAW_EVERY_S = 3600.0  # and back once an hour: one full collection then frees any cycle among them


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop's event loop (a dependency): the control plane's processes spend much of their time
    in the loop's own machinery (sockets, callbacks, timers), which uvloop runs in C.

    The cyclic collector runs less often (GC_THRESHOLD): a projection holds hundreds of thousands of long-lived
    objects (a backlog's jobs and their specs), and with Python's default a burst of short-lived dicts (a
    snapshot's, a cycle's) set off full collections that walked all of them: 20,000 pending jobs' snapshot state
    took 240 ms, 70 ms of it the work itself. Garbage without cycles is freed by reference counting as before."""
    import uvloop

    gc.set_threshold(*GC_THRESHOLD)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_with_frozen_heap(main))


async def _with_frozen_heap(main: Coroutine[Any, Any, T]) -> T:
    keeper = asyncio.create_task(keep_heap_frozen(), name="gc-freeze")
    try:
        return await main
    finally:
        keeper.cancel()


async def keep_heap_frozen(every_s: float | None = None, thaw_every_s: float | None = None) -> None:
    """Every second, collect what the collector sees and freeze what survived (``gc.freeze``: the permanent
    generation, which no collection walks). A full collection then walks only what arrived since, not the
    projection's hundreds of thousands of long-lived objects: with them in sight, one full collection in a flood
    of 20,000 jobs held the event loop 0.4-0.5 s (the slowest GET /v1/jobs, bench.backlog). A garbage cycle made
    of frozen objects waits for the hourly thaw, when one full collection walks everything once."""
    every_s = FREEZE_EVERY_S if every_s is None else every_s
    thaw_every_s = THAW_EVERY_S if thaw_every_s is None else thaw_every_s
    loop = asyncio.get_running_loop()
    thawed = loop.time()
    while True:
        await asyncio.sleep(every_s)
        if loop.time() - thawed >= thaw_every_s:
            gc.unfreeze()  # the hourly full walk, below
            thawed = loop.time()
        gc.collect()  # what is in sight: a cycle that is garbage already is freed, not frozen
        gc.freeze()


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Until ``event`` is set or ``timeout`` passes. Unlike ``asyncio.wait_for`` on Python 3.11, a
    cancellation arriving as the event fires is never swallowed, so a loop built on it always stops."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return event.is_set()


class Window:
    """At most ``size`` coroutines running at once, started in the order they are given (so what each sends first
    goes out in that order); ``start`` waits for a free place; ``drain`` waits for those under way."""

    def __init__(self, size: int) -> None:
        self.places = asyncio.Semaphore(size)
        self.running: set[asyncio.Task] = set()

    async def start(self, work: Callable[..., Awaitable[None]], *args: Any) -> None:
        await self.places.acquire()
        task = asyncio.ensure_future(work(*args))
        self.running.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.running.discard(task)
        self.places.release()

    async def drain(self, timeout: float) -> None:
        if self.running:
            await asyncio.wait(set(self.running), timeout=timeout)
