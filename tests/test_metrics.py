"""/metrics after a short workload: every series of docs/observability.md, with its labels, under Prometheus'
conventions (promtool agrees where it is installed), and the GPUs under dcgm-exporter's names."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shared import events as ev
from shared.eventlog import EventLog
from shared.events import Envelope
from tests.builders import job
from tests.support import in_process_stack, nodes_up, until

SLEEPER = ("sleep", "60")
DCGM_LABELS = {"gpu", "UUID", "device", "modelName", "Hostname", "pci_bus_id", "job", "queue"}
# family (as the parser names it: a counter without _total) -> the labels each of its series carries
SERIES: dict[str, set[str]] = {
    "gpuorch_jobs": {"state", "queue"},
    "gpuorch_jobs_pending": {"queue", "priority"},
    "gpuorch_jobs_finished": {"state", "queue"},
    "gpuorch_queue_pending_gpus": {"queue", "leaf"},
    "gpuorch_queue_allocated_gpus": {"queue", "leaf"},
    "gpuorch_queue_entitled_gpus": {"queue", "leaf"},
    "gpuorch_queue_guaranteed_gpus": {"queue", "leaf"},
    "gpuorch_gpus": {"state", "model"},
    "gpuorch_node_state": {"node", "state"},
    "gpuorch_cluster_fragmentation_gpus": set(),
    "gpuorch_cluster_free_gpus": set(),
    "gpuorch_cluster_free_gpus_usable_by_8gpu_task_ratio": set(),
    "gpuorch_job_submit_to_start_seconds": {"queue"},
    "gpuorch_cycle_seconds": {"service"},
    "gpuorch_scheduler_cycle_placements": set(),
    "gpuorch_job_preemptions": {"queue", "reason"},
    "gpuorch_job_requeues": {"queue", "reason"},
    "gpuorch_projection_lag_events": {"service"},
    **{name: DCGM_LABELS for name in (
        "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL")},
}
BASE_UNITS = ("_seconds", "_gpus", "_events", "_ratio", "_total", "_bucket", "_sum", "_count", "_created")
COUNTS = {"gpuorch_jobs", "gpuorch_jobs_pending", "gpuorch_node_state", "gpuorch_ready", "gpuorch_invalid_transitions",
          "gpuorch_projection_seq", "gpuorch_gateway_upstream_up"}  # plain counts and states: no unit to name
SERVICES = {"inventory", "scheduler", "quota", "autoscaler", "health"}


async def scrape(client: httpx.AsyncClient) -> str:
    r = await client.get("/metrics")
    assert r.status_code == 200, r.text
    return r.text


def samples(text: str, family: str) -> list:
    return [s for f in text_string_to_metric_families(text) if f.name == family for s in f.samples]


def value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` (a sample name) whose labels include ``labels``."""
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


async def workload(client: httpx.AsyncClient, agents) -> tuple[list[str], list[str]]:
    """A queue with a guarantee, a job that succeeds, one that runs, one too big to place now; an XID drains the
    runner's node, so it moves; then its new node stops beating and is lost, so it is requeued. Returns the
    expositions seen while it ran (with the job on its first GPU) and at the end (the second node lost)."""
    procs = {a.node_id: a for a in agents("a", "b")}
    await nodes_up(client, 2)
    assert (await client.put("/v1/queues/research", json={"guaranteed": {"gpus": 2}, "weight": 1})).status_code == 200

    async def submit(spec) -> str:
        r = await client.post("/v1/jobs", json=spec.model_dump(mode="json"))
        assert r.status_code == 201, r.text
        return r.json()["id"]

    async def state_of(job_id: str, cond, what: str) -> dict:
        async def check():
            j = (await client.get(f"/v1/jobs/{job_id}")).json()
            return j if cond(j) else None
        return await until(check, 30, what)

    quick = await submit(job("quick").gpus(1).queue("research").build())
    await state_of(quick, lambda j: j["state"] == "succeeded", "the quick job to succeed")
    runner = await submit(job("runner").gpus(1).queue("research").command(*SLEEPER).build()
                          .model_copy(update={"max_retries": 2}))
    running = await state_of(runner, lambda j: j["state"] == "running", "the runner to run")
    await submit(job("huge").gpus(4).tasks(2).command(*SLEEPER).build())
    node, uuid = running["placement"][0]["node"], running["placement"][0]["gpus"][0]

    async def busy_gpu_seen():
        text = await scrape(client)
        return text if value(text, "DCGM_FI_DEV_GPU_TEMP", UUID=uuid, job=runner, queue="research") else None
    during = await until(busy_gpu_seen, 20, "the runner's GPU in the DCGM series, labelled with its job and queue")

    index = next(g["index"] for g in (await client.get(f"/v1/nodes/{node}")).json()["gpus"] if g["uuid"] == uuid)
    assert (await client.post(f"/v1/nodes/{node}/inject-xid", json={"gpu_index": index, "xid": 79})).status_code == 200
    moved = await state_of(runner, lambda j: j["state"] == "running" and j["placement"][0]["node"] != node,
                           "the runner to run on the other node")
    other = procs[moved["placement"][0]["node"]]
    other.signal(signal.SIGSTOP)
    try:
        async def lost_and_requeued():
            text = await scrape(client)
            done = value(text, "gpuorch_node_state", node=other.node_id, state="lost") == 1 and \
                value(text, "gpuorch_job_requeues_total", reason="node_lost") >= 1 and \
                value(text, "DCGM_FI_DEV_XID_ERRORS", UUID=uuid) == 79
            return text if done else None
        end = await until(lost_and_requeued, 30, "the other node lost, the runner requeued, the XID shown")
    finally:
        other.signal(signal.SIGCONT)
    return during, end


