"""Health's pure rules: XID classification, telemetry, heartbeats, time limits, lost nodes, drains, auto-resume."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.health.rules import (
    APPLICATION_XIDS,
    FAULT_XIDS,
    GpuWatch,
    HealthPolicy,
    JobView,
    NodeView,
    assess_sample,
    lost_nodes,
    overdue_jobs,
    plan_drain,
    plan_lost_node,
    resume_due,
    xid_detail,
    xid_fault,
)

POLICY = HealthPolicy(slowdown_c=85, hot_samples=3)


def running(job_id: str, *nodes: str, **kw) -> JobView:
    return JobView(job_id, kw.pop("state", "running"), frozenset(nodes), **kw)


# --- XIDs ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "xid, recovery_action, marks",
    [
        pytest.param(79, None, True, id="79 fallen off the bus marks the GPU"),
        pytest.param(48, None, True, id="48 double-bit ECC marks"),
        pytest.param(63, None, True, id="63 row remapping event marks"),
        pytest.param(64, None, True, id="64 row remapping failure marks"),
        pytest.param(74, None, True, id="74 NVLink error marks"),
        pytest.param(94, None, True, id="94 contained ECC marks"),
        pytest.param(95, None, True, id="95 uncontained ECC marks"),
        pytest.param(13, None, False, id="13 is the application's"),
        pytest.param(31, None, False, id="31 page fault is the application's"),
        pytest.param(43, None, False, id="43 is the application's"),
        pytest.param(45, None, False, id="45 cleanup is the application's"),
        pytest.param(999, None, False, id="an unlisted XID without advice marks nothing"),
        pytest.param(79, 0, False, id="NVML says no recovery needed: it wins over the table"),
        pytest.param(13, 1, True, id="NVML asks for a GPU reset: marks even an application XID"),
        pytest.param(999, 2, True, id="NVML asks for a node reboot: marks an unlisted XID"),
        pytest.param(48, 42, True, id="an unknown recovery action falls back to the table"),
        pytest.param(13, 42, False, id="an unknown recovery action on an application XID marks nothing"),
    ],
)
def test_an_xid_is_classified_by_nvml_advice_else_by_the_table(xid, recovery_action, marks):
    assert (xid_detail(xid, recovery_action) is not None) is marks


def test_the_table_and_the_application_list_never_overlap():
    assert not set(FAULT_XIDS) & set(APPLICATION_XIDS)


def test_an_xid_fault_says_what_happened_and_is_keyed_by_its_time():
    f = xid_fault("n1", "GPU-1", 79, 1700000000.1234)
    assert f is not None and (f.kind, f.xid, f.detail) == ("xid", 79, "GPU has fallen off the bus")
    assert f.key == xid_fault("n1", "GPU-1", 79, 1700000000.1234).key != xid_fault("n1", "GPU-1", 79, 1700000001).key
    assert "GPU reset" in xid_fault("n1", "GPU-1", 13, 1.0, recovery_action=1).detail


# --- telemetry -----------------------------------------------------------------------

def feed(samples: list[tuple[int | None, int | None]], policy: HealthPolicy = POLICY) -> list[list[str]]:
    """Kinds of fault after each (temperature, uncorrectable ECC) sample of one GPU."""
    watch, out = GpuWatch(), []
    for t, (temp, ecc) in enumerate(samples):
        watch, faults = assess_sample(watch, "n1", "GPU-1", float(t), temp, ecc, policy)
        out.append([f.kind for f in faults])
    return out


@pytest.mark.parametrize(
    "samples, expected",
    [
        pytest.param([(60, 0)] * 4, [[]] * 4, id="a cool GPU without ECC errors is fine"),
        pytest.param([(90, 0), (90, 0), (90, 0), (90, 0)], [[], [], ["thermal"], []], id="hot for N samples marks once"),
        pytest.param([(90, 0), (90, 0), (70, 0), (90, 0), (90, 0)], [[]] * 5, id="a cool sample restarts the count"),
        pytest.param([(85, 0)] * 3, [[]] * 3, id="at the threshold is not above it"),
        pytest.param([(90, 0), (None, 0), (90, 0)], [[]] * 3, id="a missing temperature breaks the streak"),
        pytest.param([(60, 0), (60, 2), (60, 2), (60, 3)], [[], ["ecc"], [], ["ecc"]], id="ECC marks once per increase"),
        pytest.param([(60, 5)], [["ecc"]], id="a count already above zero when first seen marks"),
        pytest.param([(60, 1), (60, None), (60, 1)], [["ecc"], [], []], id="a failed ECC read forgets nothing"),
        pytest.param([(60, None)] * 2, [[]] * 2, id="no ECC support is no fault"),
    ],
)
def test_telemetry_marks_uncorrectable_ecc_and_sustained_heat(samples, expected):
    assert feed(samples) == expected


def test_thermal_and_ecc_can_fault_in_the_same_sample():
    assert feed([(90, 0), (90, 0), (90, 1)]) == [[], [], ["ecc", "thermal"]]


# --- heartbeats ----------------------------------------------------------------------

@pytest.mark.parametrize(
    "beats, now, timeout, lost",
    [
        pytest.param({"a": 95.0, "b": 99.0}, 100.0, 10, [], id="recent beats: nobody lost"),
        pytest.param({"a": 89.0, "b": 99.0}, 100.0, 10, [("a", 11.0)], id="silent longer than T: lost"),
        pytest.param({"a": 90.0}, 100.0, 10, [], id="silent exactly T: not yet"),
        pytest.param({"b": 0.0, "a": 0.0}, 3.0, 2, [("a", 3.0), ("b", 3.0)], id="several, in node order"),
        pytest.param({}, 100.0, 10, [], id="no nodes"),
    ],
)
def test_a_node_is_lost_when_its_last_beat_is_older_than_t(beats, now, timeout, lost):
    assert lost_nodes(beats, now, timeout) == lost


# --- time limits ---------------------------------------------------------------------

@pytest.mark.parametrize(
    "job, now, overdue",
    [
        pytest.param(running("j", "n1", started_at=100.0, time_limit_s=60), 161.0, True, id="past its limit"),
        pytest.param(running("j", "n1", started_at=100.0, time_limit_s=60), 160.0, False, id="exactly at its limit"),
        pytest.param(running("j", "n1", started_at=100.0), 10_000.0, False, id="no limit"),
        pytest.param(running("j", "n1", time_limit_s=60), 10_000.0, False, id="never started"),
        pytest.param(running("j", "n1", state="placed", started_at=100.0, time_limit_s=1), 500.0, False, id="placed is not running"),
        pytest.param(running("j", "n1", state="preempting", started_at=100.0, time_limit_s=1), 500.0, False,
                     id="already being stopped"),
    ],
)
def test_a_running_job_past_its_time_limit_is_overdue(job, now, overdue):
    assert bool(overdue_jobs([job], now)) is overdue


def test_an_overdue_job_already_timed_out_only_needs_its_failure():
    [o] = overdue_jobs([running("j", "n1", started_at=0.0, time_limit_s=10, timed_out=True)], 15.0)
    assert (o.job_id, o.overrun_s, o.timed_out) == ("j", 5.0, True)


# --- lost nodes ----------------------------------------------------------------------

def test_a_lost_nodes_jobs_are_requeued_while_retries_last_then_fail():
    jobs = [
        running("retry", "n1", retries=0, max_retries=2, started_at=1.0),
        running("last", "n1", retries=2, max_retries=2, started_at=1.0),
        running("never", "n1", started_at=1.0),
        running("gang", "n0", "n1", max_retries=1, started_at=1.0),
        running("elsewhere", "n2", max_retries=5, started_at=1.0),
        running("pre", "n1", state="preempting", max_retries=1, started_at=1.0),
        running("done", "n1", state="succeeded", max_retries=1, started_at=1.0),
        running("waiting", state="queued", max_retries=1),
    ]
    plan = {p.job_id: (p.requeue, p.reason, p.interrupted)
            for p in plan_lost_node("n1", jobs, POLICY.free_unstarted_requeues)}
    assert plan == {
        "retry": (True, "node lost: n1 (retry 1 of 2)", False),
        "last": (False, "node lost: n1", False),
        "never": (False, "node lost: n1", False),
        "gang": (True, "node lost: n1 (retry 1 of 1)", False),
        "pre": (True, "node lost: n1 (retry 1 of 1)", False),
    }


def test_a_job_that_lost_its_node_before_any_task_started_goes_back_without_using_a_retry():
    """A node that dies silently looks free until its heartbeats are missed: a job placed there meanwhile never ran.
    It is requeued whatever its retries (0 by default), and the requeue is not counted as one."""
    jobs = [
        running("placed", "n1", state="placed"),
        running("spent", "n1", state="placed", retries=3, max_retries=3),
        running("stopping", "n1", state="preempting"),
        running("gang-half-started", "n0", "n1", state="placed", started_at=1.0),
    ]
    plan = {p.job_id: (p.requeue, p.reason, p.interrupted)
            for p in plan_lost_node("n1", jobs, POLICY.free_unstarted_requeues)}
    assert plan == {
        "placed": (True, "node lost before its tasks started: n1", True),
        "spent": (True, "node lost before its tasks started: n1", True),
        "stopping": (True, "node lost before its tasks started: n1", True),
        "gang-half-started": (False, "node lost: n1", False),
    }


def test_a_job_lost_before_it_started_goes_back_free_only_so_often_then_as_any_lost_run():
    """A job whose start takes its node down would go round every node of the cluster if each loss were free: the
    first two are, the third spends a retry like any lost run's, and fails the job when it has none left."""
    assert POLICY.free_unstarted_requeues == 2
    jobs = [
        running("second", "n1", state="placed", lost_before_start=1),
        running("third", "n1", state="placed", lost_before_start=2),
        running("third-with-a-retry", "n1", state="placed", lost_before_start=2, max_retries=1),
        running("started-after-two", "n1", lost_before_start=2, started_at=1.0, max_retries=1),
    ]
    plan = {p.job_id: (p.requeue, p.reason, p.interrupted) for p in plan_lost_node("n1", jobs, 2)}
    assert plan == {
        "second": (True, "node lost before its tasks started: n1", True),
        "third": (False, "node lost before its tasks started: n1, the 3rd time (2 free requeues used)", False),
        "third-with-a-retry": (True, "node lost before its tasks started: n1, the 3rd time (2 free requeues used)"
                                     " (retry 1 of 1)", False),
        "started-after-two": (True, "node lost: n1 (retry 1 of 1)", False),
    }
    assert [p.requeue for p in plan_lost_node("n1", [running("j", "n1", state="placed")], 0)] == [False]


