"""No input can hurt the system: what the API refuses, it refuses with a documented status and body, and the log
stays as it was. Every test counts the events before and after."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import httpx
import nats
import pytest

from shared import events as ev
from shared.api_errors import ErrorBody
from shared.eventlog import EventLog
from shared.events import Envelope
from tests.builders import node
from tests.support import as_user, eventually, in_process_stack

JOB = {"name": "j", "resources": {"gpus": 1}, "command": ["true"]}


@asynccontextmanager
async def stack(eventlog: EventLog, **settings):
    """The in-process stack, with no health rule that could append on its own while a test counts events."""
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600, **settings) as (client, services):
        yield client, services


async def refused(eventlog: EventLog, client: httpx.AsyncClient, method: str, url: str, status: int, **kw) -> dict:
    """The call answers ``status`` with the error body, and appends nothing."""
    before = await eventlog.last_seq()
    r = await client.request(method, url, **kw)
    assert r.status_code == status, (method, url, r.status_code, r.text[:500])
    body = r.json()
    ErrorBody.model_validate(body)
    assert await eventlog.last_seq() == before, f"{method} {url} appended to the log"
    return body


async def quiet(eventlog: EventLog, for_s: float = 0.6) -> None:
    """Until the services' own reactions (a job found unschedulable, ...) have been appended."""
    while True:
        seq = await eventlog.last_seq()
        await asyncio.sleep(for_s)
        if await eventlog.last_seq() == seq:
            return


def raw(doc: str) -> dict:
    """A body as a client may send it: Python's JSON reader takes Infinity and NaN."""
    return {"content": doc.encode(), "headers": {"content-type": "application/json"}}


async def test_infinity_and_nan_are_refused_with_422_in_every_model(eventlog: EventLog):
    async with stack(eventlog) as (client, _):
        for number in ("Infinity", "-Infinity", "NaN", "1e400"):
            body = await refused(eventlog, client, "POST", "/v1/jobs", 422,
                                 **raw('{"name": "x", "command": ["true"], "resources": {"gpus": %s}}' % number))
            assert body["detail"][0]["loc"] == ["body", "resources", "gpus"]
            await refused(eventlog, client, "PUT", "/v1/queues/q", 422, **raw('{"weight": %s}' % number))
            await refused(eventlog, client, "PUT", "/v1/queues/q", 422, **raw('{"guaranteed": {"gpus": %s}}' % number))
            await refused(eventlog, client, "PUT", "/v1/deployments/d", 422,
                          **raw('{"command": ["x"], "target_pending_per_replica": %s}' % number))


async def test_a_422_never_echoes_a_secret_nor_a_whole_object_back(eventlog: EventLog):
    """A refused field's own value is shown (it says what was wrong); the object around it is not. A 422 used to
    echo the whole body for a missing field, secret_env values included, and 100,000 array indices in full."""
    async with stack(eventlog) as (client, _):
        body = await refused(eventlog, client, "POST", "/v1/jobs", 422,
                             json={"command": ["true"], "secret_env": {"TOKEN": "hunter2"}})
        assert body["detail"][0]["loc"] == ["body", "name"] and "hunter2" not in json.dumps(body), body
        body = await refused(eventlog, client, "POST", "/v1/jobs", 422,
                             json={**JOB, "secret_env": {"TOKEN": 7}, "resources": {"gpus": -1}})
        assert "input" not in next(e for e in body["detail"] if "secret_env" in e["loc"]), body
        assert next(e for e in body["detail"] if "gpus" in e["loc"])["input"] == -1, "the bad value itself is shown"
        r = await client.post("/v1/jobs", json={**JOB, "array": {"indices": list(range(100_000))}})
        assert r.status_code == 422 and len(r.content) < 2_000, (len(r.content), r.text[:300])
        body = await refused(eventlog, client, "POST", "/v1/jobs", 422, json={**JOB, "name": "x" * 100_000})
        assert len(json.dumps(body)) < 2_000 and "100000 characters" in json.dumps(body), json.dumps(body)[:300]


