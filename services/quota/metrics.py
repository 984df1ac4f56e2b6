"""The quota's Prometheus series, read from its projection at scrape time: per queue, the GPUs it holds, wants,
is entitled to now and is guaranteed. A parent queue's figures are its subtree's (as GET /v1/queues shows them);
``leaf="true"`` selects the queues jobs run in, whose sums are the cluster's."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.cluster import ClusterProjection
from shared.fairshare import GPUS_ONLY, children


class QuotaCollector(Collector):
    def __init__(self, projection: Callable[[], ClusterProjection], half_life_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        """``projection``: read at each scrape (the process may swap in a shared one); ``clock``: "now" for the
        fair share (epoch seconds)."""
        self.projection, self.half_life_s, self.clock = projection, half_life_s, clock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        proj = self.projection()
        in_gpus, load = proj.queue_loads_in(GPUS_ONLY, proj.share_ratios())  # per leaf; one pass over the jobs
        held, wanted = in_gpus.alloc, in_gpus.pending
        entitled = proj.division(self.clock(), self.half_life_s, load).entitlement
        tree = children(proj.queues)

        def subtree(path: str, table: dict[str, float]) -> float:
            kids = tree.get(path)
            return sum(subtree(k, table) for k in kids) if kids else table.get(path, 0.0)

        labels = ["queue", "leaf"]
        families = {
            "allocated": GaugeMetricFamily("gpuorch_queue_allocated_gpus", "GPUs held by the queue's placed, running "
                                           "and preempting jobs", labels=labels),
            "pending": GaugeMetricFamily("gpuorch_queue_pending_gpus", "GPUs the queue's waiting jobs ask for "
                                         "(pending demand)", labels=labels),
            "entitled": GaugeMetricFamily("gpuorch_queue_entitled_gpus", "GPUs the fair share entitles the queue to "
                                          "now (in GPU-equivalents of the dominant resource)", labels=labels),
            "guaranteed": GaugeMetricFamily("gpuorch_queue_guaranteed_gpus", "GPUs guaranteed to the queue",
                                            labels=labels),
        }
        for path, spec in sorted(proj.queues.items()):
            key = [path, "false" if path in tree else "true"]
            families["allocated"].add_metric(key, subtree(path, held))
            families["pending"].add_metric(key, subtree(path, wanted))
            families["entitled"].add_metric(key, entitled.get(path, 0.0))
            families["guaranteed"].add_metric(key, spec.guaranteed.gpus)
        yield from families.values()
