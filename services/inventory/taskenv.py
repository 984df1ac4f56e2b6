"""The environment of one task of a gang: a minimal Unix base, the job's variables, CUDA devices and a
torchrun-compatible rendezvous. Nothing of the agent's own environment."""

from __future__ import annotations

import hashlib
from pathlib import Path

from shared.events import TaskPlacement


def master_port(job_id: str, attempt: int) -> int:
    """A port every task of one attempt agrees on without talking: 20000-39999 from the job and attempt."""
    digest = hashlib.sha256(f"{job_id}/{attempt}".encode()).digest()
    return 20000 + int.from_bytes(digest[:4], "big") % 20000


SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def base_env(home: Path, user: str, python_dir: str) -> dict[str, str]:
    """What any Unix process expects: PATH (the agent's interpreter directory first, so ``python3`` resolves
    as it does for the agent wherever the task's account may run it, then the system's), HOME and TMPDIR in
    the task's own work directory, USER/LOGNAME of the account it runs as, a UTF-8 locale."""
    return {"PATH": f"{python_dir}:{SAFE_PATH}", "HOME": str(home), "TMPDIR": str(home / "tmp"), "USER": user,
            "LOGNAME": user, "LANG": "C.UTF-8"}


def task_env(
    job_id: str, attempt: int, placements: tuple[TaskPlacement, ...] | list[TaskPlacement], task: int,
    addresses: dict[str, str], user_env: dict[str, str], base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The whole environment of one task: ``base``, overridden by the job's ``user_env`` (a job may set its
    own PATH or locale), overridden by the documented variables below: a job cannot misstate its GPUs,
    rank or rendezvous, as CUDA and torchrun read them from here."""
    me = next(p for p in placements if p.task == task)
    rank0 = min(placements, key=lambda p: p.task)
    local = sorted(p.task for p in placements if p.node_id == me.node_id)
    return {
        **(base or {}),
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
