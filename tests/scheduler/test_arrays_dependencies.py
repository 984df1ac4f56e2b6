"""Slurm's gates, in the pure cycle: dependencies, an array's %N throttle, singleton, and a dependency that can
never be met (the job is cancelled, naming it)."""

from __future__ import annotations

import pytest

from services.scheduler.core import Policy, run_cycle
from services.scheduler.gates import dependency_verdict
from shared.model import Dependency
from tests.builders import cluster, job, node

BIG = node("n1").gpus(8)


def step():
    """A fresh one-GPU job builder (builders are mutable)."""
    return job("step").gpus(1)


@pytest.mark.parametrize("kind, state, verdict", [
    ("afterok", "succeeded", "met"), ("afterok", "failed", "never"), ("afterok", "cancelled", "never"),
    ("afterok", "rejected", "never"), ("afterok", "running", "wait"), ("afterok", "queued", "wait"),
    ("afternotok", "failed", "met"), ("afternotok", "cancelled", "met"), ("afternotok", "succeeded", "never"),
    ("afternotok", "preempted", "wait"),
    ("afterany", "succeeded", "met"), ("afterany", "failed", "met"), ("afterany", "cancelled", "met"),
    ("afterany", "placed", "wait"),
], ids=lambda v: str(v))
def test_a_dependency_is_met_waits_or_can_never_be_met_by_its_kind_and_the_job_s_end(kind, state, verdict):
    assert dependency_verdict(Dependency(kind=kind, job="j-a"), (("j-a", state),))[0] == verdict


def test_a_job_waits_while_its_afterok_dependency_runs_and_says_so():
    snap = (cluster(BIG).running(step().build(), on=[("n1", [0])], job_id="j-a")
            .pending(job("eval").gpus(1).after("afterok", "j-a").build(), job_id="j-b").snapshot())
    plan = run_cycle(snap, Policy())
    assert "j-b" not in plan.placements and "j-b" not in plan.cancellations
    assert plan.unschedulable["j-b"] == "waiting for dependency afterok:j-a (running)"


def test_a_job_is_placed_once_its_afterok_dependency_succeeded():
    snap = (cluster(BIG).ended(step().build(), "j-a", "succeeded")
            .pending(job("eval").gpus(1).after("afterok", "j-a").build(), job_id="j-b").snapshot())
    assert "j-b" in run_cycle(snap, Policy()).placements


@pytest.mark.parametrize("kind, state", [("afterok", "failed"), ("afterok", "cancelled"), ("afternotok", "succeeded")])
def test_a_dependency_that_can_never_be_met_cancels_the_job_naming_it(kind, state):
    snap = (cluster(BIG).ended(step().build(), "j-a", state)
            .pending(job("eval").gpus(1).after(kind, "j-a").build(), job_id="j-b").snapshot())
    plan = run_cycle(snap, Policy())
    assert plan.cancellations == {"j-b": f"dependency {kind}:j-a can never be met: j-a {state}"}
    assert "j-b" not in plan.placements and "j-b" not in plan.unschedulable


def test_every_dependency_must_be_met_and_one_that_never_can_wins_over_one_still_waiting():
    waiting = (cluster(BIG).ended(step().build(), "j-a", "succeeded").running(step().build(), [("n1", [0])], "j-r")
               .pending(job("eval").gpus(1).after("afterok", "j-a").after("afterany", "j-r").build(), job_id="j-b"))
    reason = run_cycle(waiting.snapshot(), Policy()).unschedulable["j-b"]
    assert reason == "waiting for dependency afterany:j-r (running)"
    doomed = (cluster(BIG).ended(step().build(), "j-a", "failed").running(step().build(), [("n1", [0])], "j-r")
              .pending(job("eval").gpus(1).after("afterany", "j-r").after("afterok", "j-a").build(), job_id="j-b"))
    assert run_cycle(doomed.snapshot(), Policy()).cancellations["j-b"].startswith("dependency afterok:j-a")


