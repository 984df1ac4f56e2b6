"""The dashboard's pages without a browser: who may open what, and that a page shows what the API shows its caller."""

from __future__ import annotations

import contextlib
import re

import httpx

from services.dashboard import dashboard_router
from shared import events as ev
from shared.auth import COOKIE_ROUTES, ROUTE_ROLES
from shared.cluster import agent_source
from shared.eventlog import EventLog
from shared.events import Envelope
from tests.builders import node
from tests.support import as_user, in_process_stack, nodes_up, until

PAGES = ("/", "/ui/queues", "/ui/jobs", "/ui/jobs/j-none", "/ui/events")
JOB = {"name": "j", "resources": {"gpus": 0}, "command": ["sleep", "60"]}


@contextlib.asynccontextmanager
async def dashboard(eventlog: EventLog):
    """The in-process stack with the dashboard mounted, as `gpuorch up` serves it."""
    async with in_process_stack(eventlog, heartbeat_timeout_s=3600) as (client, services):
        client.app.include_router(dashboard_router(lambda: eventlog))
        yield client, services


def browser(client: httpx.AsyncClient, **kw) -> httpx.AsyncClient:
    """A client that sends what a browser sends: no Authorization header."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=client.app), base_url="http://gpuorch", **kw)


async def login(client: httpx.AsyncClient, user: str, role: str = "user") -> httpx.AsyncClient:
    token = (await client.post("/v1/tokens", json={"user": user, "role": role})).json()["token"]
    b = browser(client)
    r = await b.post("/ui/login", content=f"token={token}&next=/ui/jobs",
                     headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 303 and r.headers["location"] == "/ui/jobs", r.text
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Max-Age=43200" in cookie, cookie
    return b


def test_every_dashboard_route_is_in_the_role_table_and_only_its_get_routes_take_the_cookie():
    router = dashboard_router(lambda: None)
    routes = {(m, r.path) for r in router.routes for m in r.methods}
    assert routes <= set(ROUTE_ROLES), routes - set(ROUTE_ROLES)
    assert COOKIE_ROUTES <= routes and all(m == "GET" for m, _ in COOKIE_ROUTES)
    assert not any(p.startswith("/v1/") for _, p in COOKIE_ROUTES)


async def test_a_browser_without_a_session_gets_the_login_form_and_the_cookie_opens_only_the_dashboard(eventlog: EventLog):
    async with dashboard(eventlog) as (client, _):
        anonymous = browser(client)
        for page in PAGES:
            r = await anonymous.get(page)
            assert r.status_code == 401 and 'name="token"' in r.text, (page, r.status_code)
            assert r.headers["www-authenticate"].startswith("Bearer")
        assert (await anonymous.get("/ui/static/app.js")).status_code == 200
        bad = await anonymous.post("/ui/login", content="token=gpo_nope", headers={"content-type": "application/x-www-form-urlencoded"})
        assert bad.status_code == 422 and "token refused" in bad.text and "set-cookie" not in bad.headers
        forged = await anonymous.post("/ui/login", content="token=x", headers={
            "content-type": "application/x-www-form-urlencoded", "origin": "https://evil.example"})
        assert forged.status_code == 403
        alice = await login(client, "alice")
        assert (await alice.get("/ui/jobs")).status_code == 200
        assert (await alice.get("/v1/jobs")).status_code == 401  # the API takes bearer tokens only
        assert (await alice.get("/ui/events")).status_code == 403  # as /v1/events/stream: operators
        r = await alice.post("/ui/logout")
        assert r.status_code == 303 and 'gpuorch_session=""' in r.headers["set-cookie"]


async def test_a_user_sees_their_own_jobs_and_an_operator_sees_everyones(eventlog: EventLog):
    async with dashboard(eventlog) as (client, _):
        alice_api, bob_api = await as_user(client, "alice"), await as_user(client, "bob")
        mine = (await alice_api.post("/v1/jobs", json={**JOB, "name": "alices-job"})).json()["id"]
        theirs = (await bob_api.post("/v1/jobs", json={**JOB, "name": "bobs-job"})).json()["id"]
        alice, olga = await login(client, "alice"), await login(client, "olga", "operator")
        page = (await alice.get("/ui/jobs?state=all")).text
        assert mine in page and theirs not in page
        assert (await alice.get(f"/ui/jobs/{theirs}")).status_code == 404
        page = (await olga.get("/ui/jobs?state=all")).text
        assert mine in page and theirs in page and ">User<" in page
        async def has_a_reason():  # the reason is the scheduler's, logged by its cycle after the submission
            return (await client.get(f"/v1/jobs/{mine}")).json()["reason"]
        await until(has_a_reason, 10, "the scheduler to say why the job waits")
        r = await alice.get(f"/ui/jobs/{mine}")
        assert r.status_code == 200 and "alices-job" in r.text and "Why it waits" in r.text, r.text[-3000:]
        assert (await olga.get("/ui/events")).status_code == 200


async def test_a_job_page_shows_the_end_of_a_long_log_and_says_so(eventlog: EventLog, agents):
    async with dashboard(eventlog) as (client, _):
        agents("a")
        await nodes_up(client, 1)
        # 700,000 bytes: the page showed the first MiB, all of it
        lines = {**JOB, "command": ["sh", "-c", "seq -w 1 100000"]}
        job_id = (await client.post("/v1/jobs", json=lines)).json()["id"]

        async def ended():
            return (await client.get(f"/v1/jobs/{job_id}")).json()["state"] == "succeeded"
        await until(ended, 30, "the job to print its lines")
        page = (await (await login(client, "olga", "operator")).get(f"/ui/jobs/{job_id}")).text
        shown = re.search(r'<pre class="logs"[^>]*>(.*?)</pre>', page, re.S).group(1)
        assert shown.endswith("\n099999\n100000\n") and len(shown) <= 64 << 10, shown[-50:]
        hint = re.search(r'<p class="hint">Task 0 stdout.*?</p>', page, re.S).group(0)
        assert "its last 65536 bytes of 700000" in hint and 'data-offset="700000"' in page, hint


async def test_the_cluster_page_shows_each_gpu_by_state_with_the_xid_of_a_sick_one(eventlog: EventLog):
    async with dashboard(eventlog) as (client, services):
        for n in ("a1", "a2"):
            info = node(n).gpus(4).rack("r1").build()
            await eventlog.append(Envelope(ev.NodeRegistered(node_id=n, node=info), source=agent_source(n)))
        await until(lambda: _n(client, 2), what="two nodes")
        uuid = services["inventory"].projection.nodes["a2"].info.gpus[1].uuid
        await eventlog.append(Envelope(ev.GpuUnhealthy(node_id="a2", gpu_uuid=uuid, kind="xid", xid=79,
                                                       detail="fell off the bus"), source="/gpuorch/health"))
        admin = browser(client, headers={"authorization": client.headers["authorization"]})
        async def sick():
            return "xid" in (await admin.get("/")).text
        await until(sick, what="the sick GPU on the page")
        page = (await admin.get("/")).text
        assert len(re.findall(r'class="g s-free"', page)) >= 6
        assert re.search(r'id="node-a2".*?s-unhealthy" title="[^"]*xid', page, re.S)


async def _n(client, n):
    return len((await client.get("/v1/nodes")).json()) >= n


def test_the_split_gateway_serves_the_dashboard_over_its_services(tmp_path):
    from tests.support import wait_until
    from tests.test_stack import Stack

    stack = Stack(tmp_path / "d", split=True, nodes="t4-4x:1").start(timeout=60)
    try:
        wait_until(lambda: len(stack.api.get("/v1/nodes").json()) == 1, 30, "the node to register")
        job = stack.api.post("/v1/jobs", json={**JOB, "name": "via-gateway"}).json()
        token = (stack.data_dir / "auth" / "admin.token").read_text().strip()
        with httpx.Client(base_url=stack.url, timeout=20) as b:
            r = b.post("/ui/login", content=f"token={token}&next=/",
                       headers={"content-type": "application/x-www-form-urlencoded"})
            assert r.status_code == 303, r.text
            cluster = b.get("/")
            assert cluster.status_code == 200 and 'id="node-t4-4x-0"' in cluster.text
            assert job["id"] in b.get("/ui/jobs?state=all").text
            assert "Why it waits" in b.get(f"/ui/jobs/{job['id']}").text or job["id"] in b.get(f"/ui/jobs/{job['id']}").text
            assert b.get("/ui/queues").status_code == 200
    finally:
        assert stack.stop() == 0
