"""Events are validated on fold, whatever their source: one bad event never poisons state for good."""

from __future__ import annotations

from pydantic_core import from_json, to_json

from shared import events as ev
from shared.cluster import ClusterProjection
from shared.fairshare import Ratios
from shared.events import Envelope, GpuShare, TaskPlacement
from tests.builders import gpu_uuid, job, node, reported

SCHEDULER = "/gpuorch/scheduler"
AGENT_N1 = "/gpuorch/agent/n1"


class Fold:
    """A projection fed events in log order, each at the next stream sequence."""

    def __init__(self, proj: ClusterProjection | None = None) -> None:
        self.proj = proj or ClusterProjection()
        self.seq = self.proj.seq

    def __call__(self, event: ev.Event | Envelope, source: str = "/gpuorch/test", epoch: int | None = None) -> bool:
        self.seq += 1
        env = event if isinstance(event, Envelope) else Envelope(event, source=source, epoch=epoch)
        return self.proj.apply(Envelope(env.data, source=env.source, epoch=env.epoch, seq=self.seq))


def elected(epoch: int, source: str = SCHEDULER, by: str | None = None) -> Envelope:
    """The election a leader of ``source`` appends (``by``: someone else appended it)."""
    return Envelope(ev.LeaderElected(lease=source.rsplit("/", 1)[1], source=source, epoch=epoch, holder="test"),
                    source=by or source)


def on_n1(job_id: str, gpu: int = 0, task: int = 0) -> ev.JobPlaced:
    return ev.JobPlaced(job_id=job_id, placements=(TaskPlacement(task=task, node_id="n1", gpus=(GpuShare(uuid=gpu_uuid("n1", gpu)),)),))


def with_queued_jobs(*job_ids: str) -> Fold:
    f = Fold()
    n1 = node("n1").gpus(4).build()
    f(ev.NodeRegistered(node_id="n1", node=n1))
    f(ev.NodeRegistered(node_id="n2", node=node("n2").gpus(4).build()))
    for job_id in job_ids:
        f(ev.JobSubmitted(job_id=job_id, spec=job(job_id).gpus(1).build()))
        f(ev.JobQueued(job_id=job_id))
    return f


# --- leader epochs: the current term comes from the log's elections ------------------------


def test_a_forged_huge_epoch_does_not_invalidate_the_real_leaders_later_placements_even_after_a_restore():
    f = with_queued_jobs("a", "b")
    assert f(elected(5))
    assert not f(ev.JobQueued(job_id="a"), SCHEDULER, epoch=10**15)
    assert f.proj.invalid_transitions[-1].endswith(f"epoch {10**15} is not the current term 5 of {SCHEDULER}")
    assert f(on_n1("a", gpu=0), SCHEDULER, epoch=5)
    assert f.proj.jobs["a"].state == "placed"

    restored = ClusterProjection()
    restored.restore(f.proj.snapshot())
    assert restored.terms == f.proj.terms
    g = Fold(restored)
    assert g(on_n1("b", gpu=1), SCHEDULER, epoch=5)
    assert restored.jobs["b"].state == "placed"


def test_a_forged_huge_epoch_before_any_election_stops_mattering_at_the_first_election():
    f = with_queued_jobs("a")
    assert f(ev.JobUnschedulable(job_id="a", reason="forged"), SCHEDULER, epoch=10**15)  # no election yet: the highest wins
    assert not f(on_n1("a"), SCHEDULER, epoch=3)
    assert f(elected(3))
    assert f(on_n1("a"), SCHEDULER, epoch=3)
    assert f.proj.jobs["a"].state == "placed"


def test_a_forged_election_is_undone_by_the_next_real_one():
    f = with_queued_jobs("a")
    f(elected(7))
    f(elected(10**15))  # forged: now the real leader's decisions do not count...
    assert not f(on_n1("a"), SCHEDULER, epoch=7)
    assert f.proj.jobs["a"].state == "queued"
    f(elected(7))  # ...until it records its term again
    assert f(on_n1("a"), SCHEDULER, epoch=7)


def test_the_term_is_the_latest_election_in_log_order_not_the_highest():
    f = with_queued_jobs("a")
    f(elected(9))
    f(elected(4))  # a lower epoch elected later (the forged 9 undone, or a lease bucket recreated)
    assert not f(on_n1("a"), SCHEDULER, epoch=9)
    assert f(on_n1("a"), SCHEDULER, epoch=4)


def test_terms_are_per_source():
    f = with_queued_jobs("a")
    f(elected(9, "/gpuorch/health"))
    f(elected(2))
    assert f(on_n1("a"), SCHEDULER, epoch=2)
    assert not f(ev.NodeCordoned(node_id="n1"), "/gpuorch/health", epoch=2)
    assert f(ev.NodeCordoned(node_id="n1"), "/gpuorch/health", epoch=9)


def test_an_election_must_come_from_the_source_it_vouches_for():
    f = with_queued_jobs("a")
    f(elected(2))
    assert not f(elected(10**15, by="/gpuorch/agent/n1"))
    assert f.proj.terms[SCHEDULER].epoch == 2


