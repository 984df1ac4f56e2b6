"""asyncio helpers."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
GC_THRESHOLD = (50_000, 20, 10)  # allocations before a young collection (Python's default: 700, 10, 10)
THAW_EVERY_S = 3600.0  # frozen objects back in the collector's sight, for one full collection (thaw_hourly)


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop's event loop (a dependency): the control plane's processes spend much of their time
    in the loop's own machinery (sockets, callbacks, timers), which uvloop runs in C.

    The cyclic collector runs less often (GC_THRESHOLD): a projection holds hundreds of thousands of long-lived
    objects (a backlog's jobs and their specs), and with Python's default a burst of short-lived dicts (a
    snapshot's, a cycle's) set off full collections that walked all of them: 20,000 pending jobs' snapshot state
    took 240 ms, 70 ms of it the work itself. Garbage without cycles is freed by reference counting as before."""
    import uvloop

    gc.set_threshold(*GC_THRESHOLD)

    gc.callbacks.append(freeze_survivors)
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(_with_thaws(main))
    finally:
        gc.callbacks.remove(freeze_survivors)


def freeze_survivors(phase: str, info: dict[str, int]) -> None:
    """After each collection of the older generations, freeze what survived (``gc.freeze``: the permanent
    generation, which no collection walks), at no walk of its own. A full collection then sees only what arrived
    since, not the projection's hundreds of thousands of long-lived objects: with them in sight, one full collection
    in a flood of 20,000 jobs held the event loop 0.4-0.5 s (the slowest GET /v1/jobs in bench.backlog). Garbage
    cycles are freed by the collection before; one made of frozen objects waits for the thaw (``thaw_hourly``)."""
    if phase == "stop" and info["generation"] >= 1:
        gc.freeze()


async def thaw_hourly(every_s: float | None = None) -> None:
    """Once an hour, one full collection over everything, frozen objects included, then freeze again."""
    while True:
        await asyncio.sleep(THAW_EVERY_S if every_s is None else every_s)
        gc.unfreeze()
        gc.collect()  # its callback freezes the survivors


async def _with_thaws(main: Coroutine[Any, Any, T]) -> T:
    thaws = asyncio.create_task(thaw_hourly(), name="gc-thaw")
    try:
        return await main
    finally:
        thaws.cancel()


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
