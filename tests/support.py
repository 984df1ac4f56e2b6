"""Helpers for tests that run services: poll with a deadline, run a service in the test's loop."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from shared.eventlog import EventLog
from shared.runtime import Service


async def eventually(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(svc: Service, log: EventLog) -> AsyncIterator[Service]:
    task = asyncio.create_task(svc.run(log))
    try:
        await asyncio.wait_for(svc.ready.wait(), 10)
        yield svc
    finally:
        svc.stop()
        await asyncio.wait_for(task, 15)


def wait_until(cond: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
