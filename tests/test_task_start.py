"""A task that cannot start fails its job, with the reason, and its agent goes on; the API refuses an environment
no exec() could pass."""

from __future__ import annotations

import errno

import pytest
from pydantic import ValidationError

from services.inventory import agent as agent_module
from services.inventory.agent import Agent
from services.inventory.service import build as build_inventory
from services.inventory.work import WorkOrder, work_subject
from shared import events as ev
from shared.eventlog import WORK_STREAM, EventLog
from shared.events import Envelope
from shared.model import MAX_ENV_BYTES, JobSpec
from shared.profiles import build as build_profile
from shared.settings import Settings
from tests.support import in_process_stack, nodes_up, running, until

SCHEDULER = "/gpuorch/scheduler"


async def job_state(client, job_id: str) -> dict:
    return (await client.get(f"/v1/jobs/{job_id}")).json()


async def ended(client, job_id: str) -> dict | None:
    job = await job_state(client, job_id)
    return job if job.get("state") in ("succeeded", "failed") else None


def big_env_job(name: str) -> JobSpec:
    """A job logged before the API bounded the environment: one variable longer than exec() takes (E2BIG)."""
    return JobSpec.model_construct(**{**JobSpec(name=name, command=("true",)).__dict__, "env": {"BIG": "x" * 131_072}})


async def test_a_job_whose_environment_exec_refuses_fails_with_the_reason_and_the_agent_runs_the_next(
        eventlog: EventLog, agents, tmp_path):
    async with in_process_stack(eventlog, data_dir=tmp_path / "d") as (client, services):
        [agent] = agents("n1")
        await nodes_up(client, 1)
        submitted = ev.JobSubmitted.model_construct(job_id="j-big", spec=big_env_job("big"), owner=None, submitted_at=None)
        await eventlog.append_many([Envelope(submitted, source=SCHEDULER),
                                    Envelope(ev.JobQueued(job_id="j-big"), source=SCHEDULER)])
        failed = await until(lambda: ended(client, "j-big"), 30, "the job to end")
        assert failed["state"] == "failed"
        assert "Argument list too long" in failed["reason"], failed["reason"]
        sub = await client.post("/v1/jobs", json={"name": "next", "command": ["true"], "resources": {"gpus": 1}})
        assert sub.status_code == 201, sub.text
        done = await until(lambda: ended(client, sub.json()["id"]), 30, "the next job on the same agent")
        assert done["state"] == "succeeded"
        assert agent.proc.poll() is None


async def test_a_task_the_agent_cannot_set_up_fails_its_job_and_the_agent_goes_on(eventlog: EventLog, tmp_path,
                                                                                  monkeypatch):
    def full_disk(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    async with in_process_stack(eventlog, data_dir=tmp_path / "d") as (client, services):
        agent = Agent(build_profile("t4-4x", "n1"), tmp_path / "agent", heartbeat_s=0.2, telemetry_s=60)
        async with running(agent.svc, eventlog):
            await nodes_up(client, 1)
            monkeypatch.setattr(agent_module, "open_log", full_disk)
            first = (await client.post("/v1/jobs", json={"name": "a", "command": ["true"]})).json()["id"]
            failed = await until(lambda: ended(client, first), 30, "the job to end")
            assert failed["state"] == "failed" and "No space left on device" in failed["reason"], failed["reason"]
            monkeypatch.undo()
            second = (await client.post("/v1/jobs", json={"name": "b", "command": ["true"]})).json()["id"]
            done = await until(lambda: ended(client, second), 30, "the next job on the same agent")
            assert done["state"] == "succeeded"


def test_a_job_spec_with_more_environment_than_exec_takes_is_refused_with_the_reason():
    half = "x" * (MAX_ENV_BYTES // 2)
    with pytest.raises(ValidationError, match="128 KiB"):
        JobSpec(name="j", env={"A": half}, secret_env={"B": half})
    JobSpec(name="j", env={"A": "x" * (MAX_ENV_BYTES // 2 - 10)}, secret_env={"B": "x" * (MAX_ENV_BYTES // 2 - 10)})


async def test_the_api_answers_422_for_an_environment_above_128_kib(eventlog: EventLog, tmp_path):
    async with in_process_stack(eventlog, data_dir=tmp_path / "d", max_body_bytes=1 << 20) as (client, services):
        r = await client.post("/v1/jobs", json={"name": "j", "command": ["true"], "env": {"A": "x" * 70_000, "B": "y" * 70_000}})
        assert r.status_code == 422, r.text[:300]
        assert "128 KiB" in r.text


async def test_an_agent_starts_a_task_only_for_the_placement_inventory_accepted(eventlog: EventLog, tmp_path):
    """A second job.placed for a job already placed (two leaders overlapping) is recorded invalid by inventory's
    fold: it writes no work for it, and the agent starts nothing for it, where reacting to the event would run a
    second copy of the task."""
    agent = Agent(build_profile("t4-4x", "n1"), tmp_path / "agent", heartbeat_s=60, telemetry_s=60)
    inventory = build_inventory(Settings(data_dir=tmp_path / "d"))

    def placed(gpu: int) -> Envelope:
        share = ev.GpuShare(uuid=agent.node.gpus[gpu].uuid)
        return Envelope(ev.JobPlaced(job_id="j-1", placements=(ev.TaskPlacement(task=0, node_id="n1", gpus=(share,)),)),
                        source=SCHEDULER)

    async with running(inventory, eventlog), running(agent.svc, eventlog):
        first = await eventlog.append_many([
            Envelope(ev.NodeRegistered(node_id="n1", node=agent.node)),
            Envelope(ev.JobSubmitted(job_id="j-1", spec=JobSpec(name="one", command=("true",))), source=SCHEDULER),
            Envelope(ev.JobQueued(job_id="j-1"), source=SCHEDULER),
            placed(0),
        ])
        await until(lambda: _true((agent.work_dir / "jobs" / "j-1").exists()), 10, "the first placement's task")
        await eventlog.append(placed(1))
        after = await eventlog.append(Envelope(ev.QueueDefined(path="after", spec={})))  # reacted to after that one
        await until(lambda: _true(inventory.projection.seq >= after), 10, "inventory to fold past the second placement")
        await inventory.caught_up(after)

        assert inventory.projection.invalid_count == 1
        last = await eventlog.js.get_last_msg(WORK_STREAM, work_subject("n1", "j-1"))
        assert WorkOrder.model_validate_json(last.data).attempt == first[-1], "the work names the first placement"
        assert sorted(d.name for d in (agent.work_dir / "jobs" / "j-1").iterdir()) == [str(first[-1])]


async def _true(value: bool) -> bool:
    return value
