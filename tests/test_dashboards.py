"""deploy/: the Grafana dashboard and the Prometheus alerts ask only for series the stack exports, and the
provisioning and compose files fit together (compose itself is not run here)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from shared.eventlog import EventLog
from tests.builders import job
from tests.support import in_process_stack, nodes_up, until

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "gpuorch.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"

FUNCTIONS_AND_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset", "inf",
    "nan", "atan2",
}
GATEWAY_ONLY = {"gpuorch_gateway_upstream_up"}  # served by the split gateway alone: tests/test_metrics_split.py
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created")}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers left once strings, label matchers, ranges, Grafana
    variables and the label lists of by/without/on/ignoring/group_* are dropped, less functions (a name before
    "(") and keywords."""
    e = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', '""', expr)
    e = re.sub(r"\$\{[^}]*\}|\$\w+", "", e)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\boffset\s+-?\w+", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", e):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in FUNCTIONS_AND_KEYWORDS or re.fullmatch(r"\d+[smhdwy]", name):
            continue
        names.add(name)
    return names


def dashboard_exprs(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target, and the metric of each label_values() variable."""
    def panels(ps: list[dict]) -> Iterator[dict]:
        for p in ps:
            yield p
            yield from panels(p.get("panels", []))
    for p in panels(dashboard["panels"]):
        for t in p.get("targets", []):
            yield f"panel {p['title']!r} {t['refId']}", t["expr"]
    for v in dashboard.get("templating", {}).get("list", []):
        query = v["query"]["query"] if isinstance(v.get("query"), dict) else v.get("query", "")
        m = re.fullmatch(r"label_values\((.*),\s*\w+\)", query)
        yield f"variable {v['name']}", m.group(1) if m else query


def alert_exprs() -> Iterator[tuple[str, str]]:
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            yield f"alert {rule.get('alert') or rule.get('record')}", rule["expr"]


def exported_names(text: str) -> set[str]:
    """Every series name the exposition holds or declares (a declared family with no series yet counts, with the
    sample names of its type)."""
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            base = name.removesuffix("_total") if kind == "counter" else name
            names |= {base + suffix for suffix in SUFFIXES.get(kind, ("",))}
    return names


def unexported(exprs: Iterator[tuple[str, str]], exported: set[str]) -> list[str]:
    return [f"{where}: {name}" for where, expr in exprs for name in sorted(metric_names(expr) - exported)]


def test_the_promql_reader_finds_metric_names_and_nothing_else():
    expr = ('histogram_quantile(0.95, sum by (queue, le) (rate(gpuorch_job_submit_to_start_seconds_bucket'
            '{queue=~"$queue", state!="x"}[$__rate_interval])))'
            ' / on (queue) group_left(model) max without (gpu) (DCGM_FI_DEV_GPU_UTIL offset 5m) > bool 2e3'
            ' and gpuorch_jobs unless ignoring(leaf) up[5m:1m]')
    assert metric_names(expr) == {"gpuorch_job_submit_to_start_seconds_bucket", "DCGM_FI_DEV_GPU_UTIL",
                                  "gpuorch_jobs", "up"}


def test_the_dashboard_and_rules_are_well_formed_and_provisioned_together():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["panels"]
    titles = {p["title"] for p in dashboard["panels"] if p["type"] == "row"}
    assert {"Cluster", "Queues", "Jobs"} <= titles and any(t.startswith("GPUs") for t in titles)
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    assert {p["datasource"]["uid"] for p in dashboard["panels"] if "datasource" in p} == {uid}
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/gpuorch.yml").read_text())["providers"][0]
    compose = yaml.safe_load((DEPLOY.parent / "compose.yaml").read_text())["services"]
    mounts = dict(v.split(":")[:2] for v in compose["grafana"]["volumes"] if v.startswith("./"))
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    assert compose["prometheus"]["image"].startswith("prom/prometheus")
    assert compose["grafana"]["image"].startswith("grafana/grafana")
    prom = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    assert prom["rule_files"] == ["alerts.yml"]
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"] == ["gateway:8080"]
    alerts = {name for name, _ in alert_exprs()}
    assert {"alert GpuorchGpuUnhealthy", "alert GpuorchNodeLost", "alert GpuorchQueueStarving",
            "alert GpuorchProjectionLag"} <= alerts


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian: apt-get install prometheus)")
def test_promtool_accepts_the_rules_and_the_scrape_config(tmp_path: Path):
    out = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    token = tmp_path / "prometheus.token"
    token.write_text("gpo_test")
    config = (DEPLOY / "prometheus/prometheus.yml").read_text().replace("/etc/prometheus/auth/prometheus.token", str(token))
    (tmp_path / "prometheus.yml").write_text(config)
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    out = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


async def test_every_expression_of_the_dashboard_and_the_alerts_names_only_series_the_stack_exports(
        eventlog: EventLog, agents):
    async with in_process_stack(eventlog) as (client, _):
        agents("a")
        await nodes_up(client, 1)
        assert (await client.put("/v1/queues/research", json={"guaranteed": {"gpus": 1}})).status_code == 200
        r = await client.post("/v1/jobs", json=job("busy").gpus(1).queue("research").command("sleep", "60").build()
                              .model_dump(mode="json"))
        assert r.status_code == 201, r.text

        async def busy_gpu_sampled():
            text = (await client.get("/metrics")).text
            return text if re.search(r'DCGM_FI_DEV_GPU_UTIL\{[^}]*job="j-', text) else None
        text = await until(busy_gpu_sampled, 20, "the busy GPU's telemetry")
    exported = exported_names(text)
    assert {"gpuorch_jobs", "DCGM_FI_DEV_GPU_UTIL", "gpuorch_job_requeues_total"} <= exported
    dashboard = json.loads(DASHBOARD.read_text())
    assert unexported(dashboard_exprs(dashboard), exported) == []
    assert unexported(alert_exprs(), exported | GATEWAY_ONLY) == []
    # the check itself: a name the stack does not export is caught, and so is a misspelt DCGM field
    assert unexported(iter([("probe", "sum(gpuorch_gpu_total) + DCGM_FI_DEV_GPU_UTILIZATION")]), exported) == [
        "probe: DCGM_FI_DEV_GPU_UTILIZATION", "probe: gpuorch_gpu_total"]