async def test_a_body_above_the_limit_is_413_before_it_is_read_whole(eventlog: EventLog):
    async with stack(eventlog) as (client, _):
        ten_mb = {**JOB, "command": ["x" * 131_072] * 80}  # valid in every field: once a 500 from the bus
        body = await refused(eventlog, client, "POST", "/v1/jobs", 413, json=ten_mb)
        assert "1048576 bytes" in body["detail"]

        async def chunks():  # no Content-Length: counted as it arrives
            yield b'{"name": "x", "command": ["'
            for _ in range(20):
                yield b"y" * 100_000
            yield b'"]}'

        await refused(eventlog, client, "POST", "/v1/jobs", 413, content=chunks(),
                      headers={"content-type": "application/json"})
        await refused(eventlog, client, "PUT", "/v1/queues/q", 413, json={"groups": ["g" * 100] * 20_000})
        assert (await client.post("/v1/jobs", json={**JOB, "command": ["x" * 100_000]})).status_code == 201


async def test_the_body_limit_is_a_setting(eventlog: EventLog):
    async with stack(eventlog, max_body_bytes=1000) as (client, _):
        await refused(eventlog, client, "POST", "/v1/jobs", 413, json={**JOB, "command": ["x" * 1000]})
        assert (await client.post("/v1/jobs", json=JOB)).status_code == 201


async def test_event_queries_take_only_sequences_that_can_exist(eventlog: EventLog):
    async with stack(eventlog) as (client, _):
        for after in ("1e20", str(10**20), str(2**63), "-1"):
            await refused(eventlog, client, "GET", f"/v1/events?after={after}", 422)
        assert (await client.get("/v1/events", params={"after": 2**53})).json() == []


async def test_a_path_id_that_cannot_exist_is_a_404_like_a_missing_one_and_never_a_subject(eventlog: EventLog):
    async with stack(eventlog) as (client, _):
        assert (await client.post("/v1/jobs", json=JOB)).status_code == 201
        await quiet(eventlog)
        missing = await refused(eventlog, client, "GET", "/v1/jobs/j-none/events", 404)
        assert missing == {"detail": "no job j-none"}
        for bad in ("a%20b", "*", "%3E", "a.b", "A", "x" * 100):
            body = await refused(eventlog, client, "GET", f"/v1/jobs/{bad}/events", 404)
            assert body["detail"].startswith("no job "), bad  # the same answer as a job that does not exist
            await refused(eventlog, client, "GET", f"/v1/jobs/{bad}", 404)
            await refused(eventlog, client, "DELETE", f"/v1/jobs/{bad}", 404)
            await refused(eventlog, client, "GET", f"/v1/jobs/{bad}/logs", 404)
        for bad in ("a%20b", "*", "%3E", "-x"):
            await refused(eventlog, client, "GET", f"/v1/nodes/{bad}", 404)
            for verb in ("cordon", "drain", "resume", "inject-xid"):
                await refused(eventlog, client, "POST", f"/v1/nodes/{bad}/{verb}", 404,
                              json={"gpu_index": 0, "xid": 79} if verb == "inject-xid" else {})
        await refused(eventlog, client, "DELETE", "/v1/queues/a%20b", 404)
        await refused(eventlog, client, "DELETE", "/v1/tokens/*", 404)
        await refused(eventlog, client, "POST", "/v1/deployments/%2A/metrics", 404, json={"pending_requests": 1})


async def test_the_event_subject_filter_is_never_a_wildcard(eventlog: EventLog):
    async with stack(eventlog) as (client, _):
        first = (await client.post("/v1/jobs", json=JOB)).json()["id"]
        assert (await client.post("/v1/jobs", json=JOB)).status_code == 201
        await quiet(eventlog)
        for subject in ("job/*", "job/>", "*", ">", "job/a b", "job.x", "job/", "job/a.>", ""):
            await refused(eventlog, client, "GET", "/v1/events", 422, params={"subject": subject})
        mine = (await client.get("/v1/events", params={"subject": f"job/{first}"})).json()
        assert mine and {e["subject"] for e in mine} == {f"job/{first}"}


async def test_the_default_queue_cannot_be_deleted_nor_become_a_parent(eventlog: EventLog):
    async with stack(eventlog) as (client, _):
        body = await refused(eventlog, client, "DELETE", "/v1/queues/default", 409)
        assert "default" in body["detail"]
        await refused(eventlog, client, "PUT", "/v1/queues/default.sub", 409, json={})
        assert (await client.post("/v1/jobs", json=JOB)).status_code == 201, "a plain submit still works"


