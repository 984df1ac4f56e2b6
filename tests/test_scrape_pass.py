"""A scrape of /metrics reads the jobs in as few passes as it can, and what it reads is what the slower reads gave.

At 20,000 queued jobs a scrape walked every job six times with the folds held (90-220 ms): the scheduler's gauges
once, a whole cycle snapshot for the fragmentation gauge's target workload, the quota's loads in GPUs and again in
dominant shares, and the records' attribute dicts had lost their shared layout. The oracles: the cycle's own target
workload over a snapshot (``typical_from_snapshot``), and a walk that sums ``job_share`` per queue.
"""

from __future__ import annotations

import pytest

from services.scheduler.core import typical_from_snapshot
from services.scheduler.fragmentation import FragMemo
from services.scheduler.metrics import SchedulerCollector, cluster_fragmentation
from services.scheduler.snapshot import pending_view
from shared.cluster import ACTIVE, PENDING, KEPT_PER_SPEC, JobRecord
from shared.fairshare import GPUS_ONLY, Ratios, job_share
from shared.model import MILLI
from tests.builders import NodeBuilder, cluster, job


def busy_cluster():
    """Queued, submitted, running, preempting and ended jobs of several shapes (a MIG slice among them), one node
    cordoned: every state the gauges and the loads tell apart."""
    c = cluster(NodeBuilder("a").cpu(64_000), NodeBuilder("b").cpu(64_000).gpus(8, model="A100"),
                NodeBuilder("c").mig(0, "3g.40gb", "3g.40gb"), NodeBuilder("d"))
    c.queue("team-a").queue("team-b")
    c.running(job("big").gpus(4).cpu(8_000).queue("team-a").build(), [("a", [0, 1, 2, 3])])
    c.running(job("half").gpus(0.5).cpu(2_000).queue("team-b").build(), [("b", [0])], state="preempting")
    c.running(job("slice").mig("3g.40gb").queue("team-b").build(), [("c", [0])])
    for i in range(6):
        c.pending(job(f"q{i}").gpus([1, 2, 8, 0.25, 1, 1][i]).cpu(1_000 * (i + 1)).tasks(1 + i % 2)
                  .queue("team-a" if i % 2 else "team-b").build())
    c.pending(job("pinned").gpus(1).models("A100").queue("team-a").build())
    c.pending(job("cpu-only").gpus(0).cpu(4_000).queue("team-b").build())
    c.proj.add_job(JobRecord("j-submitted", job("fresh").gpus(8).tasks(3).build(), state="submitted"))
    c.ended(job("done").gpus(8).build(), "j-done").ended(job("gone").gpus(2).build(), "j-gone", "cancelled")
    c.cordon("d")
    return c


def snapshot_fragmentation(c) -> float:
    """FGD's fragmentation in GPUs, against the target workload the cycle itself builds from a snapshot."""
    snap = c.snapshot()
    memo = FragMemo(typical_from_snapshot(snap))
    total = 0.0
    for node in snap.nodes:
        if node.schedulable:
            gpus = [g for g in node.gpus if not g.mig_enabled]
            model = next((g.model for g in gpus if g.healthy), gpus[0].model if gpus else "")
            total += memo.frag(model, node.cpu_free, [g.free_milli for g in gpus])
    return total / MILLI


def test_the_fragmentation_gauge_scores_against_the_cycles_own_target_workload():
    c = busy_cluster()
    expected = snapshot_fragmentation(c)
    assert expected > 0, "the cluster must leave some idle GPU unusable to some shape, or the test shows nothing"
    assert cluster_fragmentation(c.proj)[0] == pytest.approx(expected, abs=1e-9)
    gauges = {f.name: f.samples for f in SchedulerCollector(lambda: c.proj).collect()}
    assert gauges["gpuorch_cluster_fragmentation_gpus"][0].value == pytest.approx(expected, abs=1e-9)
    # a job whose spec changes is counted by its new shape, not by the one kept for its old spec
    queued = next(j for j in c.proj.jobs.values() if j.spec.name == "q0")
    cluster_fragmentation(c.proj)
    queued.spec = job("q0").gpus(8).build()
    assert cluster_fragmentation(c.proj)[0] == pytest.approx(snapshot_fragmentation(c), abs=1e-9)


def test_the_job_gauges_count_every_job_not_ended_in_the_same_pass():
    c = busy_cluster()
    families = {f.name: f.samples for f in SchedulerCollector(lambda: c.proj).collect()}
    by_state = {(s.labels["state"], s.labels["queue"]): s.value for s in families["gpuorch_jobs"] if s.value}
    expected: dict[tuple[str, str], int] = {}
    for j in c.proj.jobs.values():
        if j.state in ACTIVE | PENDING:
            expected[(j.state, j.spec.queue)] = expected.get((j.state, j.spec.queue), 0) + 1
    assert by_state == expected
    pending = sum(s.value for s in families["gpuorch_jobs_pending"])
    assert pending == sum(1 for j in c.proj.jobs.values() if j.state in PENDING) == 9


def walked_loads(proj, ratios: Ratios) -> tuple[dict[str, float], dict[str, float]]:
    alloc: dict[str, float] = {}
    pending: dict[str, float] = {}
    for j in proj.jobs.values():
        table = alloc if j.state in ACTIVE else pending if j.state in PENDING else None
        if table is not None:
            table[j.spec.queue] = table.get(j.spec.queue, 0.0) + job_share(j.spec, ratios)
    return alloc, pending


def test_loads_in_several_ratios_at_once_are_each_what_a_walk_in_that_ratio_sums():
    proj = busy_cluster().proj
    dominant = proj.share_ratios()
    assert dominant != GPUS_ONLY
    in_dominant, in_gpus = proj.queue_loads_in(dominant, GPUS_ONLY)
    for load, ratios in ((in_dominant, dominant), (in_gpus, GPUS_ONLY)):
        alloc, pending = walked_loads(proj, ratios)
        assert load.alloc == pytest.approx(alloc) and load.pending == pytest.approx(pending)
        assert load.waited == pytest.approx(pending), "with no time given, every pending job has waited"
    assert in_dominant.pending != pytest.approx(in_gpus.pending), "the CPU-heavy jobs must weigh more in dominant shares"
    alone = proj.queue_loads(ratios=dominant)
    assert (alone.alloc, alone.pending, alone.smallest) == (in_dominant.alloc, in_dominant.pending, in_dominant.smallest)


def test_every_job_record_keeps_one_attribute_layout_whichever_read_comes_first():
    """A record's cached values are set by whichever read reaches it first (a list, a cycle, a scrape); slots made
    at construction keep every record's attribute dict in one order, so CPython shares one key table among them."""
    proj = busy_cluster().proj
    records = [j for j in proj.jobs.values()]
    ratios = proj.share_ratios()
    readers = [lambda j: j.spec_json(), lambda j: j.share(ratios), pending_view,
               lambda j: cluster_fragmentation(proj)]
    for i, record in enumerate(records):  # each record read first by a different reader
        for reader in readers[i % len(readers):] + readers[:i % len(readers)]:
            reader(record)
    layouts = {tuple(r.__dict__) for r in records}
    assert len(layouts) == 1, layouts
    assert set(KEPT_PER_SPEC) <= set(next(iter(layouts)))
