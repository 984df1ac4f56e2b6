"""A valid, deterministic stream of events: nodes register, jobs run their whole life on free GPUs.

Used by the event-log benchmark and the fold tests: every transition is legal, so a
replay of it records no invalid transition, and a digest mismatch means a real bug.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

from shared import events as ev
from shared.cluster import agent_source
from shared.events import Envelope, GpuShare, TaskPlacement
from shared.model import GpuInfo, JobSpec, NodeInfo, TaskResources



def make_node(i: int, gpus: int = 8) -> NodeInfo:
    node_id = f"n{i:04d}"
    return NodeInfo(
        node_id=node_id,
        rack=f"r{i // 16}",
        zone="z0",
        cpu_milli=128_000,
        memory_mib=1_048_576,
        gpus=tuple(
            GpuInfo(uuid=f"GPU-{node_id}-{g}", index=g, model="H100-80GB", memory_mib=81559, nvlink_domain=f"{node_id}-nv0")
            for g in range(gpus)
        ),
    )


def workload(n_events: int, n_nodes: int = 8, in_flight: int = 16, source: str = "/gpuorch/bench",
             start: datetime | None = None) -> Iterator[Envelope]:
    """About ``n_events`` envelopes: node registrations, then job lifecycles of 6 events each.

    ``in_flight`` jobs run at once (each on its own GPU), so the state always holds running jobs.
    Every event comes from ``source`` but the task reports, which come from their node's agent.
    Events are a millisecond apart from ``start`` (default: now, so they mix with live services' events).
    """
    t0 = start or datetime.now(UTC)
    tick = 0

    def env(data: ev.Event) -> Envelope:
        nonlocal tick
        tick += 1
        by = agent_source(data.node_id) if isinstance(data, (ev.JobTaskStarted, ev.JobTaskExited)) else source
        return Envelope(data, id=f"w-{tick}", source=by, time=t0 + timedelta(milliseconds=tick))

    nodes = [make_node(i) for i in range(n_nodes)]
    for node in nodes:
        yield env(ev.NodeRegistered(node_id=node.node_id, node=node))
    slots = [(node, gpu) for node in nodes for gpu in node.gpus]
    in_flight = min(in_flight, len(slots))
    running: list[tuple[str, str]] = []
    j = 0
    while tick < n_events:
        job_id = f"j{j:08d}"
        node, gpu = slots[j % in_flight]
        spec = JobSpec(name=f"train-{j % 97}", resources=TaskResources(gpus=1, cpu_milli=4000, memory_mib=16384))
        yield env(ev.JobSubmitted(job_id=job_id, spec=spec))
        yield env(ev.JobQueued(job_id=job_id))
        placement = TaskPlacement(task=0, node_id=node.node_id, gpus=(GpuShare(uuid=gpu.uuid),), cpu_milli=4000, memory_mib=16384)
        yield env(ev.JobPlaced(job_id=job_id, placements=(placement,), policy="bench"))
        yield env(ev.JobTaskStarted(job_id=job_id, task=0, node_id=node.node_id, pid=1000 + j))
        running.append((job_id, node.node_id))
        if len(running) == in_flight:  # the oldest finishes, freeing the slot the next job takes
            done, done_node = running.pop(0)
            yield env(ev.JobTaskExited(job_id=done, task=0, node_id=done_node, code=0))
            yield env(ev.JobSucceeded(job_id=done))
        j += 1
