"""A curated mutation check: every scheduling and quota rule, broken on purpose, must fail a test.

    python -m bench.mutants                      # every mutant, two at a time (about 2 minutes here)
    python -m bench.mutants --only reclaim-lifts-queue-above-owed
    python -m bench.mutants --json mutants.json  # the same as JSON too (``--json`` alone: JSON on stdout)
    python -m bench.mutants --count              # run each mutant's tests to the end: which tests fail, not the first

A mutant is one exact textual replacement (old snippet -> new snippet) in one source file, named after what
it breaks. Each runs in a fresh copy of the repository (the working tree is never touched): the snippet must
match there exactly once (else the mutant is *stale*: the code moved and the catalogue must follow), the
copy is mutated, and the tests of the mutant's rule run there with the project's interpreter
(``pytest -x -q -p no:cacheprovider --hypothesis-seed=0 <tests>``). Failing tests kill the mutant; a mutant
whose tests all pass *survives*. Before any mutant, the same tests run once on an unmutated copy: a test that
fails there could kill nothing, so it is left out of every mutant's run and listed (work in progress elsewhere).

Exit status: 0 when every mutant is killed, 1 when one survives or is stale, 2 when the tests cannot run.

The catalogue (``MUTANTS``) names its origin: ``issue`` (one of the five changes of issue 13 that no test
caught), ``once`` (one of the eight that a single test caught), ``rule`` (the rest of DESIGN.md's
scheduling and quota rules).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IGNORE = shutil.ignore_patterns(".venv", ".git", "build", "__pycache__", ".hypothesis", ".pytest_cache", ".ruff_cache",
                                ".gpuorch", "*.egg-info", ".schemathesis", "data")
MAX_JOBS = 2  # this machine has two cores; each mutant's pytest takes one

CORE = "services/scheduler/core.py"
GANG = "services/scheduler/gang.py"
WORK = "services/scheduler/workstate.py"
PLACEMENT = "services/scheduler/placement.py"
FRAG = "services/scheduler/fragmentation.py"
PREEMPTION = "services/scheduler/preemption.py"
PLAN = "services/scheduler/plan.py"
SHAPES = "services/scheduler/shapes.py"
FAIRSHARE = "shared/fairshare.py"
GATES = "services/scheduler/gates.py"
CLUSTER = "shared/cluster.py"
HEALTH = "services/health/rules.py"
HEALTH_R = "tests/health/test_rules.py"
HEALTH_S = "tests/health/test_health_service.py"

# --- the rules and the tests that guard them (fast example tests first: -x stops at the first failure) ---------

SR = "tests/scheduler/test_rules.py"  # placement, order, backfill
SE = "tests/scheduler/test_rules_evictions.py"  # preemption, reclaim, guards
QR = "tests/quota/test_rules.py"  # fair share: DRF, decay, guarantees, limits, what is owed
CORE_T = "tests/scheduler/test_core.py"
LIMITS_T = "tests/scheduler/test_queue_limits.py"
FAIR_T = "tests/quota/test_fairshare.py"
GATES_T = "tests/scheduler/test_arrays_dependencies.py"
PROPS = "tests/scheduler/test_core_properties.py"  # the invariants, over generated clusters (seeded)


@dataclass(frozen=True)
class Rule:
    says: str
    tests: tuple[str, ...]


RULES: dict[str, Rule] = {
    "gang atomicity": Rule("every task of a gang is placed in the same cycle, or none is", (SR, CORE_T, PROPS)),
    "topology levels": Rule("nvlink / node / rack / zone requirements hold; one NVLink domain is preferred",
                            (SR, CORE_T, PROPS)),
    "constraints": Rule("GPU model, GPU memory, compute capability, node labels, CPU and memory are honoured",
                        (SR, CORE_T, PROPS)),
    "fractional sharing": Rule("milli-GPU shares never add up to more than a GPU", (SR, CORE_T, PROPS)),
    "fgd+ scores the fill": Rule(
        "fgd+ is FGD's integer score over the mean of FGD's F and the idle GPU a node keeps once the fixed sample of "
        "target-workload sequences has filled it (tasks take CPU and the tightest GPUs that fit)",
        ("tests/scheduler/test_fgdplus_rule.py", "tests/scheduler/test_fgdplus_multigpu.py")),
    "MIG profiles": Rule("a MIG task takes a free slice of its own profile", (SR, CORE_T, PROPS)),
    "backfill": Rule("a later job starts only if it cannot delay the reservation of the blocked head job",
                     (SR, CORE_T, PROPS)),
    "priority order": Rule("within a queue, jobs go by priority class, then age", (SR, CORE_T)),
    "fair-share queue order": Rule("queues furthest below their entitlement go first, re-ranked after each job",
                                   (SR, CORE_T)),
    "DRF (dominant share)": Rule("a job counts its largest share of GPUs, CPU or memory, all tasks, in "
                                 "GPU-equivalents", (QR, SR, FAIR_T, CORE_T, LIMITS_T)),
    "decay (usage half-life)": Rule("usage fades with a half-life; with equal weights, the queue that used more "
                                    "gets less", (QR, FAIR_T, "tests/quota/test_accounting.py")),
    "limits (queue and ancestors)": Rule("no action takes a queue, or any ancestor, above its limit",
                                         (QR, SE, LIMITS_T, FAIR_T)),
    "guarantees": Rule("guarantees first, capped by demand; oversubscribed, they shrink in proportion",
                       (QR, FAIR_T)),
    "priority preemption": Rule("only strictly lower, preemptible priorities of the same queue (unless allowed) "
                                "are evicted", (SE, CORE_T, PROPS)),
    "protected victims": Rule("priority preemption respects the minimum runtime and the thrashing guard",
                              (SE, CORE_T, FAIR_T)),
    "thrashing guard": Rule("a job evicted max_preemptions_per_hour times in the last hour is left alone",
                            (SE, FAIR_T)),
    "min runtime": Rule("a job younger than its queue's preempt_min_runtime_s is never evicted", (SE, FAIR_T)),
    "grace": Rule("evictions carry their grace period: the priority one, or reclaim's", (SE, CORE_T)),
    "whole-gang victims": Rule("victims are whole gangs, and all of a victim's GPUs count as freed", (SE, CORE_T)),
    "cheapest victims": Rule("victims free the needed shape at least cost: fewest GPU-seconds lost, fewest jobs",
                             (SE, CORE_T)),
    "reclaim within what is owed": Rule("reclaim never lifts the owed queue above what it is owed", (SE, CORE_T)),
    "owed capped by entitlement": Rule("a queue is owed at most min(guarantee, entitlement) minus what it holds, "
                                       "and no less than its smallest waiting job", (QR, FAIR_T)),
    "reclaim tiers": Rule("reclaim with waiting jobs takes from the lowest-priority queues first", (SE, FAIR_T)),
    "leaving jobs": Rule("jobs already leaving (preempting, in grace) count as freed and are not evicted again",
                         (SE, CORE_T, PROPS)),
    "reclaim victims": Rule("reclaim evicts only other queues' gangs, never taking a queue below its floor",
                            (SE, CORE_T, PROPS)),
    "a deployment's replicas are its own": Rule(
        "a deployment's replicas are its owner's jobs that name it: another user's job naming it neither holds "
        "replicas back nor is cancelled; deleting a deployment cancels its replicas",
        ("tests/autoscaler/test_autoscaler_stack.py",)),
    "a deployment's load outlives its autoscaler": Rule(
        "the queue length a deployment's server posts is read back from the bucket, by any replica, after a restart",
        ("tests/autoscaler/test_autoscaler_stack.py",)),
    "srun runs in its task": Rule(
        "gpuorch's srun is first on a task's PATH and runs its program once there, in the directory -D names",
        ("tests/jobfiles/test_srun.py", "tests/test_agent_containment.py")),
    "a 422 echoes no secret": Rule(
        "a refused field shows its own value, cut short, never the object around it nor anything under secret_env",
        ("tests/test_api_validation.py",)),
    "a lost pool node is replaced": Rule(
        "a pool node lost for pool_lost_node_s and holding no work is terminated, so its pool buys another",
        ("tests/autoscaler/test_autoscaler_stack.py",)),
    "guarantees come back whole gangs at a time": Rule(
        "a queue's floor is its guarantee capped by its entitlement, checked for it and for each parent the owed "
        "queue is not under: a gang that takes a borrower below its fair share is still reclaimed",
        ("tests/scheduler/test_decide.py", PROPS)),
    "dependencies": Rule("a job waits until each dependency ended as its kind asks; one that never can cancels it",
                         (GATES_T,)),
    "array throttle": Rule("at most max_running elements of an array are placed or running at once", (GATES_T,)),
    "singleton": Rule("a singleton waits while a job of its name and owner is placed or running", (GATES_T,)),
    "reasons are state": Rule("a waiting job's reason is logged when its kind changes, else at most every "
                              "reason_refresh_s", ("tests/scheduler/test_reason_log.py",)),
    "gates hold everywhere": Rule("a gated job takes no placement, reservation, eviction or reclaim", (GATES_T,)),
    # --- the boundary and the throughput work of issue 15 -------------------------------------------------------------
    "work only over an older word": Rule("a node's work is written only over an older word: a lagging or redelivered "
                                         "writer never replaces a later one", ("tests/inventory/test_work.py",)),
    "agents read their own node": Rule("an agent's bus permissions let it follow its own node's work, neither "
                                       "another node's nor the log", ("tests/inventory/test_work.py",)),
    "no task reaches the forker": Rule("a task keeps no socket of its keeper, and leads its own session before its "
                                       "pid is answered; the agent awaits the answer without blocking its loop",
                                       ("tests/inventory/test_forker.py",)),
    "every exit recorded": Rule("a task's keeper records its exit; a subreaper agent records the exit of a task whose "
                                "keeper died; a record that lags the exit is waited for, not reported lost",
                                ("tests/inventory/test_forker.py", "tests/inventory/test_reaper_wake.py")),
    "an account's tasks from its own keeper": Rule(
        "a task of another account is started (with vfork) by a keeper that is that account and not dumpable, one per "
        "account, at most ACCOUNT_KEEPERS_MAX (then from the root keeper); its tasks' exits are recorded by the root "
        "keeper, also once it was killed; one that does not answer, or says what it may not, is killed and the task "
        "refused",
        ("tests/inventory/test_forker.py",)),
    "no fold under a reader": Rule("while a thread reads the projection (a snapshot, a cycle) no fold runs",
                                   ("tests/test_cycle_thread.py", "tests/test_snapshot_thread.py")),
    "no reader starves the folds": Rule("a fold waiting for the threads that read the projection goes before any "
                                        "reader that comes after it",
                                        ("tests/test_snapshot_thread.py", "tests/test_cycle_thread.py")),
    "a digest is of the position it names": Rule("GET /v1/services: each digest is the state's at the sequence "
                                                 "its status names, encoded once per projection, while folds go on",
                                                 ("tests/test_snapshot_thread.py",)),
    "an array's elements by index": Rule("an array's elements are found through the projection's index, which "
                                         "follows submissions, evictions and restores",
                                         ("tests/test_array_index.py", "tests/scheduler/test_arrays_dependencies.py")),
    "a scrape's passes read what the slow reads did": Rule(
        "/metrics counts jobs, scores fragmentation and sums queue loads in single passes that give what the cycle's "
        "snapshot and a walk per ratios give; every job record keeps one attribute layout",
        ("tests/test_scrape_pass.py", "tests/test_metrics.py")),
    "one cancel for many, as for one": Rule(
        "POST /v1/jobs:cancel cancels only what the caller may cancel, says why it skipped the rest, never shows a "
        "job the caller cannot see, and appends in batches; a cancellation folded after its job ended is late, "
        "not invalid", ("tests/test_bulk_cancel.py", "tests/jobfiles/test_cli_slurm.py", "tests/test_verify.py")),
    "a large batch waits for its own fold": Rule(
        "the answer to a request that appended many events waits for their fold longer than one job's before its "
        "503", ("tests/test_batch_submit.py",)),
    "a task's end says how": Rule(
        "a task a signal ended keeps the signal (minus it) in its job's task exits, and the CLI names it, also as "
        "the job's exit when no task failed with a code",
        ("tests/test_fold.py", "tests/jobfiles/test_cli_slurm.py")),
    "an owed queue told why it still waits": Rule(
        "a waiting job of a queue owed GPUs, for which reclaim may evict nothing, says so after the room it lacks; "
        "no other job's reason changes", ("tests/scheduler/test_rules_evictions.py",
                                          "tests/scheduler/test_core_properties.py")),
    "a job too large for what its queue is owed told so": Rule(
        "a waiting job of a queue under its guarantee that is larger than what the queue is owed says that reclaim "
        "stops at the guarantee; not a job reclaim serves or explained, nor one that fits no node", (CORE_T, PROPS)),
    "reclaim and allocation agree": Rule(
        "a job that would take its queue above its floor (borrowing) is placed after every job that would not, so a "
        "job evicted by reclaim does not take back the GPUs it was evicted for; borrowers still alternate by share",
        ("tests/scheduler/test_core.py", "tests/scheduler/test_core_properties.py", "tests/quota/test_fairness_sim.py")),
    "a job waits for a pool, not for ever": Rule(
        "a job no node here could run, that a node pool's nodes could, names the pool and is not a never-fits wait",
        ("tests/scheduler/test_pool_reasons.py",)),
    "what a body is read as": Rule(
        "POST /v1/jobs reads sbatch scripts; a body of a Content-Type a route does not read is 415, not a 422 about "
        "its fields; a gang that could span GPU models is told so",
        ("tests/jobfiles/test_api.py", "tests/test_gang_models.py")),
    "what a user reads": Rule(
        "squeue's -t all and -u USER, show's events with an earlier attempt's task marked, an array's logs naming "
        "its elements", ("tests/jobfiles/test_cli_slurm.py", "tests/test_arrays_stack.py")),
    "one delivery per reacting service": Rule("in one process, only the services with a reaction consume the log; "
                                              "the others ride on their folds, and each watch sees an event once",
                                              ("tests/test_fold_once.py",)),
    "the heap out of the collector's sight": Rule("every process run through shared.aio freezes the survivors of "
                                                  "each older collection, after it freed the garbage, and thaws hourly",
                                                  ("tests/test_gc_freeze.py",)),
    "admission verdicts renewed": Rule("a kept admission verdict ends when a node, GPU, queue or pool event arrives",
                                       ("tests/test_scheduler_stack.py",)),
    "decide beside the folds": Rule("the core decides on the cycle's copy while folds go on; only the read holds "
                                    "them", ("tests/test_cycle_thread.py",)),
    "a quiet spell's event at once": Rule("cycles start a debounce apart, but the first event after a quiet "
                                          "spell starts one at once", ("tests/test_cycle_thread.py",)),
    "a snapshot copies out": Rule("the snapshot document taken under the held folds shares nothing later folds "
                                  "change", ("tests/test_snapshot_thread.py",)),
    "a long cycle rests": Rule("after a cycle that worked T seconds of the process's CPU, the next starts no sooner "
                               "than REST x T later (T: its read and decision only once an event may have freed "
                               "room); a cycle long only in wall time does not rest the next",
                               ("tests/test_cycle_thread.py",)),
    "requests never wait for the thread pool": Rule("the caller and path-id dependencies run on the event loop: "
                                                    "a read or a submission answers with every pool thread busy; "
                                                    "a route that encodes the whole state does it in a thread",
                                                    ("tests/test_job_list.py", "tests/test_runtime.py")),
    "a stop ends every timer": Rule("a stopping service cancels its timers again while one runs on (a cancellation "
                                    "Python 3.11's wait_for lost)", ("tests/test_runtime.py",)),
    "the reaper wakes when due": Rule("the agent's reaper rests while every exit would wake it, and still runs at "
                                      "once on an exit, a stop, a refusal, and when a grace ends",
                                      ("tests/inventory/test_reaper_wake.py",)),
    "the cycle's read, one pass": Rule("one pass over the jobs gives each queue's held, wanted, waited-for and "
                                       "smallest queued share; a waiting job's view is made again when it changes",
                                       ("tests/scheduler/test_decide.py", SE)),
    "reports in task order": Rule("the outbox pipelines reports, but a task's exit goes only once its start is "
                                  "acknowledged, and a registration goes alone; nothing goes while the bus is away",
                                  ("tests/inventory/test_outbox.py",)),
    "the gateway waits out a restart": Rule("the split gateway sends a request again while its service restarts: "
                                            "any that was refused; one cut off if idempotent: its method, a keyed "
                                            "submission, a POST idempotent by design; no other",
                                            ("tests/test_stack.py::test_the_gateway_sends_again_only_what_cannot_"
                                             "have_been_acted_on",
                                             "tests/test_stack.py::test_a_request_for_a_split_service_that_is_being_"
                                             "restarted_waits_for_it",
                                             "tests/test_stack.py::test_a_submission_cut_off_by_its_dying_service_is_"
                                             "sent_again_and_recorded_once",
                                             "tests/test_stack.py::test_the_gateway_gives_each_submission_a_key_and_"
                                             "keeps_the_clients")),
    "submissions recorded once": Rule("a submission sent again with its Idempotency-Key records nothing twice and is "
                                      "answered with its jobs, or completed where a try died half-way; a key is its "
                                      "user's, and refused for another request; the CLI sends a cut-off submission "
                                      "again with its key",
                                      ("tests/test_idempotent_submit.py",)),
    "agents supervised": Rule("`up` starts a dead agent again, at once unless it keeps dying, then ever more slowly",
                              ("tests/test_restarts.py::test_an_agent_that_keeps_dying_is_started_again_ever_more_slowly",
                               "tests/test_restarts.py::test_an_agent_killed_while_its_task_runs_is_started_again_and_"
                               "the_job_succeeds")),
    "a cancelled append harms nothing": Rule("an append_many cancelled at any point leaves the bus connection working "
                                             "(no flush whose cancelled PONG ends nats-py's read loop)",
                                             ("tests/test_eventlog.py::test_an_append_many_cancelled_at_any_point_"
                                              "leaves_the_connection_working",)),
    "stack files replaced at once": Rule("split.json and stack.json are replaced whole: a reader never finds one "
                                         "half written", ("tests/test_stack.py::test_split_json_is_never_read_half_"
                                                          "written_while_a_service_restart_rewrites_it",)),
    "ended jobs remembered": Rule("an agent forgets ended jobs only past ENDED_KEPT, the earliest ended first, and "
                                  "never one placed on it again since",
                                  ("tests/test_agent_containment.py::test_an_agent_keeps_a_bounded_number_of_ended_"
                                   "jobs_and_never_forgets_one_placed_again",)),
    "secrets never shown": Rule("a job's secret_env values never leave the API in clear, and masking them never "
                                "changes the spec the job keeps",
                                ("tests/test_auth.py::test_secret_env_values_are_stored_but_never_shown",)),
    "a task's record survives": Rule("the agent's record of a task reads every step it appended, past a line cut "
                                     "short, and what an older agent recorded as one file a step; its exit is the "
                                     "first the keeper appended, or an older keeper's exit.json, and always fits",
                                     ("tests/test_agent_containment.py::test_the_agents_record_of_a_task_is_its_"
                                      "appended_steps_and_a_line_cut_short_is_skipped",
                                      "tests/test_agent_containment.py::test_a_tasks_exit_is_the_first_exited_step_of_"
                                      "its_record_and_else_an_older_keepers_file",
                                      "tests/test_agent_containment.py::test_a_refusal_reason_is_cut_so_that_the_"
                                      "record_stays_readable",
                                      "tests/test_agent_containment.py::test_an_agent_upgraded_under_a_running_task_"
                                      "adopts_what_an_older_agent_recorded")),
    # --- holds (tests/test_hold.py) -----------------------------------------------------------------------------------
    "a held job is never placed": Rule(
        "the scheduler proposes queued jobs only, and the fold refuses a placement of a held job (one decided before "
        "the hold); a release wakes the scheduler as a submission does", ("tests/test_hold.py", "tests/test_fold.py")),
    "a held job wants nothing": Rule("a held job is no queue's pending demand (quota, fair share, the autoscaler)",
                                     ("tests/test_hold.py", "tests/test_fold.py")),
    "a hold never lands on a job that moved": Rule(
        "a hold is appended expecting the job's last event to be the one it was read at: one appended in between "
        "makes it 409", ("tests/test_hold.py",)),
    "a job changes within its rights": Rule(
        "a job's priority changes only while it waits and within its queue's max_priority for users; only an admin "
        "raises a time limit", ("tests/test_update.py", "tests/test_fold.py")),
    "only a waiting job is held": Rule(
        "a placed or running job is not held (409; the fold refuses it), only a held job is released; who may "
        "cancel a job may hold it; only an admin releases an admin's hold",
        ("tests/test_hold.py", "tests/test_fold.py")),
    # --- health (tests/health) ---------------------------------------------------------------------------------------
    "a lost node's jobs requeue while retries last": Rule(
        "every job holding resources on a lost node (placed, running, being stopped) is requeued while its retries "
        "last, each counted, then failed", (HEALTH_R, HEALTH_S)),
    "a job that never ran costs no retry": Rule(
        "a job none of whose tasks had started when its node was lost is requeued whatever its retries, and the "
        "requeue is not counted", (HEALTH_R, HEALTH_S)),
    "a job that never ran goes back free only so often": Rule(
        "a job lost before it started is requeued free free_unstarted_requeues times (counted by the fold); later "
        "losses spend a retry or fail it, as a lost run's", (HEALTH_R, HEALTH_S, "tests/test_fold.py")),
    "only known faults mark a GPU": Rule(
        "an application XID, an unlisted XID, and NVML's recovery action NONE mark nothing; a fault XID or any other "
        "recovery action marks the GPU", (HEALTH_R,)),
    "a fault is marked once": Rule("uncorrectable ECC marks once per increase; heat once per hot streak of "
                                   "hot_samples samples", (HEALTH_R,)),
    "a node is lost after its timeout": Rule("a node is lost only once its last beat is older than the heartbeat "
                                             "timeout", (HEALTH_R, HEALTH_S)),
    "time limits": Rule("a running job past its limit, counted from its first task's start, is stopped and fails; "
                        "a placed one is not yet timed", (HEALTH_R, HEALTH_S)),
    "drains wait for what stops": Rule("a drain preempts placed and running jobs, waits for those being stopped, and "
                                       "is done when nothing holds resources on the node", (HEALTH_R, HEALTH_S)),
    "auto-resume leaves an operator's hold": Rule("a node is resumed automatically only if health cordoned it for a "
                                                  "fault and it stayed quiet; never one an operator holds, lost or "
                                                  "draining", (HEALTH_R, HEALTH_S)),
}


@dataclass(frozen=True)
class Mutant:
    name: str
    rule: str
    file: str
    old: str
    new: str
    origin: str = "rule"  # issue | once | rule


M = Mutant
MUTANTS: tuple[Mutant, ...] = (
    # --- the five changes of issue 13 that no test caught ---------------------------------------------------------
    M("preempt-ignores-protected", "protected victims", CORE,
      "if r.job_id not in self.evicted and not self.policy.protected(r, self.now)]",
      "if r.job_id not in self.evicted]", "issue"),
    M("reclaim-lifts-queue-above-owed", "reclaim within what is owed", CORE,
      "if size > need + 1e-9 or not self.ever_fits(job)", "if not self.ever_fits(job)", "issue"),
    M("owed-not-capped-by-entitlement", "owed capped by entitlement", FAIRSHARE,
      "target = min(queues[q].guaranteed.gpus, entitlement.get(q, 0.0), have + waiting)",
      "target = min(queues[q].guaranteed.gpus, have + waiting)", "issue"),
    M("reclaim-tiers-reversed", "reclaim tiers", CORE,
      "for tier in sorted({qprio.get(v.queue, 0) for v in pool}):",
      "for tier in sorted({qprio.get(v.queue, 0) for v in pool}, reverse=True):", "issue"),
    M("leaving-not-credited", "leaving jobs", CORE,
      "credit = min(leaving, need)", "credit = 0", "issue"),
    # --- eight that a single test caught ------------------------------------------------------------------------
    M("gang-commits-first-task-only", "gang atomicity", CORE,
      "for t, (idx, pick) in enumerate(fit.tasks):", "for t, (idx, pick) in enumerate(fit.tasks[:1]):", "once"),
    M("topology-level-ignored", "topology levels", GANG,
      'return "any" if topology == "nvlink" else topology', 'return "any"', "once"),
    M("constraint-gpu-model-ignored", "constraints", WORK,
      "                and (not s.models or model in s.models)\n", "", "once"),
    M("constraint-gpu-memory-ignored", "constraints", WORK,
      "                and mem >= s.min_memory_mib\n", "", "once"),
    M("constraint-node-selector-ignored", "constraints", WORK,
      "if any(labels.get(k) != v for k, v in s.selector):", "if False:", "once"),
    M("shared-gpu-over-committed", "fractional sharing", PLACEMENT,
      "room = [i for i, r in enumerate(node.free) if r >= pod.milli and (ok is None or ok[i])]",
      "room = [i for i, r in enumerate(node.free) if r > 0 and (ok is None or ok[i])]", "once"),
    M("mig-slice-of-any-profile", "MIG profiles", WORK,
      "for b, p in enumerate(profiles) if p == s.mig and cls.mig[gi] >> b & 1),",
      "for b, p in enumerate(profiles) if cls.mig[gi] >> b & 1),", "once"),
    M("min-runtime-ignored", "min runtime", PLAN,
      "if now - began < self.min_runtime_s.get(job.queue, 0):", "if False:", "once"),
    # --- gang atomicity --------------------------------------------------------------------------------------------
    M("gang-fills-one-task-per-node", "gang atomicity", GANG,
      "        for _ in range(n):\n            pick = ws.pick(", "        for _ in range(min(n, 1)):\n            pick = ws.pick("),
    # --- topology ---------------------------------------------------------------------------------------------------
    M("rack-gang-spreads-past-its-rack", "topology levels", GANG,
      "if LEVELS.index(name) > LEVELS.index(level):\n            return None",
      "if False:\n            return None"),
    M("nvlink-requirement-ignored", "topology levels", SHAPES,
      'one_domain=spec.topology == "nvlink",', "one_domain=False,"),
    M("nvlink-preference-dropped", "topology levels", GANG,
      "if s.gpus > 1 and s.milli == MILLI and not s.one_domain:", "if False:"),
    # --- constraints -----------------------------------------------------------------------------------------------
    M("constraint-compute-capability-ignored", "constraints", WORK,
      "                and (s.min_cc is None or (cc is not None and cc >= s.min_cc))\n", ""),
    M("constraint-cpu-ignored", "constraints", WORK,
      "            if s.cpu:\n                c = min(c, cls.cpu // s.cpu)\n", ""),
    # --- sharing ----------------------------------------------------------------------------------------------------
    M("shared-gpu-over-committed-by-fgd", "fractional sharing", PLACEMENT,
      "if r < pod.milli or (ok is not None and not ok[i]):", "if r <= 0 or (ok is not None and not ok[i]):"),
    M("fgdplus-drops-fgds-half", "fgd+ scores the fill", FRAG,
      "f = self._fill[key] = 0.5 * super().frag(model, cpu_left, free) + 0.5 * left", "f = self._fill[key] = left"),
    M("fgdplus-drops-the-fill", "fgd+ scores the fill", FRAG,
      "f = self._fill[key] = 0.5 * super().frag(model, cpu_left, free) + 0.5 * left",
      "f = self._fill[key] = super().frag(model, cpu_left, free)"),
    M("fgdplus-fill-ignores-cpu", "fgd+ scores the fill", FRAG,
      "        if t.cpu_milli > cpu_left:\n            continue\n", ""),
    M("fgdplus-fill-cpu-only-tasks-take-no-cpu", "fgd+ scores the fill", FRAG,
      "            cpu_left -= t.cpu_milli\n            continue\n", "            continue\n"),
    M("fgdplus-fill-takes-the-roomiest-gpus", "fgd+ scores the fill", FRAG,
      "sorted(room, key=free.__getitem__)[: t.gpu_count]", "sorted(room, key=free.__getitem__, reverse=True)[: t.gpu_count]"),
    M("fgdplus-is-fgd", "fgd+ scores the fill", PLACEMENT,
      'FillFragMemo(typical) if policy == "fgd+" else FragMemo(typical)', "FragMemo(typical)"),
    # --- backfill ---------------------------------------------------------------------------------------------------
    M("backfill-ignores-the-reservation", "backfill", CORE,
      "mode = NOW if limit is not None and self.now + limit <= res.start else LONG", "mode = NOW"),
    M("backfill-end-forgets-now", "backfill", CORE,
      "mode = NOW if limit is not None and self.now + limit <= res.start else LONG",
      "mode = NOW if limit is not None and limit <= res.start else LONG"),
    M("reservation-holds-nothing", "backfill", CORE, "        ws.hold(slack)\n", ""),
    M("allocate-goes-on-past-the-reserved-job", "backfill", CORE,
      "            if res is not None:\n                return\n", ""),
    M("reservation-starts-at-the-last-release", "backfill", CORE,
      "return Reservation(job.job_id, releases[lo - 1][0], names)",
      "return Reservation(job.job_id, releases[-1][0], names)"),
    # --- order ------------------------------------------------------------------------------------------------------
    M("job-order-ignores-priority", "priority order", CORE,
      "key=lambda j: (-j.priority_rank, j.submitted_at, j.job_id)", "key=lambda j: (j.submitted_at, j.job_id)"),
    M("job-order-ignores-age", "priority order", CORE,
      "key=lambda j: (-j.priority_rank, j.submitted_at, j.job_id)", "key=lambda j: (-j.priority_rank, j.job_id)"),
    M("queue-order-by-name-first", "fair-share queue order", CORE,
      "heap = [(share(q), q) for q in groups]", "heap = [(0.0, q) for q in groups]"),
    M("queue-order-not-re-ranked", "fair-share queue order", CORE,
      "heapq.heappush(heap, (share(q), q))", "heapq.heappush(heap, (-math.inf, q))"),
    M("queue-order-furthest-above-first", "fair-share queue order", CORE,
      "return self.allocated.get(q, 0.0) / e if e > 0 else math.inf",
      "return -self.allocated.get(q, 0.0) / e if e > 0 else math.inf"),
    # --- DRF ----------------------------------------------------------------------------------------------------------
    M("share-counts-gpus-only", "DRF (dominant share)", FAIRSHARE,
      "return dominant_gpus(gpus * n, res.cpu_milli * n, res.memory_mib * n, r)", "return gpus * n"),
    M("dominant-share-ignores-memory", "DRF (dominant share)", FAIRSHARE,
      "memory_mib / r.memory_mib if r.memory_mib > 0 else 0.0)", "0.0)"),
    M("dominant-share-ignores-cpu", "DRF (dominant share)", FAIRSHARE,
      "cpu_milli / r.cpu_milli if r.cpu_milli > 0 else 0.0,", "0.0,"),
    M("share-counts-one-task", "DRF (dominant share)", FAIRSHARE,
      "res, n = spec.resources, spec.tasks", "res, n = spec.resources, 1"),
    M("queue-order-counts-running-gpus-only", "DRF (dominant share)", CORE,
      "self.allocated[r.queue] = self.allocated.get(r.queue, 0.0) + self.share(r.spec)",
      "self.allocated[r.queue] = self.allocated.get(r.queue, 0.0) + r.gpu_milli / MILLI"),
    # --- decay ------------------------------------------------------------------------------------------------------
    M("usage-never-decays", "decay (usage half-life)", FAIRSHARE,
      "return value * 2.0 ** (-dt / half_life) if half_life > 0 else value", "return value"),
    M("accrued-usage-never-decays", "decay (usage half-life)", FAIRSHARE,
      "return decay(value, dt, half_life) - gpus * math.expm1(-k * dt) / k", "return value + gpus * dt"),
    M("past-hours-never-decay", "decay (usage half-life)", CLUSTER,
      "v * 2.0 ** (-max(0.0, now - (b + 0.5) * ACCOUNTING_BUCKET_S) / half_life)", "v"),
    M("usage-does-not-lower-weight", "decay (usage half-life)", FAIRSHARE,
      "if total_usage <= EPS or total_weight <= EPS:", "if True:"),
    # --- limits -----------------------------------------------------------------------------------------------------
    M("limit-ignores-ancestors", "limits (queue and ancestors)", CORE,
      "            q = parent_of(q)\n        return None", '            q = ""\n        return None'),
    M("holds-not-counted-up-the-tree", "limits (queue and ancestors)", CORE,
      "            queue = parent_of(queue)", '            queue = ""'),
    M("allocate-ignores-limits", "limits (queue and ancestors)", CORE,
      "if (why := self.gated(job)) is not None:  # it waits for a gate or its queue",
      "if (why := self.gates.blocked(job)) is not None:  # it waits for a gate or its queue"),
    M("backfill-ignores-limits", "limits (queue and ancestors)", CORE,
      "            if (why := self.gated(job)) is not None:\n                self.unschedulable[job.job_id] = why\n"
      "                continue\n            limit = job.spec.time_limit_s",
      "            if (why := self.gates.blocked(job)) is not None:\n                self.unschedulable[job.job_id] = why\n"
      "                continue\n            limit = job.spec.time_limit_s"),
    M("preemption-ignores-limits", "limits (queue and ancestors)", CORE,
      "or self.gated(job) is not None:\n                continue  # (placements",
      "or self.gates.blocked(job) is not None:\n                continue  # (placements"),
    M("preemptor-not-counted-against-its-limit", "limits (queue and ancestors)", CORE,
      "self.hold(job.queue, self.share(job.spec))  # room is made for it", "pass  # room is made for it"),
    M("reclaim-ignores-limits", "limits (queue and ancestors)", CORE,
      "or self.gated(job) is not None:\n                    continue  # more than",
      "or self.gates.blocked(job) is not None:\n                    continue  # more than"),
    M("reclaimer-not-counted-against-its-limit", "limits (queue and ancestors)", CORE,
      "                self.hold(job.queue, size)\n", ""),
    M("division-ignores-limits", "limits (queue and ancestors)", FAIRSHARE,
      "want[p] = min(raw, limit(p)) if p != ROOT else raw", "want[p] = raw"),
    # --- guarantees -------------------------------------------------------------------------------------------------
    M("guarantees-ignored", "guarantees", FAIRSHARE,
      "base = {k: min(spec[k].guaranteed.gpus, want[k]) for k in kids}", "base = {k: 0.0 for k in kids}"),
    M("guarantee-not-capped-by-demand", "guarantees", FAIRSHARE,
      "base = {k: min(spec[k].guaranteed.gpus, want[k]) for k in kids}",
      "base = {k: spec[k].guaranteed.gpus for k in kids}"),
    M("oversubscribed-guarantees-not-shrunk", "guarantees", FAIRSHARE,
      "if total_base > amount + EPS:", "if False:"),
    # --- what is owed -----------------------------------------------------------------------------------------------
    M("owed-not-capped-by-guarantee", "owed capped by entitlement", FAIRSHARE,
      "target = min(queues[q].guaranteed.gpus, entitlement.get(q, 0.0), have + waiting)",
      "target = min(entitlement.get(q, 0.0), have + waiting)"),
    M("owed-below-the-smallest-waiting-job", "owed capped by entitlement", FAIRSHARE,
      "if waiting > EPS and owed > EPS and owed >= floor - EPS:", "if waiting > EPS and owed > EPS:"),
    # --- priority preemption ----------------------------------------------------------------------------------------
    M("preempt-equal-priority", "priority preemption", CORE,
      "below = min(job.priority_rank, self.policy.preemptible_below)",
      "below = min(job.priority_rank + 1, self.policy.preemptible_below)"),
    M("preempt-ignores-preemptible-below", "priority preemption", CORE,
      "below = min(job.priority_rank, self.policy.preemptible_below)", "below = job.priority_rank"),
    M("preempt-crosses-queues", "priority preemption", CORE,
      "scope = queues if self.policy.cross_queue_preemption else [job.queue]", "scope = queues"),
    # --- guards -----------------------------------------------------------------------------------------------------
    M("thrashing-guard-off-by-one", "thrashing guard", PLAN,
      "if now - t < 3600) >= self.max_preemptions_per_hour", "if now - t < 3600) > self.max_preemptions_per_hour"),
    M("thrashing-guard-counts-the-last-minute", "thrashing guard", PLAN,
      "if now - t < 3600) >= self.max_preemptions_per_hour", "if now - t < 60) >= self.max_preemptions_per_hour"),
    M("reclaim-ignores-protected", "protected victims", CORE,
      "                and not self.policy.protected(r, self.now)\n            ]", "            ]"),
    M("min-runtime-counts-from-placement", "min runtime", PLAN,
      "began = job.started_at if job.started_at is not None else job.placed_at", "began = job.placed_at"),
    # --- grace ------------------------------------------------------------------------------------------------------
    M("preemption-without-grace", "grace", CORE,
      "self.policy.grace_s, for_job=job.job_id)", "0, for_job=job.job_id)"),
    M("reclaim-with-the-priority-grace", "grace", CORE,
      "self.policy.reclaim_grace_s, for_queue=queue)", "self.policy.grace_s, for_queue=queue)"),
    # --- victims ----------------------------------------------------------------------------------------------------
    M("victim-frees-its-first-task-only", "whole-gang victims", WORK,
      "        for p in job.placements:\n            idx = self.index_of.get(p.node_id)\n            if idx is None:\n",
      "        for p in job.placements[:1]:\n            idx = self.index_of.get(p.node_id)\n            if idx is None:\n"),
    M("victims-most-expensive-first", "cheapest victims", PREEMPTION,
      "ranked = sorted(pool, key=lambda v: (cost[v.job_id], v.priority_rank, v.job_id))",
      "ranked = sorted(pool, key=lambda v: (-cost[v.job_id], v.priority_rank, v.job_id))"),
    M("cost-ignores-gang-size", "cheapest victims", PREEMPTION,
      "return job.gpu_milli / MILLI * max(0.0, now - start)", "return max(0.0, now - start)"),
    M("unneeded-victims-kept-on-a-node", "cheapest victims", PREEMPTION,
      "                if rest and self._fits_here(idx, sid, tasks, rest):\n                    chosen = rest",
      "                if False:\n                    chosen = rest"),
    M("victims-room-not-claimed", "cheapest victims", PREEMPTION,
      "        undo = [u for v in chosen for u in self.ws.give(self.footprint(v))]\n"
      "        if place_gang(self.ws, sid, tasks, topo, mode) is None:\n"
      "            self.ws.undo(undo)\n            return None\n", ""),
    # --- reclaim ----------------------------------------------------------------------------------------------------
    M("reclaim-alone-ignores-queue-priority", "reclaim tiers", CORE,
      "pool.sort(key=lambda r: (qprio.get(r.queue, 0), r.priority_rank, lost_gpu_seconds(r, self.now), r.job_id))",
      "pool.sort(key=lambda r: (r.priority_rank, lost_gpu_seconds(r, self.now), r.job_id))"),
    M("leaving-still-counted-as-staying", "leaving jobs", CORE,
      "if r.preempting or r.job_id in self.evicted:  # evicted", "if r.job_id in self.evicted:  # evicted"),
    M("leaving-job-preempted-again", "leaving jobs", CORE,
      "            if not r.preempting:\n                groups.setdefault(",
      "            if True:\n                groups.setdefault("),
    M("leaving-job-reclaimed-again", "leaving jobs", CORE,
      "if not r.preempting and r.job_id not in self.evicted and r.queue != req.queue",
      "if r.job_id not in self.evicted and r.queue != req.queue"),
    M("reclaim-takes-from-its-own-queue", "reclaim victims", CORE,
      "if not r.preempting and r.job_id not in self.evicted and r.queue != req.queue",
      "if not r.preempting and r.job_id not in self.evicted"),
    M("reclaim-overdraws-victim-queues", "reclaim victims", CORE,
      "                if held - t < floor - 1e-9:\n                    return False",
      "                if False:\n                    return False"),
    M("replicas-of-any-owner", "a deployment's replicas are its own", "services/autoscaler/service.py",
      "== name and j.owner == owner and j.state in", "== name and j.state in"),
    M("a-deleted-deployment-keeps-its-replicas", "a deployment's replicas are its own", "services/autoscaler/service.py",
      "            for job_id, name in orphans:", "            for job_id, name in []:"),
    M("the-load-kept-in-memory-only", "a deployment's load outlives its autoscaler", "services/autoscaler/service.py",
      '        await (await self._loads()).put(name, json.dumps({"pending_requests": pending}).encode())',
      '        self.__dict__.setdefault("posted", {})[name] = pending'),
    M("no-srun-on-the-path", "srun runs in its task", "services/inventory/taskenv.py",
      'return {"PATH": f"{SHIMS}:{python_dir}:{SAFE_PATH}"', 'return {"PATH": f"{python_dir}:{SAFE_PATH}"'),
    M("srun-ignores-chdir", "srun runs in its task", "services/inventory/bin/srun",
      'if [ -n "$dir" ]; then cd "$dir" || die "cannot cd to $dir"; fi', ':'),
    M("a-422-echoes-the-whole-body", "a 422 echoes no secret", "shared/api_errors.py",
      "    if isinstance(value, (dict, list, tuple)) or SECRET_FIELDS", "    if SECRET_FIELDS"),
    M("a-422-echoes-a-secret", "a 422 echoes no secret", "shared/api_errors.py",
      'SECRET_FIELDS = frozenset({"secret_env", "token", "password"})', "SECRET_FIELDS = frozenset()"),
    M("a-422-echoes-a-long-value-whole", "a 422 echoes no secret", "shared/api_errors.py",
      "    elif isinstance(value, (str, bytes)) and len(value) > SHOWN_INPUT_CHARS:",
      "    elif False:"),
    M("a-lost-pool-node-kept-for-ever", "a lost pool node is replaced", "services/autoscaler/scaling.py",
      "        if gone:\n            out[pool.spec.name] = sorted(gone)", "        if False:\n            pass"),
    M("reclaim-floor-is-the-entitlement", "guarantees come back whole gangs at a time", "services/scheduler/decide.py",
      "floors = {q: min(queues[q].guaranteed.gpus if q in queues else 0.0, e) for q, e in",
      "floors = {q: e for q, e in"),
    M("reclaim-ignores-parent-guarantees", "guarantees come back whole gangs at a time", CORE,
      "                q = parent_of(q)\n        for q, t in taken.items():",
      "                break\n        for q, t in taken.items():"),
    M("reclaim-guards-the-parent-it-shares", "guarantees come back whole gangs at a time", CORE,
      "            while q and not (for_queue == q or for_queue.startswith(q + \".\")):", "            while q:"),
    # --- gates: dependencies, arrays, singleton (issue 14) -----------------------------------------------------------
    M("afterok-met-by-any-end", "dependencies", GATES,
      'MEETS = {"afterok": OK, "afternotok": NOT_OK, "afterany": ENDED}',
      'MEETS = {"afterok": ENDED, "afternotok": NOT_OK, "afterany": ENDED}'),
    M("never-met-waits-forever", "dependencies", GATES,
      "        if state in ENDED and state not in wanted:\n            return \"never\"",
      "        if False:\n            return \"never\""),
    M("one-array-element-meets-the-dependency", "dependencies", GATES,
      "    left = [(j, s) for j, s in jobs if s not in ENDED]\n    if not left:",
      "    left = [(j, s) for j, s in jobs if s not in ENDED]\n    if len(left) < len(jobs):"),
    M("array-throttle-ignored", "array throttle", GATES,
      "self.array_held.get(a.id, 0) >= a.max_running", "self.array_held.get(a.id, 0) > 10**9"),
    M("array-throttle-off-by-one", "array throttle", GATES,
      "self.array_held.get(a.id, 0) >= a.max_running", "self.array_held.get(a.id, 0) > a.max_running"),
    M("placed-elements-not-counted", "array throttle", GATES,
      "        self._hold(job.job_id, job.spec.name, job.owner, job.spec.array.id if job.spec.array else None)",
      "        pass"),
    M("singleton-ignored", "singleton", GATES,
      "if spec.singleton and (other := self.named.get((spec.name, job.owner))) is not None:",
      "if False and (other := self.named.get((spec.name, job.owner))) is not None:"),
    M("singleton-across-owners", "singleton", GATES,
      "self.named.get((spec.name, job.owner))", "next((j for (n, _), j in self.named.items() if n == spec.name), None)"),
    M("every-new-reason-logged", "reasons are state", "services/scheduler/reasons.py",
      "    if not logged or reason_class(reason) != reason_class(logged):\n        return True\n",
      "    return True\n"),
    M("reason-refresh-never", "reasons are state", "services/scheduler/reasons.py",
      "    return logged_at is None or now - logged_at >= refresh_s", "    return logged_at is None"),
    M("gates-ignored-at-allocation", "gates hold everywhere", CORE,
      "        return self.gates.blocked(job) or self.over_limit(job)", "        return self.over_limit(job)"),
    # --- issue 15 ---------------------------------------------------------------------------------------------------
    M("work-overwrites-a-later-word", "work only over an older word", "services/inventory/work.py",
      "            if last_word >= word.seq:", "            if False:"),
    M("agent-reads-every-nodes-work", "agents read their own node", "shared/natsauth.py",
      'f"$JS.API.CONSUMER.CREATE.GPUORCH_WORK.*.gpuorch.work.{t}.>"', '"$JS.API.CONSUMER.CREATE.GPUORCH_WORK.>"'),
    M("task-keeps-the-keepers-socket", "no task reaches the forker", "services/inventory/launcher.py",
      "stderr=stderr, start_new_session=True)", "stderr=stderr, close_fds=False, start_new_session=True)"),
    M("task-in-the-keepers-session", "no task reaches the forker", "services/inventory/launcher.py",
      "stderr=stderr, start_new_session=True)", "stderr=stderr, start_new_session=False)"),
    M("keeper-records-no-exit", "every exit recorded", "services/inventory/launcher.py",
      "        _record(record, _result(code))  # this keeper's task", "        pass  # this keeper's task"),
    M("tasks-of-accounts-forked-here", "an account's tasks from its own keeper", "services/inventory/launcher.py",
      "keeper = accounts.keeper(args) if accounts is not None and args.uid is not None else None", "keeper = None"),
    M("account-keeper-dumpable", "an account's tasks from its own keeper", "services/inventory/launcher.py",
      "not _prctl(PR_SET_DUMPABLE, 0)", "not _prctl(PR_SET_DUMPABLE, 1)"),
    M("account-exits-not-recorded", "an account's tasks from its own keeper", "services/inventory/launcher.py",
      "                _record(self.running.pop(pid)[1], _result(code))", "                self.running.pop(pid)"),
    M("an-account-keepers-word-unchecked", "an account's tasks from its own keeper", "services/inventory/launcher.py",
      "said = _account_word(json.loads(body)) if body else None", "said = json.loads(body) if body else None"),
    M("another-keepers-exit-believed", "an account's tasks from its own keeper", "services/inventory/launcher.py",
      "if pid in self.tasks and self.running.get(pid, (None,))[0] is self:", "if pid in self.running:"),
    M("an-account-keepers-pid-believed", "an account's tasks from its own keeper", "services/inventory/launcher.py",
      'if _parent(said["pid"]) not in (self.pid, None):', "if False:"),
    M("a-reaped-task-taken-for-another", "an account's tasks from its own keeper", "services/inventory/launcher.py",
      'return None if state == b"X" else int(ppid)', "return int(ppid)"),
    M("no-cap-on-account-keepers", "an account's tasks from its own keeper", "services/inventory/launcher.py",
      "        if len(self.keepers) >= ACCOUNT_KEEPERS_MAX:", "        if False:"),
    M("a-busy-account-keeper-ended", "an account's tasks from its own keeper", "services/inventory/launcher.py",
      "idle = [(k.used, kk) for kk, k in self.keepers.items() if not k.tasks]",
      "idle = [(k.used, kk) for kk, k in self.keepers.items()]"),
    M("account-keeper-keeps-the-roots-descriptors", "an account's tasks from its own keeper",
      "services/inventory/launcher.py", "                os.closerange(3, keep)  #", "                pass  #"),
    M("a-stuck-account-keeper-awaited", "an account's tasks from its own keeper", "services/inventory/launcher.py",
      "ACCOUNT_REPLY_S = 3.0", "ACCOUNT_REPLY_S = 30.0"),
    M("account-keepers-outlive-their-keeper", "an account's tasks from its own keeper",
      "services/inventory/launcher.py", "                accounts.close()  # each ends", "                pass  # each ends"),
    M("account-keeper-starts-by-path", "an account's tasks from its own keeper", "services/inventory/launcher.py",
      "            os.fchdir(fds[2])\n            proc = subprocess.Popen(cmd, env=",
      "            proc = subprocess.Popen(cmd, cwd=os.readlink(f'/proc/self/fd/{fds[2]}'), env="),
    M("orphans-not-recorded", "every exit recorded", "services/inventory/launcher.py",
      "    _record(record, result)\n    return result", "    return None"),
    M("keeper-leaves-with-its-agent", "every exit recorded", "services/inventory/launcher.py",
      "    while serving or _reap(running):", "    while serving:"),
    M("the-agent-blocks-on-its-keeper", "no task reaches the forker", "services/inventory/forker.py",
      "return _answer(await self._recv())", "return _answer(self.sock.recv(4096))"),
    M("keeper-dies-answering-a-gone-agent", "every exit recorded", "services/inventory/launcher.py",
      "    try:\n        sock.send(text.encode())\n    except OSError:\n        return False\n    return True",
      "    sock.send(text.encode())\n    return True"),
    M("stack-files-rewritten-in-place", "stack files replaced at once", "services/stack_procs.py",
      '    tmp.write_text(json.dumps(doc, indent=2))\n    tmp.replace(path)', '    path.write_text(json.dumps(doc, indent=2))'),
    M("forgets-by-first-word-not-by-end", "ended jobs remembered", "services/inventory/agent.py",
      "            self.ended.pop(word.job_id, None)\n            self.ended[word.job_id] = None",
      "            self.ended.setdefault(word.job_id, None)"),
    M("forgets-a-job-placed-again", "ended jobs remembered", "services/inventory/agent.py",
      "if (order := self.orders.get(job_id)) is not None and order.ended:",
      "if (order := self.orders.get(job_id)) is not None:"),
    M("a-record-step-glued-to-a-cut-line", "a task's record survives", "services/inventory/taskdir.py",
      'os.write(fd, b"\\n" + json.dumps({"step": step, **fields}).encode())',
      'os.write(fd, json.dumps({"step": step, **fields}).encode() + b"\\n")'),
    M("an-upgrade-starts-a-task-again", "a task's record survives", "services/inventory/taskdir.py",
      'return (task_dir / RECORD).exists() or (task_dir / "started").exists()', 'return (task_dir / RECORD).exists()'),
    M("an-upgrade-loses-the-pid", "a task's record survives", "services/inventory/taskdir.py",
      '    if "started" not in steps:  # started by an older agent', '    if False:  # started by an older agent'),
    M("an-upgrade-forgets-the-steps-since", "a task's record survives", "services/inventory/taskdir.py",
      'old.start_reported or "start_reported" in steps', 'old.start_reported'),
    M("a-secret-shown-in-a-job-view", "secrets never shown", "services/scheduler/api.py",
      '"spec": redact(job.spec_json()) if job.spec.secret_env else job.spec_json(),', '"spec": job.spec_json(),'),
    M("a-job-view-masks-the-kept-dump", "secrets never shown", "services/scheduler/api.py",
      '"spec": redact(job.spec_json()) if job.spec.secret_env else job.spec_json(),',
      '"spec": job.spec_json().update(secret_env={k: "<redacted>" for k in job.spec.secret_env}) or job.spec_json(),'),
    M("an-older-keepers-exit-ignored", "a task's record survives", "services/inventory/taskdir.py",
      '    text = read_state(task_dir, "exit.json")', '    text = None'),
    M("a-later-exit-step-wins", "a task's record survives", "services/inventory/taskdir.py",
      '                steps.setdefault(step["step"], step)', '                steps[step["step"]] = step'),
    M("a-refusal-reason-uncut", "a task's record survives", "services/inventory/launcher.py",
      '    result = {**result, "reason": result["reason"][:REASON_MAX]} if "reason" in result else result', ''),
    M("a-lagging-record-reported-lost", "every exit recorded", "services/inventory/agent.py",
      "            if now < t.record_due:", "            if False:"),
    M("the-caller-in-the-thread-pool", "requests never wait for the thread pool", "shared/auth.py",
      "async def caller(request: Request) -> Principal:", "def caller(request: Request) -> Principal:"),
    M("a-path-id-in-the-thread-pool", "requests never wait for the thread pool", "shared/api_errors.py",
      "    async def check(value: str) -> str:", "    def check(value: str) -> str:"),
    M("the-digests-on-the-loop", "requests never wait for the thread pool", "shared/runtime.py",
      "        return await statuses(services)\n", "        return [s.status() for s in services]\n"),
    M("a-timer-cancelled-once", "a stop ends every timer", "shared/runtime.py",
      "timeout=min(TIMER_RECANCEL_S, max(0.0, deadline - loop.time()))", "timeout=max(0.0, deadline - loop.time())"),
    M("folds-run-under-a-reader", "no fold under a reader", "shared/runtime.py",
      "        fold.readers += 1\n        fold.open.clear()\n", "        fold.readers += 1\n"),
    M("readers-ahead-of-waiting-folds", "no reader starves the folds", "shared/runtime.py",
      "        await fold.read_gate()\n", ""),
    M("a-digest-named-by-the-latest-seq", "a digest is of the position it names", "shared/runtime.py",
      "            out[s.name] = s.status_at(pos, digests[s.name])",
      "            out[s.name] = s.status_at(proj.position(), digests[s.name])"),
    M("the-digests-encoded-per-service", "a digest is of the position it names", "shared/runtime.py",
      "    for fold in {id(s.fold): s.fold for s in services}.values():",
      "    for fold in [s.fold for s in services]:"),
    M("the-digests-never-kept", "a digest is of the position it names", "shared/runtime.py",
      "            digests = {s.name: proj.digest_kept(pos, s.state_keys) for s in mine}",
      "            digests = {s.name: None for s in mine}"),
    M("an-evicted-element-still-indexed", "an array's elements by index", "shared/cluster.py",
      "            if (gone := self.jobs.pop(old, None)) is not None and (a := gone.spec.array) is not None:",
      "            if (gone := self.jobs.pop(old, None)) is not None and False:"),
    M("the-array-index-not-rebuilt", "an array's elements by index", "shared/cluster.py",
      "            self.add_job(JobRecord.from_json(v))\n",
      "            self.jobs[v[\"job_id\"]] = JobRecord.from_json(v)\n"),
    M("the-submitted-in-the-target-workload", "a scrape's passes read what the slow reads did",
      "services/scheduler/metrics.py", '            if state == "queued" or state in HOLDING:\n                count_shape',
      '            if state in PENDING or state in HOLDING:\n                count_shape'),
    M("a-shape-kept-past-its-spec", "a scrape's passes read what the slow reads did", "services/scheduler/metrics.py",
      "    if kept is None or kept[0] is not job.spec:", "    if kept is None:"),
    M("one-ratios-for-every-load", "a scrape's passes read what the slow reads did", "shared/cluster.py",
      "        pairs = tuple(zip(ratios, outs))", "        pairs = tuple(zip(ratios[:1] * len(ratios), outs))"),
    M("record-layouts-left-to-the-readers", "a scrape's passes read what the slow reads did", "shared/cluster.py",
      "        self.__dict__.update(dict.fromkeys(KEPT_PER_SPEC))", "        pass"),
    M("a-bulk-cancel-of-jobs-only-seen", "one cancel for many, as for one", "services/scheduler/api.py",
      '            elif job_access(p, j, proj.queues) != "cancel":', "            elif False:"),
    M("a-bulk-cancel-finds-the-unseen", "one cancel for many, as for one", "services/scheduler/api.py",
      '                visible = [j for j in found if job_access(p, j, proj.queues) != "none"]',
      "                visible = list(found)"),
    M("a-bulk-cancel-in-one-append", "one cancel for many, as for one", "services/scheduler/api.py",
      "CANCEL_CHUNK = 1_000  # cancellations appended at once", "CANCEL_CHUNK = 1_000_000"),
    M("a-late-cancel-called-invalid", "one cancel for many, as for one", "shared/cluster.py",
      '        self.invalid(env, why, "late")', '        self.invalid(env, why)'),
    M("a-late-cancel-answered-as-cancelled", "one cancel for many, as for one", "services/scheduler/api.py",
      '                if state == "cancelled":\n                    cancelled.append(job_id)',
      '                if True:\n                    cancelled.append(job_id)'),
    M("empty-states-mean-any", "one cancel for many, as for one", "services/scheduler/api.py",
      "Field(default=None, min_length=1,  # empty is not", "Field(default=None,  # empty is not"),
    M("borrowing-first", "reclaim and allocation agree", "services/scheduler/core.py",
      "                        borrowing.setdefault(q, []).append(jobs[i])", "                        yield jobs[i]"),
    M("borrowing-by-entitlement", "reclaim and allocation agree", "services/scheduler/core.py",
      "floors = {q: self._floor(q) or 0.0 for q in by_queue}", "floors = {q: ent.get(q, 0.0) for q in by_queue}"),
    M("borrowers-in-a-frozen-order", "reclaim and allocation agree", "services/scheduler/core.py",
      "        yield from by_share(borrowing)", "        yield from (j for q in borrowing for j in borrowing[q])"),
    M("a-pool-wait-called-never", "a job waits for a pool, not for ever", "services/scheduler/reasons.py",
      "    if POOL_NOTE in reason:  # it waits", "    if False:  # it waits"),
    M("pools-together-never-named", "a job waits for a pool, not for ever", "services/scheduler/admission.py",
      "    if alone or len(proj.pool_shapes) < 2:", "    if True:"),
    M("a-form-body-read-as-fields", "what a body is read as", "shared/api_errors.py",
      "    if (why := _unread_body(request, exc.errors())) is not None:", "    if False:"),
    M("an-sbatch-body-left-to-the-route", "what a body is read as", "services/scheduler/jobinput.py",
      "        if mime in SHELL:", "        if False:"),
    M("a-gang-across-models-unsaid", "what a body is read as", "services/scheduler/api.py",
      "if len(models) > 1 else []", "if len(models) > 9 else []"),
    M("a-gang-models-memory-unread", "what a body is read as", "services/scheduler/api.py",
      "if g.memory_mib >= need[1] and (parse_cc", "if (parse_cc"),
    M("a-pinned-gang-warned", "what a body is read as", "services/scheduler/api.py",
      "or spec.gpu.models or spec.gpu.mig:", "or spec.gpu.mig:"),
    M("a-batch-waits-as-one-job", "a large batch waits for its own fold", "services/scheduler/api.py",
      "await svc.caught_up(seqs[-1], fold_wait_s(svc, len(envs)), advice=",
      "await svc.caught_up(seqs[-1], None, advice="),
    M("a-signal-folded-as-null", "a task's end says how", "shared/cluster.py",
      "            job.tasks_exited[e.task] = e.code if e.code is not None or e.signal is None else -e.signal",
      "            job.tasks_exited[e.task] = e.code"),
    M("a-signal-shown-as-a-number", "a task's end says how", "services/cli.py",
      "            return signal.Signals(-code).name", "            return str(code)"),
    M("a-peers-zero-for-a-killed-job", "a task's end says how", "services/cli.py",
      "    if failing := [c for c in codes if c != 0]:", "    if failing := [c for c in codes if c > 0]:"),
    M("owed-but-silent", "an owed queue told why it still waits", "services/scheduler/core.py",
      "                    failed.add(memo)\n                    self._unreclaimable(job, req)",
      "                    failed.add(memo)"),
    M("owed-said-of-a-shape-not-searched", "an owed queue told why it still waits", "services/scheduler/core.py",
      "                if memo in failed:\n                    self._unreclaimable(job, req)\n                    continue",
      "                if memo in failed:\n                    continue"),
    M("every-service-consumes", "one delivery per reacting service", "shared/runtime.py",
      "        return self.reaction is None and any(", "        return False and any("),
    M("a-watch-on-every-delivery", "one delivery per reacting service", "shared/runtime.py",
      "        if first and env is not None:\n            self._watched(env)",
      "        if env is not None:\n            self._watched(env)"),
    M("the-heap-never-frozen", "the heap out of the collector's sight", "shared/aio.py",
      "    if phase == \"stop\" and info[\"generation\"] >= 1:\n        gc.freeze()", "    pass"),
    M("frozen-before-the-collection", "the heap out of the collector's sight", "shared/aio.py",
      "    if phase == \"stop\" and info[\"generation\"] >= 1:", "    if info[\"generation\"] >= 1:"),
    M("never-thawed", "the heap out of the collector's sight", "shared/aio.py",
      "        gc.unfreeze()\n        gc.collect()  # its callback", "        gc.collect()  # its callback"),
    M("a-process-without-the-freezer", "the heap out of the collector's sight", "shared/aio.py",
      "    gc.callbacks.append(freeze_survivors)\n    try:", "    try:"),
    M("admission-verdicts-kept-forever", "admission verdicts renewed", "services/scheduler/projection.py",
      "            self.shape_version = next(_VERSIONS)\n        return changed", "            pass\n        return changed"),
    M("decide-under-the-held-folds", "decide beside the folds", "services/scheduler/service.py",
      "self.settings.reclaim_after_s)))\n        plan, decide_s = await asyncio.to_thread(on_cpu, read.decide)",
      "self.settings.reclaim_after_s).decide()))\n        plan, decide_s = read, 0.0"),
    M("snapshot-shares-the-state", "a snapshot copies out", "shared/projection.py",
      '"state": {k: v if k in self.FRESH_STATE else Encoded(to_json(v)) for k, v in state.items()},',
      '"state": state,'),
    M("snapshot-shares-the-terms", "a snapshot copies out", "shared/projection.py",
      '"terms": Encoded(to_json(self.terms)),', '"terms": self.terms,'),
    M("cycles-back-to-back", "a long cycle rests", "services/scheduler/service.py",
      "ended + max(self.debounce, REST * self.work_s())", "ended + self.debounce"),
    M("the-decision-cpu-uncounted", "a long cycle rests", "services/scheduler/service.py",
      "self.decided_s = read_s + decide_s", "self.decided_s = 0.0"),
    M("an-end-rests-for-the-whole-process", "a long cycle rests", "services/scheduler/service.py",
      "return self.decided_s if self.freed else self.worked_s", "return self.worked_s"),
    M("a-flood-rests-for-the-decision-only", "a long cycle rests", "services/scheduler/service.py",
      "return self.decided_s if self.freed else self.worked_s", "return self.decided_s"),
    M("a-submission-counts-as-room-freed", "a long cycle rests", "services/scheduler/service.py",
      "self.freed = self.freed or not env.data.TYPE.startswith(SUBMISSION)", "self.freed = True"),
    M("rest-in-wall-time", "a long cycle rests", "services/scheduler/service.py",
      "self.worked_s = time.process_time() - cpu0", "self.worked_s = time.perf_counter() - t0"),
    M("append-many-flushes", "a cancelled append harms nothing", "shared/eventlog.py",
      "                    await wait_event(all_acked, 5)",
      "                    await self.nc.flush(timeout=5)\n                    await wait_event(all_acked, 5)", "issue"),
    M("every-wake-waits-a-debounce", "a quiet spell's event at once", "services/scheduler/service.py",
      "await asyncio.sleep(max(0.0, ended + max(self.debounce, REST * self.work_s()) - time.monotonic()))",
      "await asyncio.sleep(max(self.debounce, REST * self.work_s()))"),
    M("reaper-ignores-a-grace-deadline", "the reaper wakes when due", "services/inventory/agent.py",
      "wait = min(wait, t.kill_at - now)", "pass"),
    M("a-stop-does-not-wake-the-reaper", "the reaper wakes when due", "services/inventory/agent.py",
      "self.exited.set()  # the reaper's next round is due when the grace ends", "pass"),
    M("a-waiting-view-kept-after-a-preemption", "the cycle's read, one pass", "services/scheduler/snapshot.py",
      "or view.preemptions != len(job.preemptions) ", ""),
    M("every-pending-job-has-waited-long-enough", "the cycle's read, one pass", CLUSTER,
      "waited = job.spec.queue, waited_before is None or job.updated_at <= waited_before",
      "waited = job.spec.queue, True"),
    M("smallest-of-jobs-not-queued-yet", "the cycle's read, one pass", CLUSTER,
      'if state == "queued" and gpus < smallest.get(q, float("inf")):', 'if gpus < smallest.get(q, float("inf")):'),
    M("two-reports-of-a-task-at-once", "reports in task order", "services/inventory/outbox.py",
      "if task in tasks:\n                continue", "if False:\n                continue"),
    M("a-registration-in-a-batch", "reports in task order", "services/inventory/outbox.py",
      "return out or [(key, report)]", "out.append((key, report))\n                continue"),
    M("unwatched-exits-are-not-polled", "the reaper wakes when due", "services/inventory/agent.py",
      "wait = min(wait, REAP_POLL_S)\n                continue", "continue"),
    M("a-refused-request-answered-503", "the gateway waits out a restart", "services/stack.py",
      "if time.monotonic() >= deadline or not may_send_again(request.method, e, safe_post):", "if True:"),
    M("a-cut-off-post-sent-again", "the gateway waits out a restart", "services/stack.py",
      "return cut_off and (method in IDEMPOTENT or safe_post)", "return cut_off"),
    M("a-cut-off-submission-answered-503", "the gateway waits out a restart", "services/stack.py",
      "return cut_off and (method in IDEMPOTENT or safe_post)", "return cut_off and method in IDEMPOTENT"),
    M("the-gateway-keys-any-post", "the gateway waits out a restart", "services/stack.py",
      'if path.rstrip("/") != "/v1/jobs":', "if False:"),
    M("a-drain-sent-again", "the gateway waits out a restart", "services/stack.py",
      "/(cordon|resume)$", "/(cordon|resume|drain)$"),
    M("a-retry-gets-new-ids", "submissions recorded once", "services/scheduler/api.py",
      'base = new_id("j-") if bases is None else bases[n]', 'base = new_id("j-")'),
    M("a-retry-not-answered-from-the-record", "submissions recorded once", "services/scheduler/api.py",
      "if key and bases and (replay := recorded_before(", "if False and (replay := recorded_before("),
    M("a-key-reused-for-another-request", "submissions recorded once", "services/scheduler/api.py",
      "            raise HTTPException(422, reused(key, job.job_id))", "            pass"),
    M("a-key-shared-between-users", "submissions recorded once", "services/scheduler/api.py",
      'f"{user}\\0{key}\\0{index}\\0{kind}"', 'f"{key}\\0{index}\\0{kind}"'),
    M("a-key-forgotten-with-its-job", "submissions recorded once", "services/scheduler/api.py",
      "elif (named := scheduler.history.name_and_queue(first)) is not None:", "elif False:"),
    M("a-recorded-job-appended-again", "submissions recorded once", "services/scheduler/api.py",
      "known = proj.jobs.get(job_id) if bases is not None else None", "known = None"),
    M("a-lost-queued-left-lost", "submissions recorded once", "services/scheduler/api.py",
      'if known is None or known.state == "submitted":', "if known is None:"),
    M("an-array-recorded-in-part-answered-whole", "submissions recorded once", "services/scheduler/api.py",
      "return None  # an earlier try recorded part of it (an array's elements, a job.queued): the rest", "pass"),
    M("a-job-without-its-queued-answered-as-recorded", "submissions recorded once", "services/scheduler/api.py",
      'if any(i not in proj.jobs or proj.jobs[i].state == "submitted" for i in ids):',
      "if any(i not in proj.jobs for i in ids):"),
    M("the-cli-retries-without-its-key", "submissions recorded once", "services/cli.py",
      'headers["idempotency-key"] = key', "pass"),
    M("the-cli-gives-up-at-a-cut-off", "submissions recorded once", "services/cli.py",
      "if key is None or not reached or time.monotonic() >= deadline:", "if True:"),
    M("reports-sent-while-the-bus-is-away", "reports in task order", "services/inventory/outbox.py",
      "if not evlog.nc.is_connected:", "if False:"),
    M("guarantee-note-dropped", "a job too large for what its queue is owed told so", CORE,
      "    cycle.explain_guarantees()\n", ""),
    M("guarantee-note-for-a-queue-owed-nothing", "a job too large for what its queue is owed told so", CORE,
      "if have >= floor - EPS or (size := self.share(job.spec)) <= floor - have + EPS:",
      "if (size := self.share(job.spec)) <= floor - have + EPS:"),
    M("guarantee-note-for-a-job-within-what-is-owed", "a job too large for what its queue is owed told so", CORE,
      "if have >= floor - EPS or (size := self.share(job.spec)) <= floor - have + EPS:",
      "if have >= floor - EPS or (size := self.share(job.spec)) < 0:"),
    M("guarantee-note-for-a-job-that-fits-nowhere", "a job too large for what its queue is owed told so", CORE,
      'reason_class(why) in ("evictions", "never fits"):', 'reason_class(why) == "evictions":'),
    M("guarantee-note-over-a-preemption", "a job too large for what its queue is owed told so", CORE,
      'reason_class(why) in ("evictions", "never fits"):', 'reason_class(why) == "never fits" or "reclaim" in why:'),
    M("jobs-u-ignored", "what a user reads", "services/cli.py",
      "rows = list_jobs(url, queue, states, limit + 1, user)", "rows = list_jobs(url, queue, states, limit + 1)"),
    M("state-all-refused", "what a user reads", "services/cli.py", '    "ALL": JOB_STATES,\n', ""),
    M("earlier-attempt-unmarked", "what a user reads", "services/cli.py",
      'if d.get("attempt") not in (None, attempt):', "if False:"),
    M("array-logs-no-job", "what a user reads", "services/scheduler/api.py",
      "if job_id not in proj.jobs and (members := elements(job_id, p)):  # an array has no output of its own",
      "if False and (members := []):"),
    M("dead-agents-left-dead", "agents supervised", "services/stack.py",
      "if self.stopping or child.alive():", "if True:"),
    M("a-crash-loop-restarted-at-once", "agents supervised", "services/stack.py",
      "return 0.0 if lived_s >= AGENT_STABLE_S else", "return 0.0 if True else"),
    # --- holds -----------------------------------------------------------------------------------------------------
    M("the-scheduler-places-held-jobs", "a held job is never placed", "services/scheduler/snapshot.py",
      '        if job.state == "queued":\n            pending.append', '        if job.state in ("queued", "held"):\n'
      '            pending.append'),
    M("the-fold-places-a-held-job", "a held job is never placed", "shared/cluster.py",
      'job = self._job(env, e.job_id, {"queued"})\n        if job is None:', 'job = self._job(env, e.job_id, '
      '{"queued", "held"})\n        if job is None:'),
    M("a-held-job-counts-as-pending", "a held job wants nothing", "shared/cluster.py",
      "            elif state in PENDING:\n                q, waited",
      '            elif state in PENDING or state == "held":\n                q, waited'),
    M("a-running-job-can-be-held", "only a waiting job is held", "services/scheduler/api.py",
      'want = HOLDABLE if verb == "hold"', 'want = CANCELLABLE if verb == "hold"'),
    M("the-fold-holds-a-placed-job", "only a waiting job is held", "shared/cluster.py",
      "if job := self._job(env, e.job_id, HOLDABLE):", "if job := self._job(env, e.job_id, CANCELLABLE):"),
    M("a-hold-appended-whatever-moved", "a hold never lands on a job that moved", "services/scheduler/api.py",
      "seq = await svc.log.append(env, expected_last_subject_seq=job.seq)\n            except ConcurrencyConflict:\n"
      "                await svc.caught_up(await svc.log.last_seq())",
      "seq = await svc.log.append(env)\n            except ConcurrencyConflict:\n"
      "                await svc.caught_up(await svc.log.last_seq())"),
    M("an-array-hold-appended-whatever-moved", "a hold never lands on a job that moved", "services/scheduler/api.py",
      "expected=[j.seq for j in jobs])", "expected=None)"),
    M("a-user-raises-a-time-limit", "a job changes within its rights", "services/scheduler/api.py",
      "change.time_limit_s is not None and old is not None and change.time_limit_s > old",
      "change.time_limit_s is not None and old is not None and change.time_limit_s > 10**9"),
    M("priority-changed-past-the-queue-cap", "a job changes within its rights", "services/scheduler/api.py",
      'return submit_error(p, proj.queues, job.spec.model_copy(update={"priority": change.priority}))', "return None"),
    M("the-fold-changes-a-running-jobs-priority", "a job changes within its rights", "shared/cluster.py",
      "TIME_LIMITED if e.priority is None else REPRIORITISABLE", "TIME_LIMITED"),
    M("a-release-waits-for-a-timed-cycle", "a held job is never placed", "services/scheduler/service.py",
      'RELEVANT = ("job.queued", "job.released",', 'RELEVANT = ("job.queued",'),
    M("an-admins-hold-released-by-its-owner", "only a waiting job is held", "services/scheduler/api.py",
      'if verb == "release" and job.held_by_admin and p.role != "admin":',
      'if verb == "release" and job.held_by_admin and p.role == "nobody":'),
    M("the-fold-forgets-an-admins-hold", "only a waiting job is held", "shared/cluster.py",
      'job.state, job.reason, job.held_by_admin = "held", e.reason, e.admin',
      'job.state, job.reason, job.held_by_admin = "held", e.reason, False'),
    M("a-reader-may-hold", "only a waiting job is held", "services/scheduler/api.py",
      'if need != "read" and access != "cancel":', 'if need == "cancel" and access != "cancel":'),
    # --- health ----------------------------------------------------------------------------------------------------
    M("a-lost-node-gives-one-retry-too-many", "a lost node's jobs requeue while retries last", HEALTH,
      "requeue = j.retries < j.max_retries", "requeue = j.retries <= j.max_retries"),
    M("a-lost-node-forgets-a-job-being-stopped", "a lost node's jobs requeue while retries last", HEALTH,
      "        if j.state in ACTIVE and node_id in j.nodes:\n            unstarted",
      "        if j.state in STOPPABLE and node_id in j.nodes:\n            unstarted"),
    M("a-job-that-never-ran-fails-with-its-node", "a job that never ran costs no retry", HEALTH,
      "            if unstarted and j.lost_before_start < free_unstarted:\n", "            if False:\n"),
    M("a-poison-job-goes-round-every-node-free", "a job that never ran goes back free only so often", HEALTH,
      "if unstarted and j.lost_before_start < free_unstarted:", "if unstarted:"),
    M("a-poison-job-gets-one-free-requeue-too-many", "a job that never ran goes back free only so often", HEALTH,
      "if unstarted and j.lost_before_start < free_unstarted:",
      "if unstarted and j.lost_before_start <= free_unstarted:"),
    M("the-fold-forgets-requeues-before-start", "a job that never ran goes back free only so often",
      "shared/cluster.py", "                job.lost_before_start += 1\n", "                pass\n"),
    M("a-job-that-never-ran-spends-a-retry", "a job that never ran costs no retry", "services/health/decisions.py",
      "reason=lost.reason, interrupted=lost.interrupted)", "reason=lost.reason)"),
    M("an-application-xid-marks-the-gpu", "only known faults mark a GPU", HEALTH,
      "    return FAULT_XIDS.get(xid)\n", "    return FAULT_XIDS.get(xid) or APPLICATION_XIDS.get(xid)\n"),
    M("recovery-action-none-marks-the-gpu", "only known faults mark a GPU", HEALTH,
      "return None if recovery_action == RECOVERY_NONE else", "return None if recovery_action is None else"),
    M("ecc-marks-at-every-sample", "a fault is marked once", HEALTH,
      "ecc_uncorrected > prev.ecc_uncorrected)", "ecc_uncorrected >= prev.ecc_uncorrected)"),
    M("heat-marks-every-hot-sample", "a fault is marked once", HEALTH,
      "    if streak == policy.hot_samples:", "    if streak >= policy.hot_samples:"),
    M("a-node-lost-at-half-its-timeout", "a node is lost after its timeout", HEALTH,
      "if now - t > timeout_s)", "if now - t > timeout_s / 2)"),
    M("a-placed-job-is-timed", "time limits", HEALTH,
      "if j.state == \"running\" and j.time_limit_s and", "if j.state in ACTIVE and j.time_limit_s and"),
    M("an-overdue-job-timed-out-again", "time limits", HEALTH,
      "Overdue(j.job_id, now - j.started_at - j.time_limit_s, j.timed_out)",
      "Overdue(j.job_id, now - j.started_at - j.time_limit_s, False)"),
    M("a-drain-spares-placed-jobs", "drains wait for what stops", HEALTH,
      "preempt=tuple(j.job_id for j in on_node if j.state in STOPPABLE)",
      "preempt=tuple(j.job_id for j in on_node if j.state == \"running\")"),
    M("a-drain-done-while-a-job-stops", "drains wait for what stops", HEALTH,
      "        drained=not on_node,", "        drained=not any(j.state in STOPPABLE for j in on_node),"),
    M("auto-resume-lifts-an-operators-hold", "auto-resume leaves an operator's hold", HEALTH,
      "if after_s is None or node.lost or node.draining or node.manual_hold:",
      "if after_s is None or node.lost or node.draining:"),
    M("auto-resume-lifts-a-drain", "auto-resume leaves an operator's hold", HEALTH,
      "if after_s is None or node.lost or node.draining or node.manual_hold:",
      "if after_s is None or node.lost or node.manual_hold:"),
)


# --- running ----------------------------------------------------------------------------------------------------

@dataclass
class Result:
    name: str
    rule: str
    file: str
    origin: str
    status: str  # killed | survived | stale
    seconds: float
    killed_by: list[str] = field(default_factory=list)  # the failing tests (the first, or all with --count)
    detail: str = ""


def interpreter() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def copy_repo(into: Path) -> Path:
    root = into / "repo"
    shutil.copytree(REPO, root, ignore=IGNORE, symlinks=True)
    into.chmod(0o755)  # a temporary directory is its owner's only: tasks run as nobody reach the copy's srun too
    return root


def pytest(root: Path, tests: tuple[str, ...], to_the_end: bool, timeout: float,
           deselect: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    cmd = [interpreter(), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--hypothesis-seed=0", "-rfE",
           *(() if to_the_end else ("-x",)), *(f"--deselect={t}" for t in deselect), *tests]
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


FAILED = re.compile(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", re.M)


def run_mutant(m: Mutant, to_the_end: bool = False, timeout: float = 600, deselect: tuple[str, ...] = ()) -> Result:
    t0 = time.perf_counter()
    result = Result(m.name, m.rule, m.file, m.origin, "stale", 0.0)
    with tempfile.TemporaryDirectory(prefix="gpuorch-mutant-") as tmp:
        root = copy_repo(Path(tmp))
        path = root / m.file
        text = path.read_text()
        found = text.count(m.old)
        mutated = text.replace(m.old, m.new)
        if found != 1:
            result.detail = f"the snippet is found {found} times in {m.file}: the code moved, update the mutant"
        else:
            try:
                if m.file.endswith(".py"):  # a shell script (the srun shim) is mutated as text
                    compile(mutated, m.file, "exec")
            except SyntaxError as e:
                result.detail = f"the mutant does not compile: {e}"
            else:
                path.write_text(mutated)
                try:
                    proc = pytest(root, RULES[m.rule].tests, to_the_end, timeout, deselect)
                except subprocess.TimeoutExpired:
                    result.status, result.detail = "killed", f"the tests ran past {timeout:g} s"
                else:
                    if proc.returncode == 0:
                        result.status = "survived"
                    elif proc.returncode in (1, 2, 3):  # failures, an error while collecting, an internal error
                        result.status = "killed"
                        result.killed_by = list(dict.fromkeys(FAILED.findall(proc.stdout)))
                        if not result.killed_by:
                            result.detail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
                    else:  # 4: a test named is gone; 5: nothing collected
                        result.detail = f"pytest exit {proc.returncode}: the rule's tests are gone or renamed"
                finally:
                    kill_strays(root)
    result.seconds = time.perf_counter() - t0
    return result


def kill_strays(root: Path) -> None:
    """Kill what the mutated code left running (a task keeper in a session of its own that a mutant keeps alive):
    every process started from the mutant's copy of the repository."""
    mark = str(root).encode()
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            with contextlib.suppress(OSError):
                if mark in (d / "cmdline").read_bytes():
                    os.kill(int(d.name), signal.SIGKILL)


