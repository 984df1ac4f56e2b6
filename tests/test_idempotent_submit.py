"""POST /v1/jobs with an Idempotency-Key: the same submission sent again (a retry after a cut-off connection, a
gateway sending again what a dying service may have acted on) records its jobs once and is answered with them; the
key of another request is refused; a key is its user's."""

from __future__ import annotations

import asyncio
import http.server
import json
import socket
import threading

import pytest
from typer.testing import CliRunner

from services import cli
from shared.eventlog import EventLog
from tests.support import as_user, eventually, in_process_stack
from tests.jobfiles.test_cli import answer_through, gpuorch
from tests.test_batch_submit import counting_appends, job, submitted_seqs, with_a_node


def keyed(key: str) -> dict[str, str]:
    return {"Idempotency-Key": key}


async def submitted(eventlog: EventLog, after: int) -> list[str]:
    return [i for _, t, i in await submitted_seqs(eventlog, after) if t == "job.submitted"]


async def test_a_submission_sent_again_with_its_key_is_answered_with_the_jobs_it_recorded_once(eventlog):
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        before = await with_a_node(eventlog)
        body = [job("a"), {**job("b"), "array": {"indices": [0, 1, 2]}}]
        first = await client.post("/v1/jobs", json=body, headers=keyed("retry-1"))
        assert first.status_code == 201, first.text
        again = await client.post("/v1/jobs", json=body, headers=keyed("retry-1"))
        assert again.status_code == 201, again.text
        assert again.headers.get("idempotent-replayed") == "true" and "idempotent-replayed" not in first.headers
        assert [j["id"] for j in again.json()] == [j["id"] for j in first.json()]
        assert again.json()[1]["jobs"] == first.json()[1]["jobs"]
        a, array = first.json()
        assert sorted(await submitted(eventlog, before)) == sorted([a["id"], *array["jobs"]]), "recorded twice"
        other = await client.post("/v1/jobs", json=body, headers=keyed("retry-2"))
        assert other.status_code == 201 and {j["id"] for j in other.json()}.isdisjoint(j["id"] for j in first.json())
        plain = [await client.post("/v1/jobs", json=job("c")) for _ in range(2)]
        assert plain[0].json()["id"] != plain[1].json()["id"], "without a key, each POST is a submission"


async def test_retries_racing_the_first_before_it_is_folded_are_stored_once(eventlog, monkeypatch):
    """Sent together, none finds the others' jobs yet: each appends, and the log keeps one copy of each event
    (the message ids are the keyed job's)."""
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        before = await with_a_node(eventlog)
        calls = counting_appends(eventlog, monkeypatch)
        answers = await asyncio.gather(*(client.post("/v1/jobs", json=job("racer"), headers=keyed("race"))
                                         for _ in range(5)))
        assert [r.status_code for r in answers] == [201] * 5, [r.text for r in answers]
        assert len({r.json()["id"] for r in answers}) == 1
        assert len(calls) >= 2, "no retry raced the first: the log's deduplication was not reached"
        assert await submitted(eventlog, before) == [answers[0].json()["id"]]


async def test_a_key_used_for_another_request_is_refused_and_records_nothing(eventlog):
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        before = await with_a_node(eventlog)
        first = await client.post("/v1/jobs", json=job("train"), headers=keyed("k"))
        array = await client.post("/v1/jobs", json={**job("sweep"), "array": {"indices": [0, 1]}}, headers=keyed("a"))
        assert first.status_code == array.status_code == 201
        for key, other, recorded in (
                ("k", job("train", gpus=2), first.json()["id"]),
                ("k", job("eval"), first.json()["id"]),
                ("a", {**job("eval"), "array": {"indices": [0, 1]}}, array.json()["jobs"][0]),
                ("a", {**job("sweep"), "array": {"indices": [0, 1], "max_running": 1}}, array.json()["jobs"][0])):
            r = await client.post("/v1/jobs", json=other, headers=keyed(key))
            assert r.status_code == 422, r.text
            assert f"Idempotency-Key {key!r} was used for another request (job {recorded})" in r.json()["detail"]
        assert sorted(await submitted(eventlog, before)) == sorted([first.json()["id"], *array.json()["jobs"]])
        # a job and an array never share an id: under a job's key, an array is a submission of its own
        apart = await client.post("/v1/jobs", json={**job("train"), "array": {"indices": [0]}}, headers=keyed("k"))
        assert apart.status_code == 201 and apart.json()["id"] != first.json()["id"]


