"""Accounting adds up: GPU-seconds land in the window they were held in, and every view of them agrees.

A known workload is folded at known event times; each figure is checked against an oracle computed here from
the workload table alone (the sum of GPUs x overlap of [placed, ended) with the window), not by the code under test.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from shared import events as ev
from shared.cluster import ClusterProjection
from shared.events import Envelope, GpuShare, TaskPlacement
from shared.model import QueueSpec
from tests.builders import gpu_uuid, job, node

HOUR = 3600.0


@dataclass(frozen=True)
class Holding:
    """One placement of a job: ``gpus`` per task on consecutive GPUs of n1 from ``first_gpu``; ``ended`` None:
    still running."""

    job_id: str
    queue: str
    gpus: float
    tasks: int
    placed: float
    ended: float | None
    end: type[ev.Event] | None
    first_gpu: int


# offsets from an hour boundary: one short job, one across two hour boundaries, one running, one preempted and
# placed again, one on half a GPU
WORKLOAD = (
    Holding("a", "research", 1, 1, 600, 781.8, ev.JobSucceeded, 0),  # 0.0505 GPU-hours, as in the issue
    Holding("b", "research", 2, 1, 3000, 2 * HOUR + 420, ev.JobSucceeded, 1),
    Holding("c", "prod", 2, 2, 1.5 * HOUR, None, None, 3),
    Holding("d", "prod", 1, 1, 1200, 2030, ev.JobPreempted, 7),
    Holding("d", "prod", 1, 1, 5000, 5400, ev.JobFailed, 7),
    Holding("e", "research", 0.5, 1, 100, 4000, ev.JobCancelled, 8),
)

WINDOWS = [  # (label, since, until) as offsets from the workload's hour
    ("inside the short job", 550, 700),
    ("the first whole hour", 0, HOUR),
    ("across the first hour boundary", 600 + 181.8 - 30, HOUR + 60),
    ("cutting three hours", 3300, 2 * HOUR + 1800),
    ("up to a time the running job still runs", 1800, 4 * HOUR),
    ("everything", -HOUR, 5 * HOUR),
]


def oracle(since: float, until: float, base: float = 0.0) -> dict[str, float]:
    """GPU-seconds per queue in [since, until), from the workload table alone (running jobs held until ``until``)."""
    out: dict[str, float] = {}
    for h in WORKLOAD:
        lo, hi = base + h.placed, base + (h.ended if h.ended is not None else math.inf)
        overlap = max(0.0, min(hi, until) - max(lo, since))
        out[h.queue] = out.get(h.queue, 0.0) + h.gpus * h.tasks * overlap
    return out


def at(t: float, event: ev.Event) -> Envelope:
    return Envelope(event, time=datetime.fromtimestamp(t, UTC))


def workload_events(base: float, prefix: str = "") -> list[Envelope]:
    """The workload as the log holds it, in event-time order; ``prefix`` names its jobs apart from another run's."""
    timed: list[tuple[float, int, Envelope]] = [
        (base - 60, 0, at(base - 60, ev.NodeRegistered(node_id="n1", node=node("n1").gpus(10).build()))),
        *((base - 60, 0, at(base - 60, ev.QueueDefined(path=q, spec=QueueSpec()))) for q in ("prod", "research")),
    ]
    placed_before: set[str] = set()
    for i, h in enumerate(WORKLOAD):
        h = replace(h, job_id=prefix + h.job_id)
        spec = job(h.job_id).gpus(h.gpus).tasks(h.tasks).queue(h.queue).build()
        t = base + h.placed
        before = [] if h.job_id in placed_before else [ev.JobSubmitted(job_id=h.job_id, spec=spec)]
        if h.job_id not in placed_before:
            before.append(ev.JobQueued(job_id=h.job_id))
        placed_before.add(h.job_id)
        milli = round(h.gpus * 1000)
        per = max(1, math.ceil(h.gpus))
        placements = tuple(
            TaskPlacement(task=k, node_id="n1", gpus=tuple(
                GpuShare(uuid=gpu_uuid("n1", h.first_gpu + k * per + g), milli=min(1000, milli)) for g in range(per)))
            for k in range(h.tasks))
        for e in (*before, ev.JobPlaced(job_id=h.job_id, placements=placements)):
            timed.append((t, i, at(t, e)))
        if h.end is ev.JobPreempted:
            end = base + h.ended
            timed.append((end - 30, i, at(end - 30, ev.JobPreempting(job_id=h.job_id, reason="reclaim", grace_s=30))))
            timed.append((end, i, at(end, ev.JobPreempted(job_id=h.job_id))))
            timed.append((end, i, at(end, ev.JobQueued(job_id=h.job_id))))
        elif h.end is not None:
            timed.append((base + h.ended, i, at(base + h.ended, h.end(job_id=h.job_id))))
    timed.sort(key=lambda x: (x[0], x[1]))
    return [env for _, _, env in timed]