def baseline(mutants: list[Mutant], timeout: float) -> tuple[str | None, tuple[str, ...]]:
    """Run every test named on the unmutated code: (why the check cannot go on, or None; the tests that fail).

    A test that fails unmutated (work in progress elsewhere) can kill nothing: it is left out of every mutant's
    run and reported. The copy must import its own modules, not the working tree's.
    """
    tests = tuple(dict.fromkeys(t for m in mutants for t in RULES[m.rule].tests))
    with tempfile.TemporaryDirectory(prefix="gpuorch-mutant-") as tmp:
        root = copy_repo(Path(tmp))
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
        where = subprocess.run([interpreter(), "-c", "import services.scheduler.core as c, shared.fairshare as f; "
                                "print(c.__file__); print(f.__file__)"], cwd=root, env=env, capture_output=True,
                               text=True).stdout.split()
        if len(where) != 2 or not all(Path(w).is_relative_to(root) for w in where):
            return f"the copy imports the code from elsewhere: {where}", ()
        proc = pytest(root, tests, True, timeout)
        failing = tuple(dict.fromkeys(FAILED.findall(proc.stdout)))
        if proc.returncode == 0 or (proc.returncode == 1 and failing):
            return None, failing
        return f"the unmutated tests do not run (exit {proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}", ()


