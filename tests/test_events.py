"""The event contract: envelope, registry, upcasting, schemas."""

from __future__ import annotations

import json

import pytest

from shared import events as ev
from shared.events import Envelope, MalformedEvent, UnknownEventType, decode, export_schemas, upcaster
from shared.model import JobSpec


def test_envelope_is_a_structured_cloudevent_with_time_always_set():
    env = Envelope(ev.JobQueued(job_id="j-1"), source="/gpuorch/scheduler")
    ce = json.loads(env.encode())
    assert ce["specversion"] == "1.0"
    assert ce["type"] == "io.gpuorch.job.queued.v1"
    assert ce["source"] == "/gpuorch/scheduler"
    assert ce["subject"] == "job/j-1"
    assert ce["time"].endswith("Z")
    assert ce["datacontenttype"] == "application/json"
    assert ce["data"] == {"job_id": "j-1"}
    h = env.headers()
    assert h["Nats-Msg-Id"] == env.id and h["Content-Type"] == "application/cloudevents+json"
    assert h["ce-type"] == ce["type"] and h["ce-subject"] == "job/j-1"


def test_a_cloudevents_sdk_reads_our_envelope():
    from cloudevents.core.formats.json import JSONFormat

    env = Envelope(ev.JobSubmitted(job_id="j-2", spec=JobSpec(name="x")), epoch=3)
    ce = JSONFormat().read(None, env.encode())
    assert ce.get_type() == "io.gpuorch.job.submitted.v1"
    assert ce.get_id() == env.id and ce.get_subject() == "job/j-2"
    assert ce.get_data()["spec"]["name"] == "x"


def test_decode_round_trips_and_keeps_the_stream_position():
    env = Envelope(ev.JobPlaced(job_id="j-3", placements=(ev.TaskPlacement(task=0, node_id="n1", gpus=(ev.GpuShare(uuid="g"),)),)), epoch=7)
    back = decode(env.encode(), seq=42)
    assert back.data == env.data and back.seq == 42 and back.epoch == 7 and back.time == env.time


def test_an_unknown_type_and_a_malformed_body_raise_their_own_errors():
    env = json.loads(Envelope(ev.JobQueued(job_id="j")).encode())
    with pytest.raises(UnknownEventType):
        decode(json.dumps({**env, "type": "io.gpuorch.job.teleported.v1"}).encode())
    for body in (b"not json", b"[]", json.dumps({**env, "data": {"job": 1}}).encode(), json.dumps({**env, "time": "soon"}).encode()):
        with pytest.raises(MalformedEvent):
            decode(body)


def test_an_old_version_is_upcast_on_read():
    @upcaster("io.gpuorch.job.queued.v0")
    def _v0(data):
        return "io.gpuorch.job.queued.v1", {"job_id": data["id"]}

    try:
        golden = {"specversion": "1.0", "id": "e1", "source": "/old", "type": "io.gpuorch.job.queued.v0",
                  "time": "2025-01-01T00:00:00Z", "data": {"id": "j-old"}}
        assert decode(json.dumps(golden).encode()).data == ev.JobQueued(job_id="j-old")
    finally:
        ev.UPCASTERS.pop("io.gpuorch.job.queued.v0")


def test_every_type_exports_a_json_schema(tmp_path):
    paths = export_schemas(tmp_path)
    assert len(paths) == len(ev.REGISTRY)
    schema = json.loads((tmp_path / "io.gpuorch.job.submitted.v1.json").read_text())
    assert schema["properties"]["type"]["const"] == "io.gpuorch.job.submitted.v1"
    assert "spec" in schema["properties"]["data"]["properties"]


def test_subjects_are_one_token_per_id_even_for_dotted_queue_paths():
    e = ev.QueueDefined(path="research.nlp", spec={})
    assert e.nats_subject == "gpuorch.events.queue.research:nlp"


def _stored(ce_type: str, data: dict) -> bytes:
    """A CloudEvent as anyone with publish rights could store it: no pydantic model checked it on the way in."""
    return json.dumps({"specversion": "1.0", "id": "forged", "source": "/gpuorch/scheduler", "type": f"io.gpuorch.{ce_type}.v1",
                       "time": "2026-01-01T00:00:00Z", "data": data}).encode()