async def test_queue_amounts_have_documented_bounds(eventlog: EventLog):
    async with stack(eventlog) as (client, _):
        for spec in ({"guaranteed": {"gpus": 1e12}}, {"limit": {"gpus": 1_000_001}}, {"priority": 10**30},
                     {"priority": -1001}, {"preempt_min_runtime_s": 31 * 86400}, {"weight": 1001},
                     {"weight": True}, {"priority": "5"}):
            await refused(eventlog, client, "PUT", "/v1/queues/q", 422, json=spec)
        ok = {"guaranteed": {"gpus": 1_000_000}, "priority": -1000, "preempt_min_runtime_s": 30 * 86400}
        assert (await client.put("/v1/queues/q", json=ok)).status_code == 200


async def test_the_queue_list_says_when_top_level_guarantees_exceed_the_cluster(eventlog: EventLog):
    async with stack(eventlog) as (client, _):
        await eventlog.append(Envelope(ev.NodeRegistered(node_id="n1", node=node("n1").gpus(8).build())))

        async def overcommitted() -> dict[str, bool]:
            return {q["path"]: q["overcommitted"] for q in (await client.get("/v1/queues")).json()}

        assert (await client.put("/v1/queues/a", json={"guaranteed": {"gpus": 6}})).status_code == 200
        assert (await client.put("/v1/queues/a.x", json={"guaranteed": {"gpus": 6}})).status_code == 200
        assert await overcommitted() == {"default": False, "a": False, "a.x": False}
        assert (await client.put("/v1/queues/b", json={"guaranteed": {"gpus": 4}})).status_code == 200
        assert await overcommitted() == {"default": True, "a": True, "a.x": False, "b": True}


async def test_a_job_must_run_something(eventlog: EventLog):
    async with stack(eventlog) as (client, _):
        for body in ({"name": "x"}, {"name": "x", "command": []}):
            detail = (await refused(eventlog, client, "POST", "/v1/jobs", 422, json=body))["detail"]
            assert detail[0]["loc"] == ["body", "command"]


async def test_environment_names_are_posix_and_nothing_that_reaches_exec_holds_a_nul(eventlog: EventLog):
    async with stack(eventlog) as (client, _):
        for env in ({"A-B": "1"}, {"1A": "1"}, {"A B": "1"}, {"": "1"}, {"A=B": "1"}, {"A\x00": "1"}, {"A": "x\x00y"}):
            await refused(eventlog, client, "POST", "/v1/jobs", 422, json={**JOB, "env": env})
            await refused(eventlog, client, "POST", "/v1/jobs", 422, json={**JOB, "secret_env": env})
            await refused(eventlog, client, "PUT", "/v1/deployments/d", 422, json={"command": ["x"], "env": env})
        await refused(eventlog, client, "POST", "/v1/jobs", 422, json={**JOB, "command": ["a\x00b"]})
        assert (await client.post("/v1/jobs", json={**JOB, "env": {"_A_1": "x=y"}})).status_code == 201


async def test_an_unknown_filter_value_is_422_naming_the_valid_ones(eventlog: EventLog):
    async with stack(eventlog) as (client, _):
        body = await refused(eventlog, client, "GET", "/v1/jobs?state=bogus", 422)
        assert all(s in body["detail"][0]["msg"] for s in ("queued", "running", "succeeded", "cancelled"))
        await refused(eventlog, client, "GET", "/v1/jobs?queue=Not%20a%20queue", 422)
        assert (await client.get("/v1/jobs", params={"state": "queued", "queue": "default"})).json() == []