def table(results: list[Result], seconds: float) -> str:
    w = max(len(r.name) for r in results)
    rw = max(len(r.rule) for r in results)
    lines = [f"{'mutant':<{w}}  {'rule':<{rw}}  {'file':<32}  {'result':<8}  {'time':>6}  killed by"]
    for r in results:
        by = ", ".join(t.split("::")[-1] for t in r.killed_by[:3]) + (f" (+{len(r.killed_by) - 3})"
                                                                       if len(r.killed_by) > 3 else "")
        lines.append(f"{r.name:<{w}}  {r.rule:<{rw}}  {r.file:<32}  {r.status:<8}  {r.seconds:5.1f}s  "
                     f"{by or r.detail}")
    killed = sum(r.status == "killed" for r in results)
    lines.append("")
    lines.append(f"killed {killed} / {len(results)} in {seconds:.0f} s")
    for status in ("survived", "stale"):
        names = [r.name for r in results if r.status == status]
        if names:
            lines.append(f"{status}: {', '.join(names)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.mutants", description=__doc__.split("\n")[0])
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="a mutant's name (repeatable); a rule's name, or an origin (issue, once, rule): all of its mutants")
    ap.add_argument("--json", nargs="?", const="-", metavar="PATH", help="write the results as JSON (- : stdout)")
    ap.add_argument("--count", action="store_true", help="run each mutant's tests to the end and list every failure")
    ap.add_argument("--jobs", type=int, default=MAX_JOBS, help=f"mutants at a time (at most {MAX_JOBS})")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mutant's tests")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = ap.parse_args(argv)

    mutants = [m for m in MUTANTS if not args.only or {m.name, m.rule, m.origin} & set(args.only)]
    unknown = set(args.only) - {m.name for m in MUTANTS} - set(RULES) - {m.origin for m in MUTANTS}
    if unknown:
        ap.error(f"no mutant or rule named {', '.join(sorted(unknown))}")
    if args.list:
        for m in mutants:
            print(f"{m.name:<44} {m.origin:<6} {m.rule:<30} {m.file}")
        return 0
    quiet = args.json == "-"
    t0 = time.perf_counter()
    why, broken = baseline(mutants, args.timeout)
    if why is not None:
        print(f"baseline: {why}", file=sys.stderr)
        return 2
    for t in broken:
        print(f"baseline: fails without a mutant, left out: {t}", file=sys.stderr)
    jobs = max(1, min(args.jobs, MAX_JOBS))
    results: list[Result] = []
    with ThreadPoolExecutor(jobs) as pool:
        for r in pool.map(lambda m: run_mutant(m, args.count, args.timeout, broken), mutants):
            results.append(r)
            if not quiet:
                print(f"{r.status:<8} {r.seconds:5.1f}s  {r.name}", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    if not quiet:
        print(table(results, seconds))
        if broken:
            print(f"left out, failing without a mutant: {', '.join(broken)}")
    if args.json:
        doc = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, Python "
                       f"{platform.python_version()}",
            "seconds": round(seconds, 1),
            "jobs": jobs,
            "to_the_end": args.count,
            "killed": sum(r.status == "killed" for r in results),
            "total": len(results),
            "survived": [r.name for r in results if r.status == "survived"],
            "stale": [r.name for r in results if r.status == "stale"],
            "baseline_failures": list(broken),
            "per_rule": {rule: sum(r.rule == rule for r in results) for rule in dict.fromkeys(r.rule for r in results)},
            "mutants": [{**asdict(r), "seconds": round(r.seconds, 1)} for r in results],
        }
        text = json.dumps(doc, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0 if all(r.status == "killed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
