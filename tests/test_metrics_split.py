"""`gpuorch up --split`: the gateway's /metrics serves every service process's series, each family declared once."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.support import wait_until
from tests.test_dashboards import DASHBOARD, alert_exprs, dashboard_exprs, exported_names, unexported
from tests.test_metrics import promtool_problems
from tests.test_stack import Stack, stacks  # noqa: F401 - the fixture

OWNED = {  # a family each service process exports
    "inventory": "gpuorch_gpus", "scheduler": "gpuorch_jobs", "quota": "gpuorch_queue_guaranteed_gpus",
    "health": "DCGM_FI_DEV_GPU_TEMP", "autoscaler": "gpuorch_projection_lag_events",
}


def test_the_split_gateway_serves_every_service_processs_series(tmp_path: Path, stacks: list[Stack]):  # noqa: F811
    stack = Stack(tmp_path / "d", split=True, nodes="t4-4x:1")
    stacks.append(stack)
    stack.start()

    def scraped() -> str | None:
        r = stack.api.get("/metrics")
        assert r.status_code == 200, r.text
        families = {f.name: f for f in text_string_to_metric_families(r.text)}
        return r.text if "DCGM_FI_DEV_GPU_TEMP" in families and families["DCGM_FI_DEV_GPU_TEMP"].samples else None

    wait_until(lambda: scraped() is not None, 30, "the node's telemetry through the gateway")
    text = scraped()
    assert text is not None
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for service, family in OWNED.items():
        assert families.get(family) and families[family].samples, (service, family)
    lag = {s.labels["service"] for s in families["gpuorch_projection_lag_events"].samples}
    assert lag == set(OWNED)
    assert {s.labels["service"]: s.value for s in families["gpuorch_gateway_upstream_up"].samples} == \
        dict.fromkeys(OWNED, 1.0)
    declared = Counter(line.split()[2] for line in text.splitlines() if line.startswith("# TYPE "))
    assert [name for name, n in declared.items() if n > 1] == [], "a family declared twice is not valid exposition"
    exported = exported_names(text)
    assert unexported(alert_exprs(), exported) == []
    assert unexported(dashboard_exprs(json.loads(DASHBOARD.read_text())), exported) == []
    found = promtool_problems(text)
    if found is not None:
        assert found == []
    assert stack.stop() == 0
