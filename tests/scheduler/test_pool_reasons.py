"""A job that no node here could ever run, but that a node pool's new nodes could, waits for the pool: its reason
says so. It read "no schedulable node offers GPU model L4", a reason of the "never fits" class, while the autoscaler
was adding the L4 nodes it would run on."""

from __future__ import annotations

from services.scheduler.admission import pools_for, with_pool_notes
from services.scheduler.core import run_cycle
from services.scheduler.reasons import reason_class
from tests.builders import cluster, job, node


def test_a_job_only_a_pool_could_run_names_the_pool_and_is_not_a_never_fits_wait() -> None:
    c = cluster(node("h1").gpus(8, model="H100-80GB"))
    c.proj.pool_shapes = {"burst": ("l4-8x", 2), "big": ("dgx-h100", 4), "none-left": ("l4-8x", 0)}
    c.pending(job("l4").gpus(8).tasks(2).models("L4").build(), "l4")
    c.pending(job("h100s").gpus(8).tasks(3).models("H100-80GB").build(), "h100s")
    c.pending(job("huge").gpus(16).build(), "huge")  # no node of any pool has 16 GPUs
    c.pending(job("a100").gpus(1).models("A100-80GB").build(), "a100")

    plan = run_cycle(c.snapshot())
    assert {j: reason_class(r) for j, r in plan.unschedulable.items()} == dict.fromkeys(
        ["l4", "h100s", "huge", "a100"], "never fits")
    kept: dict = {}
    said = with_pool_notes(c.proj, plan.unschedulable, kept)

    assert said["l4"] == plan.unschedulable["l4"] + "; node pool burst may add nodes for it"
    assert said["h100s"].endswith("; node pool big may add nodes for it")
    assert said["huge"] == plan.unschedulable["huge"] and said["a100"] == plan.unschedulable["a100"]
    assert reason_class(said["l4"]) == "no room now" and reason_class(said["huge"]) == "never fits"
    assert len(kept) == 4, "each task shape judged once"
    assert pools_for(c.proj, job("l4").gpus(8).tasks(2).models("L4").build()) == ["burst"]

    c.proj.pool_shapes = {}
    assert with_pool_notes(c.proj, plan.unschedulable, {}) == plan.unschedulable


def test_a_job_only_two_pools_together_could_run_names_both() -> None:
    c = cluster(node("h1").gpus(8, model="H100-80GB"))
    c.proj.pool_shapes = {"one": ("l4-8x", 1), "two": ("l4-8x", 1)}
    c.pending(job("l4").gpus(8).tasks(2).models("L4").build(), "l4")
    plan = run_cycle(c.snapshot())
    assert with_pool_notes(c.proj, plan.unschedulable, {})["l4"].endswith("; node pools one, two may add nodes for it")
