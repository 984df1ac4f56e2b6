"""One process per (service, instance): the instance name is held in KV like a lease.

Each replica of a service has its own durable consumer, named after its instance
(the host name by default). Two processes with the same name would share that
consumer and each see part of the log, so the name is locked: a key
``<service>.<instance>`` in the bucket ``gpuorch_instances`` (TTL), created by the
process that takes the name and renewed every second. A second process finds the
key renewed under it and is refused with the reason.

A restart keeps its name: the key of a process that died lapses within the TTL,
and a process on the same host whose holder is gone (its pid no longer runs, or
runs another program started later: a container's pid 1 after a restart) takes
the name over at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from shared.eventlog import JETSTREAM_READY_S, RETRYABLE

log = logging.getLogger("gpuorch.instance")

INSTANCE_BUCKET = "gpuorch_instances"
INSTANCE_TTL_S = 5.0
RENEW_S = 1.0


class InstanceTaken(RuntimeError):
    """Another live process holds this service's instance name."""


def process_start(pid: int) -> str:
    """When a process started (clock ticks since boot, from /proc); '' if it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return ""
    return "" if fields[0] == "Z" else fields[19]


def holder_id() -> str:
    """This process: host, pid and start time (a pid can be reused; the pair cannot)."""
    return f"{socket.gethostname()}:{os.getpid()}:{process_start(os.getpid())}"


def gone(holder: str) -> bool:
    """A holder on this host whose process no longer runs (only this host can tell; elsewhere: the TTL)."""
    host, pid, started = (holder.rsplit(":", 2) + ["", ""])[:3]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    if Path("/proc/self/stat").exists():
        return process_start(int(pid)) != started
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


class InstanceLock:
    def __init__(self, kv: KeyValue, service: str, instance: str, ttl_s: float = INSTANCE_TTL_S) -> None:
        self.kv, self.service, self.instance, self.ttl_s = kv, service, instance, ttl_s
        self.key = f"{service}.{instance}"
        self.holder = holder_id()
        self.revision: int | None = None
        self.stopping = False  # set before the keeper is cancelled: it ends even if a NATS call ate the cancel

    def _value(self) -> bytes:
        return json.dumps({"holder": self.holder}).encode()

    async def acquire(self) -> None:
        """Take the name, or raise InstanceTaken once its holder is seen renewing it (at most about a TTL)."""
        unanswered = time.monotonic() + JETSTREAM_READY_S
        seen: int | None = None  # the revision first seen, and until when to wait for it to lapse
        deadline = 0.0
        while True:
            try:
                self.revision = await self.kv.create(self.key, self._value())
                return
            except KeyWrongLastSequenceError:
                pass
            except RETRYABLE:  # the bucket's stream is electing a leader: ask again
                if time.monotonic() > unanswered:
                    raise
                await asyncio.sleep(0.25)
                continue
            try:
                entry = await self.kv.get(self.key)
            except KeyNotFoundError:
                continue  # it lapsed meanwhile
            except RETRYABLE:
                await asyncio.sleep(0.25)
                continue
            try:
                other = str(json.loads(entry.value or b"{}").get("holder", "?"))
            except (ValueError, AttributeError):
                other = "?"
            if gone(other):
                with contextlib.suppress(KeyWrongLastSequenceError):  # someone else was quicker: look again
                    self.revision = await self.kv.update(self.key, self._value(), last=entry.revision)
                    log.info("event=instance_taken_over service=%s instance=%s previous=%s", self.service, self.instance, other)
                    return
                continue
            if seen is None:
                seen, deadline = entry.revision, time.monotonic() + 2 * self.ttl_s + 1  # unrenewed, it lapses before
            elif entry.revision != seen or time.monotonic() > deadline:
                raise InstanceTaken(f"another {self.service} instance {self.instance!r} is running (holder {other}); "
                                    "give this one another name with --instance (GPUORCH_INSTANCE)")
            await asyncio.sleep(0.5)

    async def keep(self) -> None:
        """Renew every second until cancelled; raise InstanceTaken if another process took the name meanwhile.
        A cancellation that lands inside a NATS call may come out as that call's error: ``stopping`` (set by the
        owner before it cancels) ends the loop all the same, instead of renewing forever."""
        while not self.stopping:
            await asyncio.sleep(min(RENEW_S, self.ttl_s / 3))
            try:
                self.revision = await self.kv.update(self.key, self._value(), last=self.revision)
            except KeyWrongLastSequenceError:  # it lapsed while this process stalled: take it again if still free
                log.warning("event=instance_lapsed service=%s instance=%s", self.service, self.instance)
                self.revision = None
                await self.acquire()
            except Exception as e:  # noqa: BLE001 - NATS away: the next round tries again
                if self.stopping:
                    return
                log.debug("instance=%s renew failed error=%r", self.key, e)

    async def release(self) -> None:
        if self.revision is not None:
            with contextlib.suppress(Exception):
                await self.kv.delete(self.key, last=self.revision)
            self.revision = None