def test_a_dependency_on_an_array_waits_for_every_element_and_one_failed_element_dooms_afterok():
    def with_elements(*states: str):
        c = cluster(BIG)
        for i, state in enumerate(states):
            c.ended(step().element("j-arr", i).build(), f"j-arr-{i}", state)
        return c.pending(job("merge").gpus(1).after("afterok", "j-arr").build(), job_id="j-m").snapshot()

    assert "j-m" in run_cycle(with_elements("succeeded", "succeeded"), Policy()).placements
    plan = run_cycle(with_elements("succeeded", "queued", "queued"), Policy())
    assert plan.unschedulable["j-m"] == "waiting for dependency afterok:j-arr (1 of 3 elements ended)"
    plan = run_cycle(with_elements("succeeded", "failed", "queued"), Policy())
    assert plan.cancellations["j-m"] == "dependency afterok:j-arr can never be met: j-arr-1 failed"


def test_a_dependency_on_a_job_no_longer_known_waits_saying_what_to_do():
    snap = cluster(BIG).pending(job("eval").gpus(1).after("afterany", "j-gone").build(), job_id="j-b").snapshot()
    plan = run_cycle(snap, Policy())
    assert "j-b" not in plan.placements and "j-b" not in plan.cancellations
    assert "not known here" in plan.unschedulable["j-b"] and "submit it again" in plan.unschedulable["j-b"]


def test_an_array_with_a_limit_of_two_places_two_elements_and_the_rest_wait_at_the_limit():
    c = cluster(BIG)
    for i in range(6):
        c.pending(step().element("j-arr", i, max_running=2).build(), job_id=f"j-arr-{i}")
    plan = run_cycle(c.snapshot(), Policy())
    assert sorted(plan.placements) == ["j-arr-0", "j-arr-1"]
    assert {plan.unschedulable[f"j-arr-{i}"] for i in range(2, 6)} == {"array j-arr at its limit of 2 running"}


def test_elements_already_placed_running_or_preempting_count_against_the_array_s_limit():
    c = cluster(BIG)
    c.running(step().element("j-arr", 0, 3).build(), [("n1", [0])], "j-arr-0")
    c.running(step().element("j-arr", 1, 3).build(), [("n1", [1])], "j-arr-1", state="preempting")
    for i in range(2, 5):
        c.pending(step().element("j-arr", i, max_running=3).build(), job_id=f"j-arr-{i}")
    c.pending(step().element("j-other", 0, max_running=3).build(), job_id="j-other-0")  # another array: its own limit
    assert sorted(run_cycle(c.snapshot(), Policy()).placements) == ["j-arr-2", "j-other-0"]


def test_a_singleton_waits_while_a_job_of_its_name_and_owner_runs_and_only_one_of_them_starts_at_once():
    c = (cluster(BIG).running(job("nightly").gpus(1).build(), [("n1", [0])], "j-old", owner="ada")
         .pending(job("nightly").gpus(1).singleton().build(), job_id="j-new", owner="ada")
         .pending(job("nightly").gpus(1).singleton().build(), job_id="j-bob", owner="bob")
         .pending(job("nightly").gpus(1).singleton().build(), job_id="j-bob2", owner="bob"))
    plan = run_cycle(c.snapshot(), Policy())
    assert plan.unschedulable["j-new"] == "singleton: waiting for j-old (same name nightly and owner ada) to end"
    assert "j-bob" in plan.placements, "another owner's job of that name is no reason to wait"
    assert "j-bob2" not in plan.placements and "waiting for j-bob" in plan.unschedulable["j-bob2"]


def test_a_job_held_by_a_gate_evicts_nobody_and_holds_no_reservation():
    full = node("n1").gpus(2)
    c = (cluster(full).running(job("low").gpus(2).priority("low").build(), [("n1", [0, 1])], "j-low")
         .running(job("dep").gpus(0).cpu(1).build(), [("n1", [])], "j-a")
         .pending(job("urgent").gpus(2).priority("critical").after("afterok", "j-a").build(), job_id="j-u"))
    plan = run_cycle(c.snapshot(), Policy())
    assert plan.preemptions == () and plan.reservation is None
    assert plan.unschedulable["j-u"].startswith("waiting for dependency afterok:j-a")
