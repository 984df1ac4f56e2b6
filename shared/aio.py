"""asyncio helpers."""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Until ``event`` is set or ``timeout`` passes. Unlike ``asyncio.wait_for`` on Python 3.11, a
    cancellation arriving as the event fires is never swallowed, so a loop built on it always stops."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return event.is_set()
