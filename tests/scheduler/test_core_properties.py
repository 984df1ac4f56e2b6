"""Invariants of a scheduling cycle, over generated clusters and workloads (hypothesis).

Each scenario: a small heterogeneous cluster (NVLink layouts, racks, zones, MIG,
cordoned nodes, sick GPUs), a first cycle whose placements become running jobs,
then a second cycle with more pending work, whose plan is checked.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.core import Plan, Policy, ReclaimRequest, run_cycle
from services.scheduler.snapshot import Snapshot
from services.scheduler.shapes import parse_cc
from shared.cluster import ClusterProjection, JobRecord
from shared.model import MILLI, PRIORITY_RANK, GpuConstraints, JobSpec, TaskResources
from tests.builders import ClusterBuilder, cluster, node

EXAMPLES = int(os.environ.get("GPUORCH_PROPERTY_EXAMPLES", "80"))  # raise it for a longer hunt
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
POLICIES = ["fgd", "bestfit", "binpack", "spread", "random"]


@st.composite
def clusters(draw) -> ClusterBuilder:
    nodes = []
    for i in range(draw(st.integers(1, 6))):
        model = draw(st.sampled_from(["H100", "A100"]))
        count = draw(st.sampled_from([1, 2, 4, 8, 8]))
        b = node(f"n{i}").gpus(count, model=model, memory_mib=81920 if model == "H100" else 40960,
                               cc="9.0" if model == "H100" else "8.0")
        layout = draw(st.sampled_from(["one", "two", "pcie"]))
        if layout == "pcie":
            b.pcie()
        elif layout == "two" and count >= 2:
            b.nvlink_domains(2)
        b.rack(draw(st.sampled_from(["r1", "r2", "r3"]))).zone(draw(st.sampled_from(["z1", "z2"])))
        b.cpu(draw(st.sampled_from([8_000, 64_000, 128_000]))).mem(draw(st.sampled_from([32_768, 262_144, 262_144])))
        b.labels(pool=draw(st.sampled_from(["train", "serve"])))
        if model == "A100" and draw(st.booleans()):
            b.mig(0, "1g.10gb", "1g.10gb", "2g.20gb")
        nodes.append(b)
    c = cluster(*nodes)
    for n in list(c.proj.nodes):
        state = draw(st.sampled_from(["ready"] * 9 + ["cordoned", "draining", "lost"]))
        {"cordoned": c.cordon, "draining": c.drain, "lost": c.lose}.get(state, lambda _: c)(n)
        if draw(st.integers(0, 7)) == 0:
            c.sick_gpu(n, 0)
    return c


@st.composite
def specs(draw) -> JobSpec:
    mig = draw(st.sampled_from([None] * 11 + ["1g.10gb"]))
    gpus = 1 if mig else draw(st.sampled_from([0, 0.25, 0.5, 0.75, 1, 1, 2, 2, 4, 8]))
    return JobSpec(
        name="j",
        queue=draw(st.sampled_from(["a", "b"])),
        priority=draw(st.sampled_from(list(PRIORITY_RANK))),
        tasks=draw(st.sampled_from([1, 1, 1, 2, 3, 4])),
        resources=TaskResources(
            gpus=gpus, cpu_milli=draw(st.sampled_from([0, 1_000, 4_000])), memory_mib=draw(st.sampled_from([0, 4_096, 16_384]))
        ),
        gpu=GpuConstraints(
            models=draw(st.sampled_from([()] * 4 + [("H100",), ("A100",)])),
            min_memory_mib=draw(st.sampled_from([0] * 5 + [50_000])),
            min_compute_capability=draw(st.sampled_from([None] * 5 + ["9.0"])),
            mig=mig,
        ),
        topology=draw(st.sampled_from(["any", "any", "nvlink", "node", "rack", "zone"])),
        node_selector=draw(st.sampled_from([{}] * 5 + [{"pool": "train"}])),
        time_limit_s=draw(st.sampled_from([None, 100, 1_000, 10_000])),
    )


@dataclass
class Scenario:
    builder: ClusterBuilder
    snapshot: Snapshot
    policy: Policy
    now: float
    plan: Plan


@st.composite
def scenarios(draw) -> Scenario:
    c = draw(clusters())
    for i, spec in enumerate(draw(st.lists(specs(), max_size=8))):
        c.pending(spec, f"w1-{i}", at=i)
    first = run_cycle(c.snapshot(0.0), Policy(seed=1), 0.0)
    for job_id, placement in first.placements.items():
        spec = c.proj.jobs[job_id].spec
        c.hold(spec, placement.tasks, job_id, started_at=-draw(st.sampled_from([0, 50, 500])))
    for i, spec in enumerate(draw(st.lists(specs(), min_size=1, max_size=8))):
        c.pending(spec, f"w2-{i}", at=10 + i)
    policy = Policy(
        name=draw(st.sampled_from(POLICIES)),
        seed=draw(st.integers(0, 3)),
        preemptible_below=draw(st.integers(0, 4)),
        cross_queue_preemption=draw(st.booleans()),
    )
    now = float(draw(st.sampled_from([0, 60, 600])))
    snap = c.snapshot(now)
    return Scenario(c, snap, policy, now, run_cycle(snap, policy, now))


def all_tasks(plan: Plan):
    for job_id, p in plan.placements.items():
        for t in p.tasks:
            yield job_id, t


@given(scenarios())
@PROPERTY
def test_no_gpu_cpu_or_memory_is_ever_over_committed(s: Scenario) -> None:
    proj = s.builder.proj
    gpu = {(n, u): m for n, ns in proj.nodes.items() for u, m in ns.gpu_alloc.items()}
    cpu = {n: ns.cpu_alloc for n, ns in proj.nodes.items()}
    mem = {n: ns.mem_alloc for n, ns in proj.nodes.items()}
    for _, t in all_tasks(s.plan):
        ns = proj.nodes[t.node_id]
        assert ns.schedulable, f"placed on {t.node_id}, which is not schedulable"
        for share in t.gpus:
            gpu[(t.node_id, share.uuid)] = gpu.get((t.node_id, share.uuid), 0) + share.milli
            assert share.uuid not in ns.unhealthy
        cpu[t.node_id] += t.cpu_milli
        mem[t.node_id] += t.memory_mib
    for (n, uuid), milli in gpu.items():
        assert milli <= MILLI, f"{uuid} on {n} holds {milli} milli"
    for n, ns in proj.nodes.items():
        assert cpu[n] <= ns.info.cpu_milli and mem[n] <= ns.info.memory_mib
        for g in ns.info.gpus:
            if g.mig_enabled:
                assert not gpu.get((n, g.uuid)), "a GPU in MIG mode was handed out whole"


@given(scenarios())
@PROPERTY
def test_gangs_are_all_or_nothing_and_every_pending_job_is_accounted_for(s: Scenario) -> None:
    for job in s.snapshot.pending:
        placed, waiting = job.job_id in s.plan.placements, job.job_id in s.plan.unschedulable
        assert placed != waiting, f"{job.job_id}: placed={placed} waiting={waiting}"
        if waiting:
            assert s.plan.unschedulable[job.job_id]
    for job_id, p in s.plan.placements.items():
        spec = s.builder.proj.jobs[job_id].spec
        assert [t.task for t in p.tasks] == list(range(spec.tasks))
        for t in p.tasks:
            uuids = [g.uuid for g in t.gpus]
            assert len(set(uuids)) == len(uuids)
            assert (t.cpu_milli, t.memory_mib) == (spec.resources.cpu_milli, spec.resources.memory_mib)
            if spec.gpu.mig:
                assert [(g.mig_profile, g.milli) for g in t.gpus] == [(spec.gpu.mig, MILLI)]
            elif spec.resources.gpu_milli >= MILLI:
                assert len(t.gpus) == spec.resources.gpu_milli // MILLI and all(g.milli == MILLI for g in t.gpus)
            elif spec.resources.gpu_milli:
                assert [g.milli for g in t.gpus] == [spec.resources.gpu_milli]
            else:
                assert t.gpus == ()


@given(scenarios())
@PROPERTY
def test_constraints_and_topology_are_honoured(s: Scenario) -> None:
    proj = s.builder.proj
    for job_id, p in s.plan.placements.items():
        spec = proj.jobs[job_id].spec
        infos = [proj.nodes[t.node_id].info for t in p.tasks]
        for t, info in zip(p.tasks, infos):
            assert all(info.labels.get(k) == v for k, v in spec.node_selector.items())
            by_uuid = {g.uuid: g for g in info.gpus} | {sl.uuid: g for g in info.gpus for sl in g.mig_slices}
            gpus = [by_uuid[share.uuid] for share in t.gpus]
            for g in gpus:
                assert not spec.gpu.models or g.model in spec.gpu.models
                assert g.memory_mib >= spec.gpu.min_memory_mib
                want = parse_cc(spec.gpu.min_compute_capability)
                assert want is None or parse_cc(g.compute_capability) >= want
            if spec.topology == "nvlink" and len(gpus) > 1:
                assert len({g.nvlink_domain for g in gpus}) == 1 and gpus[0].nvlink_domain is not None
        level = spec.topology
        if level == "node":
            assert len({i.node_id for i in infos}) == 1
        elif level == "rack":
            assert len({(i.zone, i.rack) for i in infos}) == 1
        elif level == "zone":
            assert len({i.zone for i in infos}) == 1


@given(scenarios())
@PROPERTY
def test_the_same_snapshot_and_seed_give_the_same_plan(s: Scenario) -> None:
    assert run_cycle(s.snapshot, s.policy, s.now) == s.plan
    assert run_cycle(copy.deepcopy(s.snapshot), s.policy, s.now) == s.plan


@given(scenarios())
@PROPERTY
def test_preemption_never_evicts_equal_or_higher_priority(s: Scenario) -> None:
    running = {r.job_id: r for r in s.snapshot.running}
    pending = {j.job_id: j for j in s.snapshot.pending}
    for p in s.plan.preemptions:
        victim, boss = running[p.job_id], pending[p.for_job]
        assert victim.priority_rank < boss.priority_rank
        assert victim.priority_rank < s.policy.preemptible_below
        assert s.policy.cross_queue_preemption or victim.queue == boss.queue
        assert p.for_job not in s.plan.placements
        assert not victim.preempting
    assert len({p.job_id for p in s.plan.preemptions}) == len(s.plan.preemptions)


@given(scenarios())
@PROPERTY
def test_backfill_never_delays_the_reserved_job(s: Scenario) -> None:
    res = s.plan.reservation
    if res is None or math.isinf(res.start):
        return
    # The cluster at the reservation's start: everything expected to end by then has ended.
    later = ClusterProjection()
    for n, ns in s.builder.proj.nodes.items():
        later.nodes[n] = copy.deepcopy(ns)
        later.nodes[n].gpu_alloc, later.nodes[n].cpu_alloc, later.nodes[n].mem_alloc = {}, 0, 0
    b = ClusterBuilder()
    b.proj = later
    for r in s.snapshot.running:
        if r.expected_end(s.now) > res.start:
            b.hold(r.spec, r.placements, r.job_id, started_at=r.started_at or 0.0)
    for job_id, p in s.plan.placements.items():
        spec = s.builder.proj.jobs[job_id].spec
        if spec.time_limit_s is None or s.now + spec.time_limit_s > res.start:
            b.hold(spec, p.tasks, job_id, started_at=s.now)
    reserved = s.builder.proj.jobs[res.job_id]
    later.jobs[res.job_id] = JobRecord(res.job_id, reserved.spec, state="queued")
    plan = run_cycle(b.snapshot(res.start), Policy(backfill=False, preempt=False), res.start)
    assert res.job_id in plan.placements, plan.unschedulable.get(res.job_id)


@given(clusters(), st.lists(specs(), min_size=1, max_size=6), st.integers(0, 16))
@PROPERTY
def test_reclaim_takes_only_other_queues_gangs(c: ClusterBuilder, jobs: list[JobSpec], want: int) -> None:
    for i, spec in enumerate(jobs):
        c.pending(spec, f"j{i}", at=i)
    for job_id, p in run_cycle(c.snapshot(), Policy(seed=2)).placements.items():
        c.hold(c.proj.jobs[job_id].spec, p.tasks, job_id)
    plan = run_cycle(c.snapshot(100.0), Policy(preempt=False), 100.0, reclaims=[ReclaimRequest("a", want)])
    queues = {j.job_id: j.spec.queue for j in c.proj.jobs.values()}
    assert all(queues[p.job_id] != "a" and p.for_queue == "a" for p in plan.preemptions)


@st.composite
def single_pod_workloads(draw):
    nodes = [
        node(f"n{i}").gpus(draw(st.sampled_from([1, 2, 4, 8])), model=draw(st.sampled_from(["G2", "T4"]))).pcie()
        .cpu(draw(st.sampled_from([8_000, 32_000, 96_000]))).mem(draw(st.sampled_from([65_536, 393_216])))
        for i in range(draw(st.integers(1, 6)))
    ]
    pods = []
    for _ in range(draw(st.integers(1, 25))):
        count = draw(st.sampled_from([0, 1, 1, 1, 2, 4, 8]))
        milli = draw(st.sampled_from([250, 500, 810, 1000])) if count == 1 else 1000
        pods.append((count, milli, draw(st.sampled_from([1_000, 4_000, 16_000])), draw(st.sampled_from([0, 8_192])),
                     draw(st.sampled_from([(), ("G2",), ("T4",)]))))
    return nodes, pods


@given(single_pod_workloads(), st.sampled_from(POLICIES[:-1] + ["dotprod", "gpupacking", "gpuclustering"]), st.integers(0, 5))
@PROPERTY
def test_single_pods_are_placed_exactly_as_choose_node_places_them(workload, policy: str, seed: int) -> None:
    from services.scheduler.equivalence import node_priorities
    from services.scheduler.fragmentation import TypicalShape
    from services.scheduler.placement import NodeFree, NodeScorer, PodShape, choose_node, take

    builders, pods = workload
    typical = (TypicalShape(4_000, 1000, 1, (), 0.5), TypicalShape(1_000, 500, 1, ("G2",), 0.3), TypicalShape(1_000, 0, 0, (), 0.2))
    c = cluster(*builders)
    for i, (count, milli, cpu, mem, models) in enumerate(pods):
        gpus = count if milli == 1000 else milli / 1000
        c.pending(JobSpec(name="p", resources=TaskResources(gpus=gpus, cpu_milli=cpu, memory_mib=mem),
                          gpu=GpuConstraints(models=models)), f"p{i:02d}", at=i)
    plan = run_cycle(c.snapshot(), Policy(name=policy, seed=seed, typical=typical, backfill=False, preempt=False))

    infos = [b.build() for b in builders]
    prio = node_priorities([i.node_id for i in infos], seed)
    state = [NodeFree(i.node_id, prio[i.node_id], i.gpus[0].model, i.cpu_milli, i.memory_mib, [1000] * len(i.gpus)) for i in infos]
    scorer = NodeScorer(policy, typical, seed)
    expected = {}
    for i, (count, milli, cpu, mem, models) in enumerate(pods):
        pod = PodShape(cpu, mem, count, milli if count else 0, models)
        got = choose_node(state, pod, scorer)
        if got is not None:
            take(state[got[0]], pod, got[1])
            expected[f"p{i:02d}"] = (state[got[0]].name, tuple(f"GPU-{state[got[0]].name}-{g}" for g in got[1]))
    placed = {j: (p.tasks[0].node_id, tuple(g.uuid for g in p.tasks[0].gpus)) for j, p in plan.placements.items()}
    assert placed == expected
