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
