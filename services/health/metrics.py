"""GPU series under dcgm-exporter's names, from the agents' telemetry as health last read it.

Dashboards and alerts written for NVIDIA's dcgm-exporter work unchanged: the same metric names (``DCGM_FI_DEV_*``),
units (MiB, W, degrees C, percent) and labels (``gpu``, ``UUID``, ``device``, ``modelName``, ``Hostname``,
``pci_bus_id``), and, as its Kubernetes pod labels do, ``job`` and ``queue`` of the job on the GPU (empty when it
is idle; one series per job when jobs share it). A GPU whose last sample is older than ``STALE_S``, or whose node is
lost, has no series: absent, as when dcgm-exporter stops.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.cluster import ACTIVE, ClusterProjection

STALE_S = 60.0
LABELS = ["gpu", "UUID", "device", "modelName", "Hostname", "pci_bus_id", "job", "queue"]
# name, help (dcgm-exporter's), telemetry field, scale
FIELDS = (
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "gpu_util_pct", 1),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", "memory_util_pct", 1),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "memory_used_mib", 1),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", "memory_free_mib", 1),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "temperature_c", 1),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power_mw", 1e-3),
    # volatile totals since the driver loaded: typed gauge (a counter's name must end in _total), read as dcgm's
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC errors.", "ecc_corrected", 1),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors.", "ecc_uncorrected", 1),
)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


@dataclass
class GpuTelemetry:
    """The last sample of each GPU (uuid -> (node, when received, sample)) and its last XID."""

    samples: dict[str, tuple[str, float, dict[str, Any]]] = field(default_factory=dict)
    xids: dict[str, int] = field(default_factory=dict)

    def sample(self, node_id: str, gpu: dict[str, Any], at: float) -> None:
        self.samples[str(gpu.get("uuid", ""))] = (node_id, at, gpu)

    def xid(self, uuid: str, xid: int) -> None:
        self.xids[uuid] = xid


class DcgmCollector(Collector):
    def __init__(self, projection: Callable[[], ClusterProjection], telemetry: GpuTelemetry,
                 clock: Callable[[], float]) -> None:
        """``clock``: the clock samples were received by (monotonic seconds)."""
        self.projection, self.telemetry, self.clock = projection, telemetry, clock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        proj = self.projection()
        now = self.clock()
        on_gpu: dict[str, list[tuple[str, str]]] = {}  # gpu uuid -> (job, queue) of each job holding it
        parent: dict[str, str] = {s.uuid: g.uuid for n in proj.nodes.values() for g in n.info.gpus for s in g.mig_slices}
        for job in proj.jobs.values():
            if job.state in ACTIVE:
                for p in job.placements:
                    for uuid in dict.fromkeys(parent.get(s.uuid, s.uuid) for s in p.gpus):
                        on_gpu.setdefault(uuid, []).append((job.job_id, job.spec.queue))
        families = [GaugeMetricFamily(name, doc, labels=LABELS) for name, doc, _, _ in FIELDS]
        xids = GaugeMetricFamily("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", labels=LABELS)
        known: set[str] = set()
        for node_id, node in proj.nodes.items():
            for g in node.info.gpus:
                known.add(g.uuid)
                found = self.telemetry.samples.get(g.uuid)
                if node.lost or found is None or found[0] != node_id or now - found[1] > STALE_S:
                    continue
                sample = found[2]
                base = [str(g.index), g.uuid, f"nvidia{g.index}", g.model, node.info.hostname or node_id, g.pci_bus_id]
                for job_id, queue in on_gpu.get(g.uuid) or [("", "")]:
                    labels = [*base, job_id, queue]
                    for family, (_, _, key, scale) in zip(families, FIELDS):
                        value = _number(sample.get(key))
                        if value is not None:
                            family.add_metric(labels, value * scale)
                    xids.add_metric(labels, self.telemetry.xids.get(g.uuid, 0))
        for gone in (set(self.telemetry.samples) | set(self.telemetry.xids)) - known:  # nodes no longer here
            self.telemetry.samples.pop(gone, None)
            self.telemetry.xids.pop(gone, None)
        yield from families
        yield xids
