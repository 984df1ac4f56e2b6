"""A waiting job's reason is state, not a stream: the log takes it when its kind changes, else at most every
``reason_refresh_s`` (issue 15: reasons made 10,178 of 16,514 events for 1,000 jobs)."""

from __future__ import annotations

import pytest

from services.scheduler.reasons import reason_class, worth_logging

# reasons as the scheduler words them (services/scheduler/reasons.py, core.py, gates.py), kinds written by hand
WORDED = [
    ("needs 8 GPUs; largest free block is 3 on n5", "no room now"),
    ("needs 2 tasks × 8 GPUs within one rack; only 1 of 2 tasks fit in one rack now (rack r1)", "no room now"),
    ("needs 8 GPUs; it can never fit: largest free block is 4 on n1 even when idle", "never fits"),
    ("needs 1 GPU of model B200; no schedulable node offers GPU model B200 (schedulable GPU models: H100)",
     "never fits"),
    ("needs 1 GPU; research at its limit of 1 GPU", "queue limit"),
    ("needs 4 GPUs; above the limit of queue research (8 GPUs)", "queue limit"),
    ("waiting for preemption of j-a, j-b (grace 30 s)", "evictions"),
    ("waiting for j-a to leave: reclaimed for queue prod (grace 300 s)", "evictions"),
    # held back for a reservation or not, it waits for room: the two flip whenever a big job heads the queue
    ("needs 8 GPUs; the free capacity it fits is held for j-head on n1, n2 until 1700000000", "no room now"),
    ("waiting for dependency afterok:j-a (running)", "dependency"),
    ("array j-arr at its limit of 2 running", "array"),
    ("singleton: waiting for j-old (same name nightly and owner ada) to end", "singleton"),
]


@pytest.mark.parametrize(("reason", "kind"), WORDED)
def test_each_reason_has_the_kind_a_person_acts_on(reason: str, kind: str) -> None:
    assert reason_class(reason) == kind


CASES = [
    # logged, logged at, new reason, now -> logged?
    ("", None, "needs 8 GPUs; largest free block is 3 on n5", 0, True),  # the first reason
    ("needs 8 GPUs; largest free block is 3 on n5", 0, "needs 8 GPUs; largest free block is 3 on n5", 1, False),
    ("needs 8 GPUs; largest free block is 3 on n5", 0, "needs 8 GPUs; largest free block is 6 on n2", 299, False),
    ("needs 8 GPUs; largest free block is 3 on n5", 0, "needs 8 GPUs; largest free block is 6 on n2", 300, True),
    ("needs 8 GPUs; largest free block is 3 on n5", 0, "needs 1 GPU; research at its limit of 1 GPU", 1, True),
    ("waiting for dependency afterok:j-a (running)", 0, "array j-arr at its limit of 2 running", 1, True),
    ("needs 8 GPUs; largest free block is 3 on n5", None, "needs 8 GPUs; largest free block is 6 on n2", 1, True),
    ("needs 8 GPUs; largest free block is 3 on n5", 0,
     "needs 8 GPUs; the free capacity it fits is held for j-head on n1, n2 until 1700000000", 1, False),
]


@pytest.mark.parametrize(("logged", "at", "reason", "now", "want"), CASES)
def test_a_reason_is_logged_when_its_kind_changes_else_at_most_every_refresh(logged, at, reason, now, want) -> None:
    assert worth_logging(logged, at, reason, now, 300.0) is want
