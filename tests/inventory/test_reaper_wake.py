"""The reaper hears of a task's exit when it happens, not at its next 0.1 s round (bench.e2e: `true` took 0.2-0.5 s
from its start to its exit report)."""

from __future__ import annotations

import asyncio
import subprocess

from services.inventory.agent import notify_on_exit
from shared.aio import wait_event


async def test_a_child_that_exits_sets_the_reapers_event() -> None:
    exited = asyncio.Event()
    proc = subprocess.Popen(["sleep", "0.2"])
    try:
        assert notify_on_exit(proc.pid, exited), "this kernel has pidfd_open (Linux 5.3+)"
        assert not exited.is_set()
        assert await wait_event(exited, 10), "the exit woke the waiter"
        assert proc.poll() is not None
    finally:
        proc.kill()
        proc.wait()