async def test_a_key_is_its_users_own(eventlog):
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        await with_a_node(eventlog)
        async with await as_user(client, "alice") as alice, await as_user(client, "bob") as bob:
            a = await alice.post("/v1/jobs", json=job("x"), headers=keyed("same"))
            b = await bob.post("/v1/jobs", json=job("x"), headers=keyed("same"))
            assert a.status_code == b.status_code == 201, (a.text, b.text)
            assert a.json()["id"] != b.json()["id"] and "idempotent-replayed" not in b.headers
            assert b.json()["owner"] == "bob"


async def test_a_malformed_key_is_refused_with_the_reason(eventlog):
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        for bad in ("two words", "x" * 256, "semi;colon"):
            r = await client.post("/v1/jobs", json=job("x"), headers=keyed(bad))
            assert r.status_code == 422, r.text
            assert "idempotency-key" in r.text.lower()


class Flaky(http.server.BaseHTTPRequestHandler):
    """A front door that cuts the first submission off once read, answers the second 503 (restarting), and records
    the third: what `gpuorch submit` meets while gpuorch restarts under it."""

    keys: list[str | None] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["content-length"]))
        self.keys.append(self.headers.get("idempotency-key"))
        if len(self.keys) == 1:
            self.connection.shutdown(socket.SHUT_RDWR)  # read, maybe acted on, never answered
            self.close_connection = True
            return
        status, body = (503, {"detail": "restarting"}) if len(self.keys) == 2 else \
            (201, {"id": "j-1", "name": "x", "queue": "default", "state": "queued", "warnings": []})
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def flaky():
    Flaky.keys = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_the_cli_sends_a_cut_off_submission_again_with_the_same_key(flaky, monkeypatch):
    monkeypatch.setattr(cli, "SUBMIT_RETRY_EVERY_S", 0.01)
    monkeypatch.setenv("GPUORCH_TOKEN", "t")
    res = CliRunner().invoke(cli.app, ["submit", "--url", flaky, "--", "true"])
    out = " ".join(res.output.split())  # rich wraps its lines
    assert res.exit_code == 0, out
    assert "submitted j-1" in out and "sending the same submission again" in out
    assert len(Flaky.keys) == 3 and Flaky.keys[0] and len(set(Flaky.keys)) == 1, Flaky.keys
    Flaky.keys = []
    res = CliRunner().invoke(cli.app, ["submit", "--url", flaky, "--idempotency-key", "nightly-7", "--", "true"])
    assert res.exit_code == 0 and Flaky.keys == ["nightly-7"] * 3, (res.output, Flaky.keys)


def test_the_cli_gives_up_on_a_cut_off_submission_with_its_key_to_send_again(flaky, monkeypatch):
    monkeypatch.setattr(cli, "SUBMIT_RETRY_S", 0.0)
    monkeypatch.setenv("GPUORCH_TOKEN", "t")
    res = CliRunner().invoke(cli.app, ["submit", "--url", flaky, "--idempotency-key", "k1", "--", "true"])
    assert res.exit_code == 1 and Flaky.keys == ["k1"], (res.output, Flaky.keys)
    assert "may have been recorded: send it again with --idempotency-key k1" in " ".join(res.output.split())


def test_the_cli_fails_at_once_when_nothing_listens(monkeypatch):
    monkeypatch.setenv("GPUORCH_TOKEN", "t")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        res = CliRunner().invoke(cli.app, ["submit", "--url", url, "--", "true"])
    assert res.exit_code == 1 and "cannot reach gpuorch" in res.output and "may have been recorded" not in res.output


async def test_a_key_whose_job_ended_long_ago_is_answered_from_the_history(eventlog, monkeypatch):
    """Out of memory (only the last KEEP_FINISHED ended jobs stay) and past the log's duplicate window, the SQL
    history still knows the job: the retry is answered from its row, another request under the key refused."""
    import shared.cluster

    monkeypatch.setattr(shared.cluster, "KEEP_FINISHED", 1)
    async def until_async(get, what: str) -> None:
        deadline = asyncio.get_running_loop().time() + 20
        while (r := await get()).status_code != 200 or not r.json().get("archived"):
            assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}: {r.text}"
            await asyncio.sleep(0.05)

    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, services):
        await with_a_node(eventlog)
        old = (await client.post("/v1/jobs", json=job("old"), headers=keyed("long-ago"))).json()["id"]
        for name in ("old", "newer", "newest"):
            if name != "old":
                r = await client.post("/v1/jobs", json=job(name))
                assert r.status_code == 201
            jid = old if name == "old" else r.json()["id"]
            assert (await client.delete(f"/v1/jobs/{jid}")).status_code == 200
        await until_async(lambda: client.get(f"/v1/jobs/{old}"), "the old job to leave memory for its history row")
        assert old not in services["scheduler"].projection.jobs
        again = await client.post("/v1/jobs", json=job("old"), headers=keyed("long-ago"))
        assert again.status_code == 201, again.text
        assert again.json()["id"] == old and again.json()["archived"] is True
        assert again.headers.get("idempotent-replayed") == "true"
        other = await client.post("/v1/jobs", json=job("renamed"), headers=keyed("long-ago"))
        assert other.status_code == 422 and f"(job {old})" in other.json()["detail"], other.text


