"""One process per (service, instance name): two never share a durable consumer by accident; restarts keep their name."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.scheduler.projection import SchedulerProjection
from shared import events as ev
from shared.eventlog import EventLog
from shared.events import Envelope
from shared.instance import INSTANCE_BUCKET, INSTANCE_TTL_S, InstanceTaken, process_start
from shared.natsd import free_port
from shared.runtime import Service
from tests.support import eventually, running, wait_http

ROOT = Path(__file__).resolve().parents[1]


def scheduler(instance: str | None) -> Service:
    return Service("scheduler", SchedulerProjection(), instance=instance)


async def test_a_second_service_with_the_same_instance_name_is_refused_with_the_reason(eventlog: EventLog):
    first = scheduler("x")
    async with running(first, eventlog):
        t0 = time.monotonic()
        with pytest.raises(InstanceTaken) as refused:
            await asyncio.wait_for(scheduler("x").run(eventlog), 15)
        assert time.monotonic() - t0 < INSTANCE_TTL_S + 1
        assert "another scheduler instance 'x' is running (holder " in str(refused.value)
        assert "--instance" in str(refused.value)
        await eventlog.append(Envelope(ev.JobSubmitted(job_id="j-1", spec={"name": "one"})))
        await eventually(lambda: "j-1" in first.projection.jobs, what="the first to go on")


async def test_replicas_with_their_own_names_each_see_every_event(eventlog: EventLog):
    a, b = scheduler("a"), scheduler("b")
    async with running(a, eventlog), running(b, eventlog):
        await eventlog.append_many([Envelope(ev.JobSubmitted(job_id=f"j-{i}", spec={"name": "j"})) for i in range(40)])
        await eventually(lambda: len(a.projection.jobs) == len(b.projection.jobs) == 40, what="both to fold all 40")


async def test_a_name_whose_holder_died_on_this_host_is_taken_over_at_once(eventlog: EventLog):
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    holder = f"{os.uname().nodename}:{dead.pid}:{process_start(dead.pid)}"
    dead.kill()
    dead.wait()
    kv = await eventlog.kv(INSTANCE_BUCKET, ttl=INSTANCE_TTL_S)
    await kv.create("scheduler.x", json.dumps({"holder": holder}).encode())  # left behind by a SIGKILL
    t0 = time.monotonic()
    async with running(scheduler("x"), eventlog):
        assert time.monotonic() - t0 < INSTANCE_TTL_S / 2
        assert json.loads((await kv.get("scheduler.x")).value)["holder"] != holder


async def test_a_name_left_by_a_process_elsewhere_is_taken_once_it_lapses(eventlog: EventLog):
    kv = await eventlog.kv(INSTANCE_BUCKET, ttl=INSTANCE_TTL_S)
    await kv.create("scheduler.x", json.dumps({"holder": "another-host:1:1"}).encode())
    t0 = time.monotonic()
    async with running(scheduler("x"), eventlog):
        assert time.monotonic() - t0 < 2 * INSTANCE_TTL_S


def service_process(nats_url: str, port: int, instance: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.scheduler", "--nats", nats_url, "--port", str(port),
                             "--instance", instance], cwd=log.parent, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "GPUORCH_DATA_DIR": str(log.parent)},
                            start_new_session=True)


@pytest.mark.slow
def test_python_m_service_refuses_a_second_process_and_a_restart_after_sigkill_keeps_the_name(nats_url: str, tmp_path: Path):
    first = service_process(nats_url, free_port(), "x", tmp_path / "first.log")
    procs = [first]
    try:
        assert wait_http(f"http://127.0.0.1:{first.args[first.args.index('--port') + 1]}/readyz", 30), \
            (tmp_path / "first.log").read_text()
        second = service_process(nats_url, free_port(), "x", tmp_path / "second.log")
        procs.append(second)
        assert second.wait(30) != 0
        out = (tmp_path / "second.log").read_text()
        assert "another scheduler instance 'x' is running (holder " in out and "--instance" in out, out
        assert "Traceback" not in out, out
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        port = free_port()
        third = service_process(nats_url, port, "x", tmp_path / "third.log")
        procs.append(third)
        assert wait_http(f"http://127.0.0.1:{port}/readyz", 30), (tmp_path / "third.log").read_text()
        assert "event=instance_taken_over" in (tmp_path / "third.log").read_text()  # at once: its holder is gone
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