def folded(base: float, proj: ClusterProjection | None = None, prefix: str = "") -> ClusterProjection:
    proj = proj or ClusterProjection()
    for seq, env in enumerate(workload_events(base, prefix), start=proj.seq + 1):
        assert proj.apply(replace(env, seq=seq)), proj.invalid_transitions
    return proj


BASE = 1_795_510_800.0  # 2026-11-24T09:00:00Z: an hour boundary


@pytest.mark.parametrize("since,until", [(s, u) for _, s, u in WINDOWS], ids=[w[0] for w in WINDOWS])
def test_a_window_counts_exactly_the_gpu_seconds_held_in_it(since, until):
    proj = folded(BASE)
    got = proj.gpu_seconds(BASE + since, BASE + until)
    want = oracle(BASE + since, BASE + until, BASE)
    for queue, secs in want.items():
        assert got.get(queue, 0.0) == pytest.approx(secs, abs=1e-6), queue


def test_running_jobs_count_up_to_now_when_the_window_ends_later():
    proj = folded(BASE)
    now = BASE + 3 * HOUR
    got = proj.gpu_seconds(BASE, BASE + 10 * HOUR, now=now)
    assert got["prod"] == pytest.approx(oracle(BASE, now, BASE)["prod"])


def test_a_snapshot_restores_the_same_figures_and_an_older_snapshot_without_intervals_still_loads():
    proj = folded(BASE)
    again = ClusterProjection()
    again.restore(proj.snapshot())
    assert again.digest() == proj.digest()
    assert again.gpu_seconds(BASE + 550, BASE + 700) == proj.gpu_seconds(BASE + 550, BASE + 700)

    old = proj.state()
    old = {k: v for k, v in old.items() if k in
           {"now", "nodes", "jobs", "queues", "finished", "pool_shapes", "accounting"}}  # the snapshot before intervals
    older = ClusterProjection()
    older.load(old)
    whole_hours = older.gpu_seconds(BASE, BASE + 3 * HOUR)
    want = oracle(BASE, BASE + 3 * HOUR, BASE)
    for queue in want:  # whole hours stay exact from the buckets alone
        assert whole_hours[queue] == pytest.approx(want[queue])
    # holdings that end after the upgrade are exact again
    later = BASE + 2 * 86400
    f = folded(later, cancelled(older, "c", later - HOUR), prefix="2-")
    got = f.gpu_seconds(later + 550, later + 700)
    for queue, secs in oracle(later + 550, later + 700, later).items():
        assert got.get(queue, 0.0) == pytest.approx(secs)


def test_ended_holdings_are_kept_as_intervals_only_for_the_recent_horizon():
    from shared.cluster import EXACT_HORIZON_S

    proj = folded(BASE)
    assert sum(len(v) for v in proj.holdings.values()) == 5
    later = BASE + EXACT_HORIZON_S + 2 * 86400
    proj = folded(later, cancelled(proj, "c", later - HOUR), prefix="2-")
    kept = [h for hs in proj.holdings.values() for h in hs]
    assert all(end > later - EXACT_HORIZON_S - HOUR for _, end, _ in kept), "old intervals are forgotten"
    assert len(kept) == 6  # the second run's five, and the first run's job that ran until an hour ago
    # the old week is still there by the hour (buckets): whole hours stay exact
    for queue, secs in oracle(BASE, BASE + 3 * HOUR, BASE).items():
        if queue == "research":
            assert proj.gpu_seconds(BASE, BASE + 3 * HOUR)[queue] == pytest.approx(secs)
    # the recent week is exact at any edge
    got = proj.gpu_seconds(later + 550, later + 700)
    for queue, secs in oracle(later + 550, later + 700, later).items():
        assert got.get(queue, 0.0) == pytest.approx(secs)


def cancelled(proj: ClusterProjection, job_id: str, t: float) -> ClusterProjection:
    """The running job ended at ``t``: a second run of the workload can take its GPUs."""
    assert proj.apply(replace(at(t, ev.JobCancelled(job_id=job_id)), seq=proj.seq + 1)), proj.invalid_transitions
    return proj


# --- the three figures a person sees agree ----------------------------------------------------------------------


@pytest.fixture
def served(monkeypatch):
    """The workload folded six hours before now, served by the quota API; the CLI's calls go to it."""
    from services import cli
    from services.quota.api import router

    base = math.floor(time.time() / HOUR) * HOUR - 6 * HOUR
    proj = folded(base)

    class Svc:
        projection = proj

        @staticmethod
        async def read_in_thread(read):  # no folds to hold here: the projection is this test's alone
            return read()

    app = FastAPI()
    app.include_router(router(Svc(), 7 * 86400))
    client = TestClient(app)

    def api(method: str, url: str, path: str, key: str | None = None, **kw):
        resp = client.request(method, path, **kw, headers={"idempotency-key": key} if key else None)
        if resp.status_code >= 400:
            cli.fail(f"{resp.json()['detail']} (HTTP {resp.status_code})")
        return resp.json()

    monkeypatch.setattr(cli, "api", api)
    return base, client, cli.app


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def cli_figures(app, *args: str, column: int = -1) -> dict[str, float]:
    """queue -> the GPU-hours a CLI table prints (the last column)."""
    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 0, res.output
    out = {}
    for line in res.output.splitlines():
        cols = line.split()
        if cols and cols[0] in ("research", "prod"):
            out[cols[0]] = float(cols[column])
    return out