def test_an_election_changes_no_state_so_a_restart_that_records_a_new_term_keeps_the_digest():
    f = with_queued_jobs("a")
    f(on_n1("a"), SCHEDULER, epoch=None)
    digest = f.proj.digest()
    f(elected(8))
    assert f.proj.digest() == digest and f.proj.terms[SCHEDULER].epoch == 8


def test_a_log_written_before_elections_replays_to_the_same_state():
    f = with_queued_jobs("a", "b")
    assert f(on_n1("a", gpu=0), SCHEDULER, epoch=3)
    assert not f(on_n1("b", gpu=1), SCHEDULER, epoch=2)  # an older leader, overlapping for a moment
    assert f.proj.invalid_transitions[-1].endswith("stale leader epoch 2 < 3")
    assert f(on_n1("b", gpu=1), SCHEDULER, epoch=4)
    assert f.proj.jobs["b"].state == "placed"


def test_an_old_snapshot_without_terms_or_last_placements_restores():
    f = with_queued_jobs("a")
    f(on_n1("a"), SCHEDULER, epoch=3)
    doc = from_json(f.proj.snapshot())
    del doc["terms"]
    for j in doc["state"]["jobs"].values():
        del j["last_placements"]
    old = ClusterProjection()
    old.restore(to_json(doc))
    assert old.terms == {} and old.epochs == {SCHEDULER: 3}
    assert old.jobs["a"].state == "placed" and old.jobs["a"].last_placements == []


# --- a rejected transition is not applied, and apply says so ----------------------------------


def test_apply_returns_false_for_a_rejected_transition_and_changes_nothing():
    f = with_queued_jobs("a")
    assert f(on_n1("a", gpu=0))
    placements = f.proj.jobs["a"].placements
    assert not f(on_n1("a", gpu=1))  # placed already: a second copy would start on the agent
    assert f.proj.jobs["a"].placements == placements
    assert f.proj.nodes["n1"].gpu_alloc == {gpu_uuid("n1", 0): 1000}
    assert f.proj.seq == f.seq  # folded (the position moved on), though rejected


# --- task reports come from the node the task was placed on -----------------------------------


def test_a_task_start_counts_only_from_the_agent_of_the_node_it_was_placed_on():
    f = with_queued_jobs("a")
    f(on_n1("a"))
    assert not f(ev.JobTaskStarted(job_id="a", task=0, node_id="n1"), "/gpuorch/scheduler")
    assert not f(ev.JobTaskStarted(job_id="a", task=0, node_id="n1"), "/gpuorch/agent/n2")
    assert not f(ev.JobTaskStarted(job_id="a", task=0, node_id="n2"), "/gpuorch/agent/n2")  # not placed there
    assert not f(ev.JobTaskStarted(job_id="a", task=1, node_id="n1"), AGENT_N1)  # no such task
    assert f.proj.jobs["a"].state == "placed"
    assert f(reported(ev.JobTaskStarted(job_id="a", task=0, node_id="n1")))
    assert f.proj.jobs["a"].state == "running"


def test_a_task_exit_counts_from_the_node_of_its_last_placement_even_after_a_requeue():
    f = with_queued_jobs("a")
    f(on_n1("a"))
    f(reported(ev.JobTaskStarted(job_id="a", task=0, node_id="n1")))
    assert not f(ev.JobTaskExited(job_id="a", task=0, node_id="n1", code=1), "/gpuorch/agent/n2")
    assert not f(ev.JobTaskExited(job_id="a", task=0, node_id="n2", code=1), "/gpuorch/agent/n2")
    assert f.proj.jobs["a"].tasks_exited == {}
    f(ev.JobRequeued(job_id="a", reason="node lost: n1"))
    assert f(reported(ev.JobTaskExited(job_id="a", task=0, node_id="n1", code=137)))  # its agent, back, reports late
    assert f.proj.jobs["a"].tasks_exited == {0: 137}

    restored = ClusterProjection()
    restored.restore(f.proj.snapshot())
    assert Fold(restored)(reported(ev.JobTaskExited(job_id="a", task=0, node_id="n1", code=137)))


def test_the_requeues_of_a_job_that_had_not_started_are_counted_apart_from_its_retries_and_kept_in_snapshots():
    """Health lets a job lost before it started go back free only so often: the fold counts those requeues."""
    f = with_queued_jobs("a")
    f(on_n1("a"))
    f(ev.JobRequeued(job_id="a", reason="node lost before its tasks started: n1", interrupted=True))
    f(on_n1("a"))
    f(reported(ev.JobTaskStarted(job_id="a", task=0, node_id="n1")))
    f(ev.JobRequeued(job_id="a", reason="task 0 interrupted: its node stopped", interrupted=True))  # it had started
    f(on_n1("a"))
    f(ev.JobRequeued(job_id="a", reason="node lost: n1 (retry 1 of 1)"))  # not free: a retry, whatever its start
    a = f.proj.jobs["a"]
    assert (a.lost_before_start, a.retries, a.state) == (1, 1, "queued")
    restored = ClusterProjection()
    restored.restore(f.proj.snapshot())
    assert (restored.jobs["a"].lost_before_start, restored.jobs["a"].retries) == (1, 1)


