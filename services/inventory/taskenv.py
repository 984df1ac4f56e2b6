"""The environment of one task of a gang: CUDA devices and a torchrun-compatible rendezvous."""

from __future__ import annotations

import hashlib

from shared.events import TaskPlacement


def master_port(job_id: str, attempt: int) -> int:
    """A port every task of one attempt agrees on without talking: 20000-39999 from the job and attempt."""
    digest = hashlib.sha256(f"{job_id}/{attempt}".encode()).digest()
    return 20000 + int.from_bytes(digest[:4], "big") % 20000


def task_env(
    job_id: str, attempt: int, placements: tuple[TaskPlacement, ...] | list[TaskPlacement], task: int,
    addresses: dict[str, str], user_env: dict[str, str],
) -> dict[str, str]:
    me = next(p for p in placements if p.task == task)
    rank0 = min(placements, key=lambda p: p.task)
    local = sorted(p.task for p in placements if p.node_id == me.node_id)
    return {
        **user_env,
        "CUDA_VISIBLE_DEVICES": ",".join(g.uuid for g in me.gpus),
        "GPUORCH_JOB_ID": job_id,
        "GPUORCH_ATTEMPT": str(attempt),
        "GPUORCH_GPU_SHARES": ",".join(str(g.milli) for g in me.gpus),
        "MASTER_ADDR": addresses.get(rank0.node_id) or rank0.node_id,
        "MASTER_PORT": str(master_port(job_id, attempt)),
        "WORLD_SIZE": str(len(placements)),
        "RANK": str(task),
        "LOCAL_RANK": str(local.index(task)),
        "LOCAL_WORLD_SIZE": str(len(local)),
        "NODE_RANK": str(sorted({p.node_id for p in placements}).index(me.node_id)),
    }
