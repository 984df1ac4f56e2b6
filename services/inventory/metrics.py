"""The inventory's Prometheus series, read from its projection at scrape time: GPUs by state and model, and the
state of each node (one series per node and state, 1 for the state it is in, as kube-state-metrics does)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.inventory.api import node_state
from shared.cluster import ClusterProjection, NodeState
from shared.model import GpuInfo

GPU_STATES = ("free", "allocated", "unhealthy", "cordoned", "lost")
NODE_STATES = ("idle", "allocated", "cordoned", "draining", "lost")


def gpu_state(node: NodeState, gpu: GpuInfo) -> str:
    """What a GPU is now, the first that holds: unhealthy, on a lost node, on a cordoned (or draining) node,
    allocated (a share of it, or a MIG slice), free."""
    if not gpu.healthy or gpu.uuid in node.unhealthy:
        return "unhealthy"
    if node.lost:
        return "lost"
    if node.cordoned or node.draining:
        return "cordoned"
    if node.gpu_alloc.get(gpu.uuid) or any(node.gpu_alloc.get(s.uuid) for s in gpu.mig_slices):
        return "allocated"
    return "free"


class InventoryCollector(Collector):
    def __init__(self, projection: Callable[[], ClusterProjection]) -> None:
        self.projection = projection  # read at each scrape: the process may swap in a shared projection

    def collect(self) -> Iterator[GaugeMetricFamily]:
        nodes = self.projection().nodes
        models = {g.model for n in nodes.values() for g in n.info.gpus}
        counts = {(m, s): 0 for m in models for s in GPU_STATES}
        for node in nodes.values():
            for g in node.info.gpus:
                counts[(g.model, gpu_state(node, g))] += 1
        gpus = GaugeMetricFamily("gpuorch_gpus", "GPUs by state (free, allocated, unhealthy, cordoned: on a cordoned "
                                 "or draining node, lost: on a lost node) and model", labels=["state", "model"])
        for (model, state), n in sorted(counts.items()):
            gpus.add_metric([state, model], n)
        yield gpus
        states = GaugeMetricFamily("gpuorch_node_state", "1 for the state the node is in (idle, allocated, cordoned, "
                                   "draining, lost), 0 for the others", labels=["node", "state"])
        for node_id, node in sorted(nodes.items()):
            now = node_state(node)
            for s in NODE_STATES:
                states.add_metric([node_id, s], 1.0 if s == now else 0.0)
        yield states