def _placed(task: int = 0, node_id: str = "n1", uuid: str = "GPU-n1-0", job_id: str = "j-1") -> dict:
    return {"job_id": job_id, "placements": [{"task": task, "node_id": node_id, "gpus": [{"uuid": uuid}]}]}


@pytest.mark.parametrize("ce_type,data", [
    pytest.param("job.placed", _placed(job_id="../../../../x"), id="job id climbing out of the agent's work dir"),
    pytest.param("job.submitted", {"job_id": "j-1/..", "spec": {"name": "x"}}, id="job id with a slash"),
    pytest.param("job.queued", {"job_id": "J-UPPER"}, id="job id in upper case"),
    pytest.param("job.queued", {"job_id": "j" * 82}, id="job id too long"),
    pytest.param("job.placed", _placed(task=-1), id="negative task index"),
    pytest.param("job.task_started", {"job_id": "j-1", "task": -3, "node_id": "n1"}, id="negative task reported"),
    pytest.param("job.placed", _placed(node_id="../n1"), id="node id climbing"),
    pytest.param("job.task_exited", {"job_id": "j-1", "task": 0, "node_id": "n1 n2"}, id="node id with a space"),
    pytest.param("node.cordoned", {"node_id": "n1.>"}, id="node id with a subject wildcard"),
    pytest.param("node.registered", {"node_id": "n1", "node": {"node_id": "../n1"}}, id="registered node's own id"),
    pytest.param("job.placed", _placed(uuid="GPU-0,GPU-1"), id="gpu uuid that would widen CUDA_VISIBLE_DEVICES"),
    pytest.param("gpu.unhealthy", {"node_id": "n1", "gpu_uuid": "GPU-0\n", "kind": "xid"}, id="gpu uuid with a newline"),
    pytest.param("pool.node_provisioned", {"pool": "../pool", "node_id": "n1"}, id="pool name"),
    pytest.param("deployment.scaled", {"name": "Web_1", "replicas": 1}, id="deployment name"),
])
def test_an_id_that_could_escape_a_path_or_a_subject_fails_decode_whatever_its_source(ce_type: str, data: dict):
    with pytest.raises(MalformedEvent):
        decode(_stored(ce_type, data))


@pytest.mark.parametrize("ce_type,data", [
    pytest.param("job.placed", _placed(job_id=ev.new_id("j-")), id="api job id"),
    pytest.param("job.placed", _placed(job_id="victim", node_id="dgx-h100-0", uuid="GPU-3f1c0e2a-9b7d-5c44-8e21-0a6b9f3d2c11"),
                 id="profile node and nvml gpu"),
    pytest.param("job.placed", _placed(node_id="gpu_pool-12-0.rack1", uuid="MIG-GPU-3f1c0e2a/1/0"), id="pool node, old mig"),
    pytest.param("gpu.unhealthy", {"node_id": "n1", "gpu_uuid": "unknown:n1:0", "kind": "lost"}, id="undiscovered gpu"),
    pytest.param("pool.node_provisioned", {"pool": "gpu-pool", "node_id": "gpu-pool-12-0"}, id="pool"),
])
def test_the_ids_in_use_decode(ce_type: str, data: dict):
    decode(_stored(ce_type, data))


def test_a_nul_byte_that_reached_the_log_never_reaches_an_agent():
    """A forged job.submitted with NUL in its env or command fails to decode: skipped and counted, never started."""
    for spec in ({"name": "x", "command": ["true"], "env": {"A": "x\u0000y"}}, {"name": "x", "command": ["a\u0000"]},
                 {"name": "x", "command": ["true"], "env": {"A=B": "1"}}):
        body = json.dumps({"specversion": "1.0", "id": "f", "source": "/forged", "type": "io.gpuorch.job.submitted.v1",
                           "time": "2026-11-24T00:00:00Z", "data": {"job_id": "j-1", "spec": spec}}).encode()
        with pytest.raises(MalformedEvent):
            decode(body, 1)
