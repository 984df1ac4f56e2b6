"""The environment of one task of a gang: a minimal Unix base, the job's variables, CUDA devices, a
torchrun-compatible rendezvous and the usual Slurm variables. Nothing of the agent's own environment."""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from shared.events import TaskPlacement
from shared.model import JobSpec


def master_port(job_id: str, attempt: int) -> int:
    """A port every task of one attempt agrees on without talking: 20000-39999 from the job and attempt."""
    digest = hashlib.sha256(f"{job_id}/{attempt}".encode()).digest()
    return 20000 + int.from_bytes(digest[:4], "big") % 20000


SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SHIMS = str(Path(__file__).with_name("bin"))  # gpuorch's srun: a Slurm script's srun lines run in their task


def base_env(home: Path, user: str, python_dir: str) -> dict[str, str]:
    """What any Unix process expects: PATH (gpuorch's shims, then the agent's interpreter directory, so
    ``python3`` resolves as it does for the agent wherever the task's account may run it, then the system's),
    HOME and TMPDIR in the task's own work directory, USER/LOGNAME of the account it runs as, a UTF-8 locale."""
    return {"PATH": f"{SHIMS}:{python_dir}:{SAFE_PATH}", "HOME": str(home), "TMPDIR": str(home / "tmp"),
            "USER": user, "LOGNAME": user, "LANG": "C.UTF-8"}


@dataclass(frozen=True)
class Rank:
    """Where one task stands in its gang: the one source both the torchrun and the Slurm variables read."""

    task: int  # global rank
    tasks: int
    node: int  # index of its node among the gang's nodes, in placement order (task 0's node is 0)
    nodes: int
    local: int  # rank among the tasks on its node
    local_tasks: int
    per_node: int | None  # tasks on every node, when every node holds the same number
    master_node: str  # the node of task 0: the rendezvous


def rank_of(placements: tuple[TaskPlacement, ...] | list[TaskPlacement], task: int) -> Rank:
    """Nodes are numbered in the order their first task appears, so the node holding rank 0 is node 0,
    the one MASTER_ADDR names (torchrun's static rendezvous hosts its store on node rank 0)."""
    ordered = sorted(placements, key=lambda p: p.task)
    me = next(p for p in ordered if p.task == task)
    nodes = list(dict.fromkeys(p.node_id for p in ordered))
    local = [p.task for p in ordered if p.node_id == me.node_id]
    per_node = set(Counter(p.node_id for p in ordered).values())
    return Rank(task=task, tasks=len(ordered), node=nodes.index(me.node_id), nodes=len(nodes),
                local=local.index(task), local_tasks=len(local), per_node=per_node.pop() if len(per_node) == 1 else None,
                master_node=nodes[0])


def torchrun_vars(rank: Rank, job_id: str, attempt: int, addresses: dict[str, str]) -> dict[str, str]:
    return {
        "MASTER_ADDR": addresses.get(rank.master_node) or rank.master_node,
        "MASTER_PORT": str(master_port(job_id, attempt)),
        "WORLD_SIZE": str(rank.tasks),
        "RANK": str(rank.task),
        "LOCAL_RANK": str(rank.local),
        "LOCAL_WORLD_SIZE": str(rank.local_tasks),
        "NODE_RANK": str(rank.node),
    }


def slurm_vars(rank: Rank, job_id: str, spec: JobSpec) -> dict[str, str]:
    """What srun gives each task, so that scripts written for Slurm run unchanged (the queue is the partition;
    job ids are gpuorch's). An array element also gets Slurm's and gpuorch's array variables."""
    out = {
        "SLURM_JOB_ID": job_id,
        "SLURM_JOBID": job_id,
        "SLURM_JOB_NAME": spec.name,
        "SLURM_JOB_PARTITION": spec.queue,
        "SLURM_PROCID": str(rank.task),
        "SLURM_NTASKS": str(rank.tasks),
        "SLURM_NPROCS": str(rank.tasks),
        "SLURM_NNODES": str(rank.nodes),
        "SLURM_JOB_NUM_NODES": str(rank.nodes),
        "SLURM_NODEID": str(rank.node),
        "SLURM_LOCALID": str(rank.local),
    }
    if rank.per_node is not None:
        out["SLURM_NTASKS_PER_NODE"] = str(rank.per_node)
    if spec.resources.cpu_milli:
        out["SLURM_CPUS_PER_TASK"] = str(math.ceil(spec.resources.cpu_milli / 1000))
    if spec.array is not None:
        out |= {"SLURM_ARRAY_JOB_ID": spec.array.id, "SLURM_ARRAY_TASK_ID": str(spec.array.index),
                "GPUORCH_ARRAY_ID": spec.array.id, "GPUORCH_ARRAY_INDEX": str(spec.array.index)}
    return out


def task_env(
    job_id: str, attempt: int, placements: tuple[TaskPlacement, ...] | list[TaskPlacement], task: int,
    addresses: dict[str, str], user_env: dict[str, str], base: dict[str, str] | None = None, *, spec: JobSpec,
) -> dict[str, str]:
    """The whole environment of one task: ``base``, overridden by the job's ``user_env`` (a job may set its
    own PATH or locale), overridden by the documented variables below: a job cannot misstate its GPUs,
    rank or rendezvous, as CUDA, torchrun and Slurm-minded scripts read them from here."""
    me = next(p for p in placements if p.task == task)
    rank = rank_of(placements, task)
    return {
        **(base or {}),
        **user_env,
        "CUDA_VISIBLE_DEVICES": ",".join(g.uuid for g in me.gpus),
        "GPUORCH_JOB_ID": job_id,
        "GPUORCH_ATTEMPT": str(attempt),
        "GPUORCH_GPU_SHARES": ",".join(str(g.milli) for g in me.gpus),
        **torchrun_vars(rank, job_id, attempt, addresses),
        **slurm_vars(rank, job_id, spec),
    }
