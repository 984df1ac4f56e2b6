"""Who may call what: tokens, roles, per-job access, rate limits, the audit trail, secrets, OIDC.

The role table test is generated from the app's routes, so a new route cannot be forgotten.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from services.cli import event_line
from shared.auth import FORWARDED, PUBLIC, ROLE_RANK, ROUTE_ROLES, TokenStore
from shared.eventlog import EventLog
from shared.natsd import free_port
from tests.support import as_user, in_process_stack

ROLES = ("user", "operator", "admin")
JOB = {"name": "j", "resources": {"gpus": 0}, "command": ["true"]}


def sample_path(path: str) -> str:
    return path.replace("{rest:path}", "jobs").replace("{path}", "nosuchqueue").replace("{job_id}", "j-none") \
        .replace("{node_id}", "no-node").replace("{name}", "no-name").replace("{token_id}", "000000000000")


def api_routes(app) -> list[tuple[str, str]]:
    """Every (method, path) the app documents: its public surface."""
    app.openapi_schema = None
    return sorted((m.upper(), path) for path, ops in app.openapi()["paths"].items() for m in ops)


async def test_every_route_answers_401_403_or_serves_as_the_role_table_says(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, _):
        routes = api_routes(client.app)
        missing = [r for r in routes if r not in ROUTE_ROLES]
        assert not missing, f"routes not in shared.auth.ROUTE_ROLES (refused to everyone until listed): {missing}"
        callers = {role: await as_user(client, f"u-{role}", role=role) for role in ROLES}
        anonymous = httpx.AsyncClient(transport=httpx.ASGITransport(app=client.app), base_url="http://gpuorch")
        for method, path in routes:
            need, url = ROUTE_ROLES[(method, path)], sample_path(path)
            kw = {"json": {}} if method in ("POST", "PUT") else {}
            streaming = path.endswith("/stream")
            r = await anonymous.request(method, url, **kw) if not (need == PUBLIC and streaming) else None
            if need == PUBLIC:
                assert r is None or r.status_code not in (401, 403), (method, path, r.status_code)
                continue
            assert r.status_code == 401, (method, path, r.status_code, r.text)
            assert r.headers["www-authenticate"].startswith("Bearer")
            for role, c in callers.items():
                if ROLE_RANK[role] < ROLE_RANK[need]:
                    r = await c.request(method, url, **kw)
                    assert r.status_code == 403, (role, method, path, r.status_code, r.text)
                elif not streaming:
                    r = await c.request(method, url, **kw)
                    assert r.status_code not in (401, 403), (role, method, path, r.status_code, r.text)
        assert (await anonymous.get("/openapi.json")).status_code == 200  # the API's description stays open
        bogus = await callers["admin"].get("/v1/jobs", headers={"authorization": "Bearer gpo_not-a-token"})
        assert bogus.status_code == 401


def test_the_role_table_names_no_route_that_does_not_exist():
    """Stale entries would hide a typo: every entry is a route of the one-process app or the split gateway."""
    import services.stack  # noqa: F401 - the gateway's routes are declared in serve_gateway

    known = {(m, p) for (m, p), need in ROUTE_ROLES.items() if need == FORWARDED} | {
        ("GET", "/v1/services"), ("GET", "/readyz"), ("GET", "/healthz"), ("GET", "/metrics")}
    from shared.api_events import events_router
    from shared.api_tokens import tokens_router
    from shared.runtime import build_app
    from shared.settings import Settings
    from services.stack import SERVICES, build_service

    services = [build_service(n, Settings(data_dir=__import__("pathlib").Path("/tmp/gpuorch-route-table"))) for n in SERVICES]
    from services.dashboard import dashboard_router

    app = build_app(services, [events_router(lambda: None), tokens_router(lambda: None)], auth=None)
    known |= set(api_routes(app))
    known |= {(m, r.path) for r in dashboard_router(lambda: None).routes for m in r.methods}  # pages: not in OpenAPI
    assert set(ROUTE_ROLES) <= known, set(ROUTE_ROLES) - known


async def test_a_user_sees_and_cancels_only_their_own_jobs(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, _):
        alice, bob = await as_user(client, "alice"), await as_user(client, "bob")
        operator = await as_user(client, "olga", role="operator")
        r = await alice.post("/v1/jobs", json={**JOB, "command": ["sleep", "60"]})
        assert r.status_code == 201, r.text
        job = r.json()
        assert job["owner"] == "alice"
        jid = job["id"]
        for method, path in (("GET", f"/v1/jobs/{jid}"), ("DELETE", f"/v1/jobs/{jid}"), ("GET", f"/v1/jobs/{jid}/logs"),
                             ("GET", f"/v1/jobs/{jid}/events")):
            r = await bob.request(method, path)
            assert r.status_code == 404 and r.json()["detail"] == f"no job {jid}", (method, path, r.text)
        assert [j["id"] for j in (await bob.get("/v1/jobs")).json()] == []
        assert [j["id"] for j in (await alice.get("/v1/jobs")).json()] == [jid]
        assert (await operator.get(f"/v1/jobs/{jid}")).status_code == 200
        assert (await operator.delete(f"/v1/jobs/{jid}")).status_code == 403
        assert (await client.get(f"/v1/jobs/{jid}")).status_code == 200  # admin
        r = await alice.delete(f"/v1/jobs/{jid}")
        assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text


async def test_a_queue_admits_its_groups_and_shares_their_jobs_as_it_says(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, _):
        r = await client.put("/v1/queues/vision", json={"groups": ["vision"], "group_access": "cancel"})
        assert r.status_code == 200, r.text
        assert (await client.put("/v1/queues/vision.train", json={})).status_code == 200  # inherits the groups
        alice = await as_user(client, "alice", ("vision",))
        bob = await as_user(client, "bob", ("vision",))
        carol = await as_user(client, "carol", ("nlp",))
        r = await alice.post("/v1/jobs", json={**JOB, "queue": "vision.train"})
        assert r.status_code == 201, r.text
        jid = r.json()["id"]
        r = await carol.post("/v1/jobs", json={**JOB, "queue": "vision.train"})
        assert r.status_code == 403 and "admits the groups vision" in r.json()["detail"]
        assert (await carol.get(f"/v1/jobs/{jid}")).status_code == 404
        assert (await bob.get(f"/v1/jobs/{jid}")).status_code == 404  # group_access is the leaf's own: none
        assert (await client.put("/v1/queues/vision.train", json={"group_access": "read"})).status_code == 200
        assert (await bob.get(f"/v1/jobs/{jid}")).status_code == 200
        assert (await bob.delete(f"/v1/jobs/{jid}")).status_code == 403
        assert (await client.put("/v1/queues/vision.train", json={"group_access": "cancel"})).status_code == 200
        assert (await bob.delete(f"/v1/jobs/{jid}")).status_code == 200


async def test_users_cannot_submit_critical_work_or_change_the_cluster(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, _):
        alice = await as_user(client, "alice")
        operator = await as_user(client, "olga", role="operator")
        r = await alice.post("/v1/jobs", json={**JOB, "priority": "critical"})
        assert r.status_code == 403 and "up to priority high" in r.json()["detail"]
        assert (await alice.post("/v1/jobs", json={**JOB, "priority": "high"})).status_code == 201
        assert (await alice.put("/v1/queues/mine", json={})).status_code == 403
        assert (await alice.put("/v1/pools/x", json={"profile": "t4-4x", "max_nodes": 1})).status_code == 403
        assert (await operator.put("/v1/pools/x", json={"profile": "t4-4x", "max_nodes": 1})).status_code == 403
        assert (await operator.get("/v1/pools")).status_code == 200
        assert (await alice.get("/v1/events")).status_code == 403
        assert (await client.post("/v1/jobs", json={**JOB, "priority": "critical"})).status_code == 201  # admin


async def test_submissions_above_a_users_rate_get_429_with_retry_after(eventlog: EventLog):
    async with in_process_stack(eventlog, submit_rate_per_s=0.5, submit_burst=2) as (client, _):
        alice = await as_user(client, "alice")
        codes = [(await alice.post("/v1/jobs", json=JOB)).status_code for _ in range(2)]
        r = await alice.post("/v1/jobs", json=JOB)
        assert codes == [201, 201] and r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) == 2
        assert (await (await as_user(client, "bob")).post("/v1/jobs", json=JOB)).status_code == 201  # per user


async def test_every_event_a_person_causes_records_them(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, _):
        alice = await as_user(client, "alice")
        jid = (await alice.post("/v1/jobs", json={**JOB, "command": ["sleep", "60"]})).json()["id"]
        assert (await alice.delete(f"/v1/jobs/{jid}")).status_code == 200
        assert (await client.put("/v1/queues/team", json={})).status_code == 200
        history = (await client.get(f"/v1/jobs/{jid}/events")).json()
        by_type = {e["type"].split(".")[2] + "." + e["type"].split(".")[3]: e for e in history}
        assert by_type["job.submitted"]["gpuorchactor"] == "alice"
        assert by_type["job.cancelled"]["gpuorchactor"] == "alice"
        events = (await client.get("/v1/events", params={"subject": "queue"})).json()
        assert [e["gpuorchactor"] for e in events] == ["admin"]
        tokens = (await client.get("/v1/events", params={"subject": "token"})).json()
        assert {(e["data"]["user"], e["gpuorchactor"]) for e in tokens} == {("alice", "admin")}
        rec = [r async for r in eventlog.replay(1, [f"gpuorch.events.job.{jid}"]) if r.data.TYPE == "job.cancelled"][0]
        assert event_line(rec).endswith("by=alice")


async def test_secret_env_values_are_stored_but_never_shown(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, services) :
        body = {**JOB, "env": {"HF_TOKEN": "s3cr3t-1", "EPOCHS": "3"}, "secret_env": {"DB_URL": "s3cr3t-2"}}
        r = await client.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        job = r.json()
        assert job["spec"]["env"] == {"EPOCHS": "3"}
        assert job["spec"]["secret_env"] == {"HF_TOKEN": "<redacted>", "DB_URL": "<redacted>"}
        shown = [(await client.get(f"/v1/jobs/{job['id']}")).text, (await client.get("/v1/jobs")).text,
                 (await client.get(f"/v1/jobs/{job['id']}/events")).text, (await client.get("/v1/events")).text]
        assert not any("s3cr3t" in text for text in shown)
        rec = [r async for r in eventlog.replay(1, [f"gpuorch.events.job.{job['id']}"])][0]
        assert "s3cr3t" not in event_line(rec)
        record = services["scheduler"].projection.jobs[job["id"]]
        assert record.spec.secret_env == {"HF_TOKEN": "s3cr3t-1", "DB_URL": "s3cr3t-2"}  # the agents get it from the log
        assert record.spec_json()["secret_env"] == record.spec.secret_env, \
            "the views masked a copy: the dump that snapshots keep is whole"


async def test_a_revoked_or_expired_token_is_refused(eventlog: EventLog):
    async with in_process_stack(eventlog) as (client, _):
        r = await client.post("/v1/tokens", json={"user": "temp", "role": "user", "expires_in_s": 60})
        token, tid = r.json()["token"], r.json()["id"]
        listed = (await client.get("/v1/tokens")).json()
        assert {t["id"] for t in listed} >= {tid} and not any("token" in t for t in listed)
        auth = {"authorization": f"Bearer {token}"}
        assert (await client.get("/v1/whoami", headers=auth)).json()["user"] == "temp"
        assert (await client.delete(f"/v1/tokens/{tid}")).status_code == 200
        client.app.state.auth.tokens._cache.clear()  # other processes notice within TokenStore.CACHE_S
        assert (await client.get("/v1/whoami", headers=auth)).status_code == 401
        store = client.app.state.auth.tokens
        await store.put("gpo_expired", "old", (), "user", expires_at=time.time() - 1)
        assert (await client.get("/v1/whoami", headers={"authorization": "Bearer gpo_expired"})).status_code == 401


async def test_every_token_is_listed_every_time_and_one_can_be_revoked(eventlog: EventLog):
    """nats-py's kv.keys() ends its listing when a consumer_info read says nothing is pending, which it also says
    of keys delivered but not yet handed over: with a few hundred tokens, lists came back short or empty, so
    `gpuorch tokens list` missed tokens and a revoke answered 404 for one that existed (CI: an empty list)."""
    store = TokenStore(eventlog)
    made = {rec.id for _, rec in await asyncio.gather(*(store.create(f"u{i}", [], "user") for i in range(250)))}
    for i in range(20):
        assert {r.id for _, r in await store.records()} == made, f"list {i}"
    gone = sorted(made)[0]
    assert (await store.revoke(gone)).id == gone
    assert {r.id for _, r in await store.records()} == made - {gone}


# --- OIDC -----------------------------------------------------------------------------------


class Issuer:
    """A local OIDC issuer: an RSA key, its JWKS served over HTTP, and tokens signed with it."""

    def __init__(self) -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.key.public_key()))
        body = json.dumps({"keys": [{**jwk, "kid": "k1", "use": "sig", "alg": "RS256"}]}).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.issuer = "https://idp.example"

    def token(self, key=None, **claims) -> str:
        now = int(time.time())
        base = {"iss": self.issuer, "aud": "gpuorch", "sub": "u-1", "iat": now, "exp": now + 300}
        return jwt.encode({**base, **claims}, key or self.key, algorithm="RS256", headers={"kid": "k1"})


@pytest.fixture
def issuer():
    i = Issuer()
    yield i
    i.server.shutdown()


async def test_oidc_jwts_from_the_configured_issuer_map_to_users_groups_and_roles(eventlog: EventLog, issuer: Issuer):
    settings = {"oidc_issuer": issuer.issuer, "oidc_audience": "gpuorch", "oidc_jwks_url": f"{issuer.url}/jwks",
                "oidc_admin_groups": ["platform"]}
    async with in_process_stack(eventlog, **settings) as (client, _):
        async def whoami(token: str) -> httpx.Response:
            return await client.get("/v1/whoami", headers={"authorization": f"Bearer {token}"})

        r = await whoami(issuer.token(preferred_username="dana", groups=["ml", "vision"]))
        assert r.json() == {"user": "dana", "groups": ["ml", "vision"], "role": "user", "via": "oidc"}
        assert (await whoami(issuer.token(preferred_username="pat", groups=["platform"]))).json()["role"] == "admin"
        assert (await whoami(issuer.token(gpuorch_role="operator"))).json()["role"] == "operator"
        bad = {
            "expired": issuer.token(exp=int(time.time()) - 3600),
            "other issuer": issuer.token(iss="https://evil.example"),
            "other audience": issuer.token(aud="someone-else"),
            "signed by another key": issuer.token(key=rsa.generate_private_key(public_exponent=65537, key_size=2048)),
            "unsigned": jwt.encode({"iss": issuer.issuer, "aud": "gpuorch", "sub": "x", "exp": int(time.time()) + 60},
                                   None, algorithm="none"),
        }
        for why, token in bad.items():
            r = await whoami(token)
            assert r.status_code == 401, (why, r.text)
        dana = {"authorization": f"Bearer {issuer.token(preferred_username='dana')}"}
        r = await client.post("/v1/jobs", json=JOB, headers=dana)
        assert r.status_code == 201 and r.json()["owner"] == "dana"