async def test_operator_verbs_that_change_nothing_append_nothing(eventlog: EventLog):
    async with stack(eventlog) as (client, services):
        await eventlog.append(Envelope(ev.NodeRegistered(node_id="n1", node=node("n1").gpus(8).build())))
        await eventually(lambda: "n1" in services["health"].projection.nodes, what="health to know n1")
        await quiet(eventlog)
        spec = {"guaranteed": {"gpus": 2}, "weight": 2}
        for method, url, body, key in (("POST", "/v1/nodes/n1/cordon", {}, "cordoned"),
                                       ("POST", "/v1/nodes/n1/resume", None, "cordoned"),
                                       ("PUT", "/v1/queues/q", spec, "path")):
            first = await client.request(method, url, json=body)
            assert first.status_code == 200 and first.json()["changed"] is True, first.text
            before = await eventlog.last_seq()
            again = await client.request(method, url, json=body)
            assert again.status_code == 200, again.text
            assert again.json()["changed"] is False and again.json()[key] == first.json()[key]
            assert await eventlog.last_seq() == before, f"a repeated {method} {url} appended an event"
        assert (await client.put("/v1/queues/q", json={**spec, "weight": 3})).json()["changed"] is True


async def test_every_error_answers_the_documented_body_and_status(eventlog: EventLog):
    async with stack(eventlog, max_body_bytes=10_000) as (client, _):
        doc = (await client.get("/openapi.json")).json()
        error_ref = {"$ref": "#/components/schemas/ErrorBody"}
        for path, ops in doc["paths"].items():
            for method, op in ops.items():
                for status, response in op["responses"].items():
                    if status.startswith("4"):
                        assert response["content"]["application/json"]["schema"] == error_ref, (method, path, status)
        assert "HTTPValidationError" not in doc["components"]["schemas"]

        anonymous = httpx.AsyncClient(transport=httpx.ASGITransport(app=client.app), base_url="http://gpuorch")
        user = await as_user(client, "alice")
        not_utf8, as_json = b'{"name": "\xff"}', {"content-type": "application/json"}
        before = await eventlog.last_seq()
        cases = [  # (client, method, url, kwargs, status, documented operation or None for no route)
            (anonymous, "GET", "/v1/jobs", {}, 401, ("get", "/v1/jobs")),
            (user, "PUT", "/v1/queues/q", {"json": {}}, 403, ("put", "/v1/queues/{path}")),
            (client, "GET", "/v1/jobs/j-none", {}, 404, ("get", "/v1/jobs/{job_id}")),
            (client, "DELETE", "/v1/queues/default", {}, 409, ("delete", "/v1/queues/{path}")),
            (client, "POST", "/v1/jobs", {"json": {**JOB, "command": ["x" * 20_000]}}, 413, ("post", "/v1/jobs")),
            (client, "POST", "/v1/jobs", {"json": {"name": 5}}, 422, ("post", "/v1/jobs")),
            (client, "POST", "/v1/jobs", {"content": not_utf8, "headers": as_json}, 400, ("post", "/v1/jobs")),
            (client, "POST", "/v1/jobs", {"content": not_utf8}, 422, ("post", "/v1/jobs")),  # and not said to be JSON
            (client, "GET", "/v1/nope", {}, 404, None),
            (client, "PATCH", "/v1/jobs", {}, 405, None),
        ]
        for c, method, url, kw, status, operation in cases:
            r = await c.request(method, url, **kw)
            assert r.status_code == status, (method, url, r.status_code, r.text[:300])
            ErrorBody.model_validate(r.json())
            if operation is not None:
                assert str(status) in doc["paths"][operation[1]][operation[0]]["responses"], (method, url, status)
        r = await client.request("OPTIONS", "/v1/jobs")
        assert r.status_code == 405 and r.headers["allow"] == "GET, POST"
        assert (await client.request("OPTIONS", "/v1/queues/q")).headers["allow"] == "PUT, DELETE"
        assert json.loads((await client.get("/v1/events?after=x")).text)["detail"][0]["loc"] == ["query", "after"]
        assert await eventlog.last_seq() == before


@pytest.mark.parametrize("error", [TimeoutError("no ack"), nats.errors.NoServersError(), ConnectionResetError()])
async def test_an_event_log_that_does_not_answer_is_a_503_to_retry_not_a_500(error):
    """Seen in bench.chaos: a NATS node's SIGKILL mid-append answered 500; nothing was promised, so 503."""
    from fastapi import FastAPI

    from shared import api_errors

    app = FastAPI()
    api_errors.install(app)

    @app.get("/append")
    async def append() -> None:
        raise error

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                 base_url="http://t") as client:
        r = await client.get("/append")
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert "event log is unavailable" in r.json()["detail"]
