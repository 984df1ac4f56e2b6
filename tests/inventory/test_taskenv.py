"""A task's environment: torchrun's and Slurm's variables from one layout of the gang, and who wins a name."""

from __future__ import annotations

from shared.events import GpuShare, TaskPlacement
from shared.model import ArrayElement
from services.inventory.taskenv import task_env
from tests.builders import job


def gang(*nodes: str) -> list[TaskPlacement]:
    """Task i on nodes[i], one GPU each."""
    return [TaskPlacement(task=i, node_id=n, gpus=(GpuShare(uuid=f"GPU-{n}-{i}"),)) for i, n in enumerate(nodes)]


def env_of(placements: list[TaskPlacement], task: int, spec=None, user_env=None) -> dict[str, str]:
    return task_env("j-1", 7, placements, task, {"b": "10.0.0.2", "a": "10.0.0.1"}, user_env or {},
                    spec=spec or job("train").queue("research.nlp").build())


def test_nodes_are_numbered_in_placement_order_so_rank_zero_is_on_node_zero_where_master_addr_points():
    tasks = gang("b", "b", "a", "a")  # node b holds rank 0, though "a" sorts first
    envs = [env_of(tasks, t) for t in range(4)]
    assert [e["SLURM_NODEID"] for e in envs] == ["0", "0", "1", "1"]
    assert [e["NODE_RANK"] for e in envs] == ["0", "0", "1", "1"], "torchrun and Slurm read the same layout"
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.2"}


def test_every_task_gets_its_slurm_rank_counts_and_the_job_they_belong_to():
    tasks = gang("b", "b", "a", "a")
    e = env_of(tasks, 3)
    assert {k: e[k] for k in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NNODES", "SLURM_JOB_NUM_NODES",
                              "SLURM_NTASKS_PER_NODE", "SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_JOB_PARTITION")} == {
        "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_ID": "j-1", "SLURM_JOB_NAME": "train",
        "SLURM_JOB_PARTITION": "research.nlp"}
    assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) == ("3", "1", "4")


def test_tasks_per_node_is_set_only_when_every_node_holds_as_many():
    assert "SLURM_NTASKS_PER_NODE" not in env_of(gang("a", "a", "b"), 0)
    assert env_of(gang("a", "b", "c"), 2)["SLURM_NTASKS_PER_NODE"] == "1"


def test_cpus_per_task_is_whole_cpus_and_only_when_the_job_asks_for_cpu():
    assert "SLURM_CPUS_PER_TASK" not in env_of(gang("a"), 0)
    assert env_of(gang("a"), 0, job("x").cpu(2500).build())["SLURM_CPUS_PER_TASK"] == "3"


def test_an_array_element_knows_its_array_and_index_and_a_plain_job_has_neither():
    assert not {k for k in env_of(gang("a"), 0) if "ARRAY" in k}
    spec = job("sweep").build().model_copy(update={"array": ArrayElement(id="j-arr", index=4)})
    e = env_of(gang("a"), 0, spec)
    assert (e["SLURM_ARRAY_JOB_ID"], e["SLURM_ARRAY_TASK_ID"]) == ("j-arr", "4")
    assert (e["GPUORCH_ARRAY_ID"], e["GPUORCH_ARRAY_INDEX"]) == ("j-arr", "4")


def test_gpuorchs_values_win_over_a_jobs_own_variables_of_the_same_name_as_slurms_do():
    e = env_of(gang("a", "b"), 1, user_env={"SLURM_PROCID": "9", "SLURM_NODEID": "9", "EPOCHS": "3"})
    assert (e["SLURM_PROCID"], e["SLURM_NODEID"], e["EPOCHS"]) == ("1", "1", "3")