def names_and_labels(text: str) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = {}
    for f in text_string_to_metric_families(text):
        out.setdefault(f.name, []).extend({k: v for k, v in s.labels.items() if k not in ("le", "quantile")}
                                          for s in f.samples)
    return out


def missing_series(text: str, wanted: dict[str, set[str]]) -> list[str]:
    """What ``wanted`` names that the exposition lacks: a family, any series of it, or a label on one."""
    found = names_and_labels(text)
    problems = []
    for name, labels in wanted.items():
        series = found.get(name)
        if not series:
            problems.append(f"{name}: no series")
        problems += [f"{name}: series {s} lacks labels {sorted(labels - set(s))}" for s in series or ()
                     if not labels <= set(s)]
    return problems


def convention_problems(text: str) -> list[str]:
    """gpuorch's families: prefixed, in base units, counters end in _total, and no label names a job."""
    problems = []
    for f in text_string_to_metric_families(text):
        if f.name.startswith("DCGM_"):
            continue
        if not f.name.startswith("gpuorch_"):
            problems.append(f"{f.name}: not prefixed gpuorch_")
        for s in f.samples:
            if f.type == "counter" and not s.name.endswith(("_total", "_created")):
                problems.append(f"{s.name}: a counter's samples end in _total")
            if re.search(r"_(ms|milliseconds|minutes|hours|mib|mb|bytes_k|percent|pct)(_|$)", s.name):
                problems.append(f"{s.name}: not in base units")
            if not (s.name.endswith(BASE_UNITS) or f.name in COUNTS or f.type in ("counter", "histogram")):
                problems.append(f"{s.name}: no unit suffix (seconds, gpus, events, ratio) and not a plain count")
            for k, v in s.labels.items():
                if k in ("job", "job_id", "id") or re.fullmatch(r"j-[0-9a-z-]{6,}", v):
                    problems.append(f"{s.name}: a per-job label {k}={v}")
    return problems


def promtool_problems(text: str) -> list[str] | None:
    """promtool check metrics' findings, less dcgm-exporter's own camelCase label (modelName); None without promtool."""
    if shutil.which("promtool") is None:
        return None
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    if out.returncode not in (0, 3):  # 1: it could not parse the exposition at all
        return [f"promtool exit {out.returncode}"] + lines
    return [line for line in lines if not (line.startswith("DCGM_FI_DEV_") and "camelCase" in line)]


async def test_after_a_workload_every_documented_series_is_exported_with_its_labels(eventlog: EventLog, agents):
    async with in_process_stack(eventlog, heartbeat_timeout_s=2.0) as (client, _):
        during, end = await workload(client, agents)

    # the busy GPU carried its job and queue, like dcgm-exporter's pod labels; idle GPUs carry them empty
    busy = [s for s in samples(during, "DCGM_FI_DEV_GPU_UTIL") if s.labels["job"]]
    assert len(busy) == 1 and busy[0].labels["queue"] == "research" and busy[0].labels["device"].startswith("nvidia")
    assert any(s.labels["job"] == "" for s in samples(during, "DCGM_FI_DEV_GPU_UTIL"))
    assert value(during, "DCGM_FI_DEV_FB_FREE") > 0 and value(during, "DCGM_FI_DEV_POWER_USAGE") > 0

    assert missing_series(end, SERIES) == []
    assert value(end, "gpuorch_gpus", state="unhealthy") >= 1 and value(end, "gpuorch_gpus", state="cordoned") >= 1
    assert value(end, "gpuorch_gpus", state="lost") == 4
    assert value(end, "gpuorch_job_preemptions_total", queue="research", reason="drain") >= 1
    assert value(end, "gpuorch_job_requeues_total", queue="research", reason="node_lost") >= 1
    assert value(end, "gpuorch_jobs_finished_total", state="succeeded", queue="research") >= 1
    assert value(end, "gpuorch_job_submit_to_start_seconds_count", queue="research") >= 2
    assert value(end, "gpuorch_scheduler_cycle_placements_sum") >= 2
    assert value(end, "gpuorch_jobs_pending", queue="default", priority="normal") == 1
    assert value(end, "gpuorch_queue_pending_gpus", queue="default") == 8
    assert value(end, "gpuorch_queue_guaranteed_gpus", queue="research", leaf="true") == 2
    assert {s.labels["service"] for s in samples(end, "gpuorch_projection_lag_events")} == SERVICES
    assert all(s.value >= 0 for s in samples(end, "gpuorch_projection_lag_events"))