async def test_the_cli_says_a_submission_sent_again_was_already_submitted(eventlog, monkeypatch):
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, _):
        await with_a_node(eventlog)
        answer_through(monkeypatch, client)
        outs = [await gpuorch("submit", "--idempotency-key", "nightly-7", "--", "true") for _ in range(2)]
        assert [code for code, _ in outs] == [0, 0], outs
        first, again = (" ".join(out.split()) for _, out in outs)
        assert first.startswith("submitted j-") and again.startswith("already submitted (same --idempotency-key): j-")
        assert first.split()[1] == again.split()[4], "the same job"


async def test_a_submission_recorded_in_part_by_a_try_that_died_is_completed_once(eventlog):
    """A scheduler killed in the middle of a keyed batch's append leaves some of its events in the log. The next
    try records the rest, each job once, and appends nothing again: past the log's duplicate window (here: the
    first try's events under other message ids) a copy would be a job submitted twice."""
    from services.scheduler.api import JobRequest, keyed_id
    from shared import events as ev
    from shared.events import Envelope
    from shared.model import ArrayElement, JobSpec

    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, services):
        before = await with_a_node(eventlog)
        user = (await client.get("/v1/whoami")).json()["user"]
        body = [job("a"), job("b"), {**job("c"), "array": {"indices": [0, 1, 2, 3]}}]
        a, b, c = (keyed_id(user, "half", i, "array" in r) for i, r in enumerate(body))

        def spec(i: int) -> JobSpec:
            return JobRequest.model_validate(body[i]).to_spec()

        def env(event, job_id: str, kind: str) -> Envelope:
            return Envelope(event, id=f"{job_id}-{kind}-first-try", source="/gpuorch/scheduler", actor=user)
        element = [spec(2).model_copy(update={"array": ArrayElement(id=c, index=i)}) for i in (0, 1)]
        # the retry comes past the duplicate window (minutes later): the scheduler has folded the first try by then
        first_try = await eventlog.append_many([  # a: both events; b: its submission only; c: two of four elements
            env(ev.JobSubmitted(job_id=a, spec=spec(0), owner=user), a, "submitted"),
            env(ev.JobQueued(job_id=a), a, "queued"),
            env(ev.JobSubmitted(job_id=b, spec=spec(1), owner=user), b, "submitted"),
            *(env(ev.JobSubmitted(job_id=f"{c}-{i}", spec=element[i], owner=user), f"{c}-{i}", "submitted")
              for i in (0, 1)),
            *(env(ev.JobQueued(job_id=f"{c}-{i}"), f"{c}-{i}", "queued") for i in (0, 1))])
        await eventually(lambda: services["scheduler"].projection.seq >= first_try[-1], what="the first try folded")
        r = await client.post("/v1/jobs", json=body, headers=keyed("half"))
        assert r.status_code == 201, r.text
        assert [j["id"] for j in r.json()] == [a, b, c] and r.json()[2]["jobs"] == [f"{c}-{i}" for i in range(4)]
        every = [a, b, *(f"{c}-{i}" for i in range(4))]
        logged = await submitted_seqs(eventlog, before)
        for kind in ("job.submitted", "job.queued"):
            assert sorted(i for _, t, i in logged if t == kind) == sorted(every), kind
        assert services["scheduler"].projection.invalid_count == 0, "a job recorded twice"
        states = {j: (await client.get(f"/v1/jobs/{j}")).json()["state"] for j in every}
        assert "submitted" not in states.values(), states
        lone = keyed_id(user, "lone", 0, False)  # one job, its job.queued lost: the retry appends it
        seq = await eventlog.append(env(ev.JobSubmitted(job_id=lone, spec=spec(0), owner=user), lone, "submitted"))
        await eventually(lambda: services["scheduler"].projection.seq >= seq, what="the first try folded")
        r = await client.post("/v1/jobs", json=body[0], headers=keyed("lone"))
        assert r.status_code == 201 and r.json()["id"] == lone and r.json()["state"] != "submitted", r.text
        assert services["scheduler"].projection.invalid_count == 0
