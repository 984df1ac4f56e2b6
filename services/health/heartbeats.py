"""When each node last beat, on this process's own clock, from a watch on the agents' heartbeat bucket.

A beat counts when its KV revision changes, timed by the monotonic clock here,
so an agent's wrong wall clock can neither hide nor fake a loss. A node is
watched from the moment health notices its registration (that counts as a beat),
so a node that never beats after registering is lost too. The watch only
suggests a loss; ``still_silent`` re-reads the key before one is declared, so a
stalled watch (a NATS restart) never loses every node at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import nats
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

log = logging.getLogger("gpuorch.health.heartbeats")


class Heartbeats:
    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.seen: dict[str, tuple[int, float]] = {}  # node -> (revision, when it changed)
        self.noticed: dict[str, tuple[int, float]] = {}  # node -> (registration seq, when noticed)
        self.watch_misses = 0  # beats the watch did not deliver but a direct read found

    def beat(self, node_id: str, revision: int) -> None:
        if self.seen.get(node_id, (None,))[0] != revision:
            self.seen[node_id] = (revision, self.clock())

    def last_beats(self, registrations: Mapping[str, int]) -> dict[str, float]:
        """Last beat of each watched node: its last revision change, or when its current registration was noticed."""
        now = self.clock()
        out = {}
        for node_id, reg in registrations.items():
            if self.noticed.get(node_id, (None,))[0] != reg:
                self.noticed[node_id] = (reg, now)
            beat = self.seen.get(node_id, (0, 0.0))[1]
            out[node_id] = max(beat, self.noticed[node_id][1])
        return out

    async def watch(self, kv: KeyValue, stop: asyncio.Event) -> None:
        """Follow every key's revisions until ``stop``; re-create the watch when NATS drops it."""
        while not stop.is_set():
            watcher = None
            try:
                watcher = await kv.watchall(meta_only=True)
                while not stop.is_set():  # also ends a loop whose cancellation wait_for swallowed
                    try:
                        entry = await watcher.updates(timeout=1)
                    except nats.errors.TimeoutError:
                        continue
                    if entry is None or entry.operation in (KV_DEL, KV_PURGE) or entry.revision is None:
                        continue
                    self.beat(entry.key, entry.revision)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - NATS away: watch again
                log.info("heartbeat watch restarting error=%r", e)
                await asyncio.sleep(0.5)
            finally:
                if watcher is not None:
                    try:
                        await watcher.stop()
                    except Exception:  # noqa: BLE001
                        pass

    async def still_silent(self, kv: KeyValue, node_id: str) -> bool:
        """Re-read the node's key: False if it beat after all (or NATS cannot tell now)."""
        try:
            entry = await kv.get(node_id)
        except nats.js.errors.KeyNotFoundError:
            return True
        except Exception as e:  # noqa: BLE001 - cannot read: never declare a loss on a guess
            log.info("heartbeat read failed node=%s error=%r", node_id, e)
            return False
        if entry.revision != self.seen.get(node_id, (None,))[0]:
            self.watch_misses += 1
            self.beat(node_id, entry.revision or 0)
            return False
        return True