def test_a_held_job_is_never_placed_wants_nothing_and_waits_again_once_released():
    f = with_queued_jobs("a", "b")
    assert f(ev.JobHeld(job_id="a", reason="held by alice"))
    a = f.proj.jobs["a"]
    assert (a.state, a.reason) == ("held", "held by alice")
    assert not f(on_n1("a"), SCHEDULER), "a placement decided before the hold (the scheduler's) is refused"
    assert f.proj.jobs["a"].state == "held" and not f.proj.nodes["n1"].gpu_alloc
    _, pending = f.proj.queue_load(ratios=Ratios())
    assert pending == {"default": 1.0}, "only b wants GPUs"
    assert not f(ev.JobHeld(job_id="a")), "held once"
    restored = ClusterProjection()
    restored.restore(f.proj.snapshot())
    assert restored.jobs["a"].state == "held"
    assert f(ev.JobReleased(job_id="a"))
    assert (f.proj.jobs["a"].state, f.proj.jobs["a"].reason) == ("queued", "")
    assert not f(ev.JobReleased(job_id="a")), "only a held job is released"
    assert f(on_n1("a"))
    assert not f(ev.JobHeld(job_id="a")), "a placed job is not held"
    assert f(ev.JobHeld(job_id="b", admin=True)) and f.proj.jobs["b"].held_by_admin
    assert f(ev.JobReleased(job_id="b")) and not f.proj.jobs["b"].held_by_admin
    assert f(ev.JobHeld(job_id="b")) and f(ev.JobCancelled(job_id="b"))
    assert f.proj.jobs["b"].state == "cancelled"


def test_a_preempted_job_waits_again_without_the_exits_of_the_attempt_it_left():
    """A preempted job, queued again, then cancelled before it ran again, read exit SIGTERM (its evicted task's)."""
    f = with_queued_jobs("a")
    f(on_n1("a"))
    f(reported(ev.JobTaskStarted(job_id="a", task=0, node_id="n1")))
    f(ev.JobPreempting(job_id="a", reason="reclaimed for queue prod"))
    assert f(reported(ev.JobTaskExited(job_id="a", task=0, node_id="n1", signal=15)))
    assert f.proj.jobs["a"].tasks_exited == {0: -15}
    assert f(ev.JobPreempted(job_id="a"))
    assert f.proj.jobs["a"].tasks_exited == {} and f.proj.jobs["a"].state == "preempted"


def test_a_task_ended_by_a_signal_keeps_the_signal_as_a_negative_exit():
    """A gang's peer stopped when another task fails reports no code, only SIGTERM: it reads -15, not null."""
    f = with_queued_jobs("a")
    f(on_n1("a"))
    f(reported(ev.JobTaskStarted(job_id="a", task=0, node_id="n1")))
    assert f(reported(ev.JobTaskExited(job_id="a", task=0, node_id="n1", signal=15)))
    assert f.proj.jobs["a"].tasks_exited == {0: -15}
    f2 = with_queued_jobs("b")
    f2(on_n1("b"))
    assert f2(reported(ev.JobTaskExited(job_id="b", task=0, node_id="n1", reason="lost")))
    assert f2.proj.jobs["b"].tasks_exited == {0: None}  # neither known


def test_an_unreadable_event_on_a_jobs_subject_still_moves_the_jobs_expected_sequence():
    """Else every later decision about the job (appended with the job's last sequence) would conflict, forever."""
    f = with_queued_jobs("j-1", "j-2")
    before = f.proj.jobs["j-2"].seq
    f.seq += 1
    f.proj.skip(f.seq, "gpuorch.events.job.j-1")
    assert f.proj.jobs["j-1"].seq == f.seq
    assert f.proj.jobs["j-2"].seq == before
    assert f.proj.seq == f.seq


def test_an_update_changes_a_placed_jobs_time_limit_but_never_its_priority():
    """job.updated: a priority only while the job waits, a time limit also while it runs; anything else (a forged or
    raced event) changes nothing and is recorded as invalid."""
    f = with_queued_jobs("a", "b")
    assert f(elected(1))
    assert f(on_n1("a", gpu=0), SCHEDULER, epoch=1)
    assert f(ev.JobUpdated(job_id="a", time_limit_s=60))
    assert not f(ev.JobUpdated(job_id="a", priority="critical"))
    assert not f(ev.JobUpdated(job_id="a", priority="critical", time_limit_s=30))
    assert (f.proj.jobs["a"].spec.priority, f.proj.jobs["a"].spec.time_limit_s) == ("normal", 60)
    assert f(ev.JobUpdated(job_id="b", priority="high"))
    assert f.proj.jobs["b"].spec.priority == "high"