@pytest.mark.parametrize("since,until", [(s, u) for _, s, u in WINDOWS[:5]], ids=[w[0] for w in WINDOWS[:5]])
def test_usage_the_usage_api_and_queues_agree_with_the_oracle(served, since, until):
    base, client, app = served
    lo, hi = base + since, base + until
    want = {q: s / 3600 for q, s in oracle(lo, hi, base).items()}

    api = client.get("/v1/usage", params={"since": str(lo), "until": iso(hi)}).json()["queues"]
    usage = cli_figures(app, "usage", "--since", iso(lo), "--until", str(hi))
    queues = cli_figures(app, "queues", "--since", str(lo), "--until", str(hi))
    assert cli_figures(app, "queues", "list", "--since", str(lo), "--until", str(hi)) == queues
    rows = {r["path"]: r["usage"]["gpu_hours"] for r in client.get("/v1/queues", params={"since": str(lo),
                                                                                          "until": str(hi)}).json()}
    for queue, hours in want.items():
        if hours < 0.01:  # a figure printed with 4 decimals is within 1% from 0.01 GPU-hours up
            continue
        assert api[queue]["gpu_hours"] == pytest.approx(hours, rel=0.01), ("/v1/usage", queue)
        assert usage[queue] == pytest.approx(hours, rel=0.01), ("gpuorch usage", queue)
        assert queues[queue] == pytest.approx(hours, rel=0.01), ("gpuorch queues", queue)
        assert rows[queue] == pytest.approx(hours, rel=0.01), ("/v1/queues", queue)


def test_since_and_until_as_durations_ago(served):
    base, client, app = served
    now = time.time()
    want = {q: s / 3600 for q, s in oracle(now - 5 * HOUR, now - 2 * HOUR, base).items()}
    api = client.get("/v1/usage", params={"since": "5h", "until": "2h"}).json()
    assert api["until"] - api["since"] == pytest.approx(3 * HOUR)
    usage = cli_figures(app, "usage", "--since", "5h", "--until", "120m")
    for queue, hours in want.items():
        assert api["queues"][queue]["gpu_hours"] == pytest.approx(hours, rel=0.01)
        assert usage[queue] == pytest.approx(hours, rel=0.01)


@pytest.mark.parametrize("params", [{"since": "yesterday"}, {"until": "2h", "since": "1h"}, {"until": "soon"}],
                         ids=["a word", "until before since", "a bad until"])
def test_a_bad_window_is_refused_with_the_forms_accepted(served, params):
    _, client, app = served
    for path in ("/v1/usage", "/v1/queues"):
        r = client.get(path, params=params)
        assert r.status_code == 422, (path, r.text)
        detail = r.json()["detail"]
        assert ("2h" in detail and "ISO 8601" in detail) or "before since" in detail, detail
    res = CliRunner().invoke(app, ["usage", *[f"--{k}={v}" for k, v in params.items()]])
    assert res.exit_code != 0
    assert "2h" in res.output or "before since" in res.output, res.output


def test_a_bare_small_number_is_epoch_seconds_to_the_api_but_a_missing_unit_to_a_person(served):
    """`--since 24` meant hours once: the CLI asks for the unit; programs calling the API get epoch 24."""
    _, client, app = served
    assert client.get("/v1/usage", params={"since": "24"}).json()["since"] == 24.0
    res = CliRunner().invoke(app, ["usage", "--since=24"])
    assert res.exit_code != 0 and "24h" in res.output, res.output


def test_usage_api_reads_the_window_in_any_accepted_form(served):
    base, client, _ = served
    lo, hi = base + 3300, base + 2 * HOUR + 1800
    forms = [(str(lo), str(hi)), (iso(lo), iso(hi)), (str(int(lo)), datetime.fromtimestamp(hi, UTC).isoformat())]
    figures = [client.get("/v1/usage", params={"since": s, "until": u}).json()["queues"] for s, u in forms]
    assert figures[0] == figures[1] == figures[2]
    assert figures[0]["prod"]["gpu_hours"] == pytest.approx(oracle(lo, hi, base)["prod"] / 3600, abs=1e-4)


def test_the_decayed_usage_never_exceeds_the_usage_it_decays():
    proj = folded(BASE)
    now = BASE + 2 * HOUR + 500
    decayed = proj.decayed_usage(now, 7 * 86400)
    used = proj.gpu_seconds(BASE - HOUR, now)
    for queue, secs in used.items():
        assert decayed[queue] <= secs + 1e-6, queue