async def test_the_exposition_parses_and_follows_prometheus_conventions(eventlog: EventLog, agents):
    async with in_process_stack(eventlog) as (client, _):
        agents("a")
        await nodes_up(client, 1)

        async def sampled():
            text = await scrape(client)
            return text if samples(text, "DCGM_FI_DEV_GPU_TEMP") else None
        text = await until(sampled, 20, "the node's telemetry")
    assert list(text_string_to_metric_families(text))
    assert convention_problems(text) == []
    found = promtool_problems(text)
    if found is not None:  # Debian's `prometheus` package ships promtool
        assert found == []


def test_the_checks_catch_a_missing_series_a_missing_label_and_a_broken_convention():
    text = "\n".join([
        "# HELP gpuorch_jobs Jobs", "# TYPE gpuorch_jobs gauge", 'gpuorch_jobs{state="running"} 1',
        "# HELP gpuorch_wait_ms Wait", "# TYPE gpuorch_wait_ms gauge", "gpuorch_wait_ms 3",
        "# HELP gpuorch_job_gpus GPUs", "# TYPE gpuorch_job_gpus gauge", 'gpuorch_job_gpus{job="j-01abcdef"} 1',
        "# HELP queue_gpus GPUs", "# TYPE queue_gpus gauge", "queue_gpus 1", ""])
    assert missing_series(text, {"gpuorch_jobs": {"state", "queue"}, "gpuorch_gpus": {"model"}}) == [
        "gpuorch_jobs: series {'state': 'running'} lacks labels ['queue']", "gpuorch_gpus: no series"]
    problems = convention_problems(text)
    assert any("gpuorch_wait_ms: not in base units" in p for p in problems)
    assert any("per-job label job=j-01abcdef" in p for p in problems)
    assert any("queue_gpus: not prefixed" in p for p in problems)


def test_free_gpus_count_for_an_8_gpu_task_only_in_groups_of_eight_on_one_node():
    from services.scheduler.metrics import cluster_fragmentation
    from tests.builders import NodeBuilder, cluster

    c = cluster(NodeBuilder("full"), NodeBuilder("one-taken"), NodeBuilder("cordoned"))
    c.running(job("small").gpus(1).build(), [("one-taken", [0])]).cordon("cordoned")
    frag, free, usable = cluster_fragmentation(c.proj)
    assert (free, usable) == (15, 8)
    # the running 1-GPU shape fits everywhere there is a free GPU: FGD counts nothing as fragment
    assert frag == 0
    c.running(job("eight").gpus(8).build(), [("full", list(range(8)))])
    frag, free, usable = cluster_fragmentation(c.proj)
    assert (free, usable) == (7, 0)
    # half the tasks want 8 GPUs, which the 7 free cannot give (all 7 are fragment to them), half want 1 (none is)
    assert frag == 7 * 0.5


def test_gpu_and_node_states_take_the_first_that_holds():
    from services.inventory.metrics import InventoryCollector
    from tests.builders import NodeBuilder, cluster

    c = cluster(NodeBuilder("a").gpus(4), NodeBuilder("b").gpus(4), NodeBuilder("c").gpus(4))
    c.running(job("x").gpus(1).build(), [("a", [0])]).sick_gpu("a", 1).cordon("b").sick_gpu("b", 0).lose("c")
    families = {f.name: f for f in InventoryCollector(lambda: c.proj).collect()}
    gpus = {s.labels["state"]: s.value for s in families["gpuorch_gpus"].samples}
    assert gpus == {"allocated": 1, "unhealthy": 2, "free": 2, "cordoned": 3, "lost": 4}
    nodes = {s.labels["node"]: s.labels["state"] for s in families["gpuorch_node_state"].samples if s.value == 1}
    assert nodes == {"a": "allocated", "b": "cordoned", "c": "lost"}


def test_merged_expositions_declare_each_family_once_with_every_process_series():
    from shared.metrics import merge_expositions

    a = '# HELP x_total X\n# TYPE x_total counter\nx_total{service="a"} 1.0\n# HELP y Y\n# TYPE y gauge\ny 2.0\n'
    b = '# HELP x_total X\n# TYPE x_total counter\nx_total{service="b"} 3.0\n'
    merged = merge_expositions([a, "", b])
    assert merged.count("# TYPE x_total") == 1
    assert {s.labels["service"]: s.value for f in text_string_to_metric_families(merged) if f.name == "x"
            for s in f.samples} == {"a": 1.0, "b": 3.0}


async def test_an_agent_that_folds_no_log_reports_no_projection_lag(eventlog, tmp_path):
    from services.inventory.agent import Agent
    from shared.profiles import build as build_profile

    agent = Agent(build_profile("t4-4x", "n1"), tmp_path / "agent")
    agent.svc.log = eventlog
    await eventlog.append(Envelope(ev.QueueDefined(path="q", spec={})))
    await agent.svc.metrics.update_lag([agent.svc])
    lag = [s for f in agent.svc.metrics.registry.collect() if f.name == "gpuorch_projection_lag_events" for s in f.samples]
    assert lag == [], "a lag of the whole log would page someone for nothing"