# --- drains --------------------------------------------------------------------------

@pytest.mark.parametrize(
    "jobs, preempt, waiting, drained",
    [
        pytest.param([], (), (), True, id="an empty node is drained"),
        pytest.param([running("a", "n1"), running("b", "n1", state="placed")], ("a", "b"), (), False,
                     id="running and placed jobs are preempted"),
        pytest.param([running("a", "n1", state="preempting")], (), ("a",), False, id="a job already stopping is waited for"),
        pytest.param([running("a", "n2"), running("b", "n1", state="failed")], (), (), True,
                     id="jobs elsewhere or ended do not hold the drain"),
        pytest.param([running("g", "n0", "n1")], ("g",), (), False, id="a gang with one task here is preempted whole"),
    ],
)
def test_a_drain_preempts_what_runs_and_ends_when_nothing_holds_the_node(jobs, preempt, waiting, drained):
    plan = plan_drain("n1", jobs)
    assert (plan.preempt, plan.waiting, plan.drained) == (preempt, waiting, drained)


# --- auto-resume ---------------------------------------------------------------------

FAULTED = NodeView("n1", cordoned=True, draining=False, lost=False, unhealthy=True, manual_hold=False, last_fault_at=100.0)


@pytest.mark.parametrize(
    "node, now, after, due",
    [
        pytest.param(FAULTED, 10_000.0, None, False, id="off by default"),
        pytest.param(FAULTED, 700.0, 600, True, id="healthy for M: resumed"),
        pytest.param(FAULTED, 699.0, 600, False, id="not yet M"),
        pytest.param(replace(FAULTED, draining=True), 10_000.0, 600, False, id="still draining"),
        pytest.param(replace(FAULTED, lost=True), 10_000.0, 600, False, id="lost"),
        pytest.param(replace(FAULTED, manual_hold=True), 10_000.0, 600, False, id="an operator's cordon stays"),
        pytest.param(replace(FAULTED, unhealthy=False), 10_000.0, 600, False, id="not cordoned for a fault"),
        pytest.param(replace(FAULTED, cordoned=False), 10_000.0, 600, False, id="not cordoned"),
    ],
)
def test_auto_resume_only_after_a_fault_and_m_quiet_seconds(node, now, after, due):
    assert resume_due(node, now, after) is due
