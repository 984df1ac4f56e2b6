"""The stack as a user runs it: `gpuorch up` (one process and --split), Ctrl-C, restart, SIGKILL."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.workload import workload
from services.cli import verify_log
from services.stack import _write_split, may_send_again, resendable
from shared.eventlog import EventLog
from shared.natsauth import Credentials
from shared.natsd import free_port
from tests.support import wait_until


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] not in "ZX"
    except (OSError, IndexError):
        return False


REPO = Path(__file__).resolve().parents[1]
ENV = {**{k: v for k, v in os.environ.items() if k != "GPUORCH_URL"}, "PYTHONPATH": str(REPO)}


class Stack:
    def __init__(self, data_dir: Path, split: bool = False, nodes: str = "", cwd: Path | None = None):
        """``cwd``: start it there on its default data dir, .gpuorch (``data_dir`` is then that)."""
        self.data_dir, self.split, self.port, self.nodes, self.cwd = data_dir, split, free_port(), nodes, cwd
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30) -> "Stack":
        self.launch()
        wait_until(self.all_ready, timeout, "every service to be ready")
        return self

    def launch(self) -> "Stack":
        """Run `gpuorch up` without waiting for it."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(self.port), "--nodes", self.nodes]
        cmd += [] if self.cwd else ["--data-dir", str(self.data_dir)]
        with open(self.data_dir / "up.out", "ab") as out:
            self.proc = subprocess.Popen(cmd + (["--split"] if self.split else []), start_new_session=True,
                                         cwd=self.cwd, env=ENV, stdout=out, stderr=subprocess.STDOUT)
        return self

    @property
    def api(self) -> httpx.Client:
        """An HTTP client of this stack with its admin token (created by `gpuorch up` in its data dir)."""
        if getattr(self, "_api", None) is None:
            token = (self.data_dir / "auth" / "admin.token").read_text().strip()
            self._api = httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {token}"}, timeout=20)
        return self._api

    async def log(self) -> EventLog:
        """The stack's event log, with its control-plane bus credentials."""
        user = Credentials.of_data_dir(self.data_dir).control()
        return await EventLog.connect(self.info()["nats_url"], user=user.name, password=user.password)

    def services(self) -> list[dict]:
        return self.api.get("/v1/services").json()

    def all_ready(self) -> bool:
        try:
            s = self.services()
        except (httpx.HTTPError, ValueError, OSError):
            assert self.proc is not None and self.proc.poll() is None, (self.data_dir / "up.out").read_text()
            return False
        return len(s) == 5 and all(x.get("ready") for x in s)

    def info(self, name: str = "stack.json") -> dict:
        return json.loads((self.data_dir / name).read_text())

    def stop(self) -> int:
        """Ctrl-C, as a person would; then make sure nothing is left behind."""
        assert self.proc is not None
        info = self.info()
        children = list(self.info("split.json").values()) if self.split else []
        self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            for pid in [info.get("nats_pid"), *info.get("agent_pids", [])] + [c["pid"] for c in children]:
                if pid and alive(pid):
                    os.kill(pid, signal.SIGKILL)
        return code


@pytest.fixture
def stacks(tmp_path: Path) -> Iterator[list[Stack]]:
    made: list[Stack] = []
    yield made
    for s in made:
        if s.proc is not None and s.proc.poll() is None:
            s.stop()


def test_up_serves_the_api_and_a_second_up_resumes_the_same_state(tmp_path: Path, stacks: list[Stack]):
    first = Stack(tmp_path / "d")
    stacks.append(first)
    first.start()
    assert first.api.get(f"/healthz").json() == {"status": "ok"}
    r = first.api.put(f"/v1/queues/research.nlp", json={"guaranteed": {"gpus": 8}, "weight": 2})
    assert r.status_code == 200, r.text
    digests = {s["service"]: s["digest"] for s in first.services()}
    nats_pid = first.info()["nats_pid"]
    assert first.stop() == 0
    assert not alive(nats_pid), "Ctrl-C must stop the embedded nats-server too"

    second = Stack(tmp_path / "d", split=False)
    stacks.append(second)
    second.start()
    queues = {q["path"]: q for q in second.api.get(f"/v1/queues").json()}
    assert queues["research.nlp"]["weight"] == 2
    assert {s["service"]: s["digest"] for s in second.services()} == digests


def gpuorch(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=60)


def test_the_cli_runs_jobs_on_a_stack_started_on_its_default_data_dir(tmp_path: Path, stacks: list[Stack]):
    stack = Stack(tmp_path / ".gpuorch", nodes="t4-4x:1", cwd=tmp_path)
    stacks.append(stack)
    stack.start()
    wait_until(lambda: len(stack.api.get(f"/v1/nodes").json()) == 1, 30, "the node to register")
    ids = {}
    for name, script in (("ok", "echo hi"), ("bad", "exit 7"), ("big", "yes 0123456789 | head -n 300000; echo end")):
        out = gpuorch(tmp_path, "submit", "--url", stack.url, "--name", name, "--max-retries", "2", "--time-limit", "60",
                      "--json", "--", "sh", "-c", script)
        assert out.returncode == 0, out.stderr
        ids[name] = json.loads(out.stdout)["id"]

    def finished() -> dict[str, dict] | None:
        jobs = {j["name"]: j for j in json.loads(gpuorch(tmp_path, "jobs", "-a", "--json").stdout)}  # finds the stack here
        return jobs if all(jobs.get(n, {}).get("state") in ("succeeded", "failed") for n in ids) else None

    wait_until(finished, 30, "both jobs to finish")
    jobs = finished()
    assert jobs is not None
    assert jobs["ok"]["state"] == "succeeded", "a task's exit is read back although it runs in a relative data dir"
    assert (jobs["bad"]["state"], jobs["bad"]["exit_code"]) == ("failed", 7)
    assert stack.api.get(f"/v1/jobs/{ids['ok']}").json()["spec"]["max_retries"] == 2
    assert gpuorch(tmp_path, "logs", ids["ok"]).stdout == "hi\n"
    big = gpuorch(tmp_path, "logs", ids["big"]).stdout  # 3.3 MB: the API answers 1 MiB at a time
    assert (len(big), big[-15:]) == (300_000 * 11 + 4, "0123456789\nend\n"), "the whole log, not its first MiB"
    assert gpuorch(tmp_path, "logs", ids["big"], "--tail", "2").stdout == "0123456789\nend\n"
    assert gpuorch(tmp_path, "logs", ids["ok"], "-n", "5").stdout == "hi\n"
    # -f on a job that waits (here behind one holding the node's 4 GPUs): it waits for it to be placed, then follows
    first, second = (json.loads(gpuorch(tmp_path, "submit", "-g", "4", "--json", "--", "sh", "-c", script).stdout)["id"]
                     for script in ("sleep 600", "echo second"))
    err = tmp_path / "follow.err"
    with open(err, "w") as to_err:
        follow = subprocess.Popen([sys.executable, "-m", "services.cli", "logs", second, "-f"], cwd=tmp_path, env=ENV,
                                  stdout=subprocess.PIPE, stderr=to_err, text=True)
    try:
        wait_until(lambda: "will follow once it is placed" in " ".join(err.read_text().split()), 30, "logs -f to wait")
        assert f"{second} is queued" in err.read_text()
        assert stack.api.delete(f"/v1/jobs/{first}").status_code == 200
        assert follow.communicate(timeout=30)[0] == "second\n" and follow.returncode == 0, err.read_text()
    finally:
        follow.kill()
    history = gpuorch(tmp_path, "events", "replay")  # the running stack's own log, found from its data dir
    assert history.returncode == 0 and f"job/{ids['ok']}" in history.stdout and "job.succeeded" in history.stdout, history.stderr
    # elsewhere, with the API's URL and a token: the same history through the API (it used to answer "no event log
    # under .gpuorch"), and to follow it, the API's event stream
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**ENV, "GPUORCH_URL": stack.url, "GPUORCH_TOKEN": (tmp_path / ".gpuorch/auth/admin.token").read_text()}
    cli = [sys.executable, "-m", "services.cli", "events"]
    through_api = subprocess.run([*cli, "replay"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60)
    assert through_api.returncode == 0 and through_api.stdout.startswith(history.stdout), through_api.stderr
    with pytest.raises(subprocess.TimeoutExpired) as followed:  # it follows until interrupted
        subprocess.run([*cli, "tail", "--from", "1"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=5)
    assert (followed.value.stdout or b"").decode().startswith(history.stdout)

    out = gpuorch(tmp_path, "inject-xid", "t4-4x-0", "79", "--gpu", "1", "--url", stack.url)
    assert out.returncode == 0, out.stderr
    node = "/v1/nodes/t4-4x-0"
    wait_until(lambda: stack.api.get(node).json()["gpus"][1]["health"] == "unhealthy", 20, "the GPU to be marked")
    # the health service decides the drain on the GPU's event: a separate event, folded a moment later
    wait_until(lambda: stack.api.get(node).json()["state"] in ("draining", "cordoned"), 20, "the node to drain")
    out = gpuorch(tmp_path, "inject-xid", "t4-4x-0", "79", "--gpu", "9", "--url", stack.url)
    assert out.returncode != 0 and "has no GPU 9" in out.stderr


def test_ctrl_c_while_the_stack_starts_stops_it_and_leaves_nothing_behind(tmp_path: Path):
    data = tmp_path / "d"
    data.mkdir()
    out = data / "up.out"
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", str(free_port()), "--data-dir", str(data),
                             "--nodes", "t4-4x:1"], env=ENV, start_new_session=True, stdout=open(out, "ab"),
                            stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "event=agents_started" in out.read_text(), 30, "the agents to be started")
        proc.send_signal(signal.SIGINT)  # services are connecting and replaying: not serving yet
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    info = json.loads((data / "stack.json").read_text())
    assert code == 0, out.read_text()  # its handlers are installed at its first line: never a KeyboardInterrupt
    assert "Traceback" not in out.read_text()
    wait_until(lambda: not any(alive(p) for p in [info["nats_pid"], *info.get("agent_pids", [])]), 15,
               "the nats-server and the agents to stop")


def test_up_holds_its_api_port_from_its_start_and_refuses_one_in_use(tmp_path: Path, stacks: list[Stack]):
    """The API's port is bound before the nats-server and the services start: while they start, the stack opens
    connections whose local ports come from the same range, and one of them once took the port the gateway was
    about to bind (CI: `address already in use`, the stack down). A port in use is refused with a reason."""
    stack = Stack(tmp_path / "d", split=True)
    stacks.append(stack)
    stack.launch()
    wait_until(lambda: (stack.data_dir / "stack.json").exists() and stack.info().get("nats_pid"), 30,
               "the nats-server to be started")
    assert not stack.all_ready()  # the services are still starting: nothing serves the API yet
    with socket.socket() as s, pytest.raises(OSError) as taken:
        s.bind(("127.0.0.1", stack.port))
    assert taken.value.errno == errno.EADDRINUSE
    wait_until(stack.all_ready, 30, "every service to be ready")
    out = subprocess.run([sys.executable, "-m", "services.cli", "up", "--port", str(stack.port), "--data-dir",
                          str(tmp_path / "other")], capture_output=True, text=True, timeout=30, env=ENV)
    assert out.returncode != 0 and f"port {stack.port} is in use" in out.stderr, out.stderr
    assert stack.stop() == 0


def test_a_second_up_on_a_running_data_dir_is_refused_with_a_reason(tmp_path: Path, stacks: list[Stack]):
    first = Stack(tmp_path / "d")
    stacks.append(first)
    first.start()
    out = subprocess.run([sys.executable, "-m", "services.cli", "up", "--port", str(free_port()), "--data-dir", str(tmp_path / "d")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert "another gpuorch stack is running" in out.stderr


def test_the_split_gateway_forwards_each_path_to_its_service(tmp_path: Path, stacks: list[Stack]):
    stack = Stack(tmp_path / "d", split=True, nodes="t4-4x:1")
    stacks.append(stack)
    stack.start()
    for method, path in (("PUT", "/v1/queues/research"), ("GET", "/v1/events"), ("GET", "/v1/services"), ("GET", "/v1/jobs")):
        r = httpx.request(method, f"{stack.url}{path}", json={})
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), (path, r.text)
    r = stack.api.put(f"/v1/queues/research", json={"guaranteed": {"gpus": 2}, "weight": 2})
    assert r.status_code == 200, r.text
    wait_until(lambda: len(stack.api.get(f"/v1/nodes").json()) == 1, 30, "the node to register")
    r = stack.api.post(f"/v1/jobs", json={"name": "hi", "queue": "research", "resources": {"gpus": 1},
                                                 "command": ["sh", "-c", "echo hi"]})
    assert r.status_code in (200, 201, 202), r.text
    job = r.json()["id"]
    wait_until(lambda: stack.api.get(f"/v1/jobs/{job}").json()["state"] == "succeeded", 30, "the job to succeed")
    assert stack.api.get(f"/v1/jobs/{job}/logs").json()["data"] == "hi\n"
    both = stack.api.get("/v1/jobs", params=[("state", "succeeded"), ("state", "running")])
    assert [j["id"] for j in both.json()] == [job], "a repeated parameter reaches the service whole"
    r = stack.api.post(f"/v1/jobs", json={"name": "bad", "queue": "nope", "resources": {"gpus": 1}, "command": ["true"]})
    assert r.status_code == 422 and "nope" in r.text, "the scheduler's own refusal, through the gateway"
    assert stack.api.post(f"/v1/nodes/t4-4x-0/cordon", json={"reason": "test"}).status_code == 200
    wait_until(lambda: stack.api.get(f"/v1/nodes/t4-4x-0").json()["state"] == "cordoned", 15, "the cordon")
    assert stack.api.get(f"/v1/queues").status_code == 200 and stack.api.get(f"/v1/pools").status_code == 200
    assert stack.stop() == 0


def test_the_gateway_sends_again_only_what_cannot_have_been_acted_on():
    refused, cut, late = httpx.ConnectError("refused"), httpx.ReadError(""), httpx.ReadTimeout("slow")
    assert all(may_send_again(m, refused) for m in ("GET", "POST", "PUT", "DELETE", "PATCH")), "nothing was sent"
    assert may_send_again("GET", cut) and may_send_again("PUT", httpx.RemoteProtocolError("gone"))
    assert may_send_again("DELETE", httpx.WriteError(""))
    assert not may_send_again("POST", cut) and not may_send_again("PATCH", cut), "it may have been acted on"
    assert not may_send_again("GET", late), "a slow service is not a dead one"
    assert may_send_again("POST", cut, safe_post=True), "a submission with its Idempotency-Key is recorded once"
    assert not may_send_again("POST", late, safe_post=True)


def listed_ids(stack: Stack, name: str) -> list[str]:
    """Every job of this name, through the pages of GET /v1/jobs."""
    ids, params = [], {"name": name, "limit": 500}
    while True:
        r = stack.api.get("/v1/jobs", params=params)
        assert r.status_code == 200, r.text
        ids += [j["id"] for j in r.json()]
        if "x-next-cursor" not in r.headers:
            return ids
        params["cursor"] = r.headers["x-next-cursor"]


def test_a_submission_cut_off_by_its_dying_service_is_sent_again_and_recorded_once(tmp_path: Path,
                                                                                  stacks: list[Stack]):
    """A batch POST that the scheduler had read, and maybe recorded in part, when it was SIGKILLed: the gateway
    sends it again with the key it gave it, to the scheduler started again, and every job is recorded once (it
    was answered 503 before). Kills land at several moments until one cuts a request off in flight."""
    stack = Stack(tmp_path / "d", split=True)
    stacks.append(stack)
    stack.start()
    out, batch = stack.data_dir / "up.out", 1000
    for attempt, delay in enumerate((0.1, 0.2, 0.35, 0.05, 0.5, 0.15, 0.25, 0.3)):
        name, victim = f"cut-{attempt}", stack.info("split.json")["scheduler"]["pid"]
        seen = len(out.read_text().splitlines())
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            body = [{"name": name, "resources": {"gpus": 0}, "command": ["true"]}] * batch
            answer = pool.submit(stack.api.post, "/v1/jobs", json=body, timeout=60)
            time.sleep(delay)
            os.kill(victim, signal.SIGKILL)
            r = answer.result()
        assert r.status_code == 201, r.text
        ids = [j["id"] for j in r.json()]
        assert len(set(ids)) == batch
        assert sorted(listed_ids(stack, name)) == sorted(ids), "a job recorded twice, or not at all"
        again = [line for line in out.read_text().splitlines()[seen:] if "event=forward_again" in line]
        if any("method=POST" in line and ("ReadError" in line or "RemoteProtocolError" in line) for line in again):
            break  # this one was cut off in flight, and sent again
        wait_until(lambda: running(stack.info("split.json")["scheduler"]["pid"]) and stack.all_ready(), 30,
                   "the scheduler to be started again")
    else:
        pytest.fail("no kill cut a submission off in flight")
    assert stack.stop() == 0


def test_the_gateway_gives_each_submission_a_key_and_keeps_the_clients():
    headers: dict[str, str] = {}
    assert resendable("POST", "/v1/jobs", headers) and headers["idempotency-key"].startswith("gateway-")
    other: dict[str, str] = {}
    assert resendable("POST", "/v1/jobs", other) and other["idempotency-key"] != headers["idempotency-key"]
    mine = {"idempotency-key": "mine"}
    assert resendable("POST", "/v1/jobs/", mine) and mine == {"idempotency-key": "mine"}
    for method, path in (("POST", "/v1/queues"), ("GET", "/v1/jobs"), ("DELETE", "/v1/jobs/j-1"),
                         ("POST", "/v1/tokens"), ("POST", "/v1/nodes/n1/drain"), ("POST", "/v1/nodes/n1/inject-xid"),
                         ("POST", "/v1/nodes/n1/cordon/x")):
        untouched: dict[str, str] = {}
        assert not resendable(method, path, untouched) and untouched == {}, (method, path)
    for path in ("/v1/nodes/n1/cordon", "/v1/nodes/n1/resume", "/v1/deployments/chat/metrics"):
        untouched = {}
        assert resendable("POST", path, untouched) and untouched == {}, f"{path}: idempotent by design"


def test_split_json_is_never_read_half_written_while_a_service_restart_rewrites_it(tmp_path: Path):
    """CI read it empty once, as the supervisor rewrote it in place after a restart (write_text truncates first)."""
    from types import SimpleNamespace
    from shared.settings import Settings
    settings, written = Settings(data_dir=tmp_path), threading.Event()

    def restarts() -> None:
        for pid in range(2, 3000):
            _write_split(settings, {"scheduler": 8001}, {"scheduler": SimpleNamespace(pid=pid)})
            written.set()
    writer = threading.Thread(target=restarts)
    writer.start()
    written.wait(5)
    unreadable = 0
    while writer.is_alive():
        try:
            json.loads((tmp_path / "split.json").read_text())
        except ValueError:
            unreadable += 1
    writer.join()
    assert unreadable == 0, f"{unreadable} reads found split.json half written"


def test_a_request_for_a_split_service_that_is_being_restarted_waits_for_it(tmp_path: Path, stacks: list[Stack]):
    """The gateway sends a request again while a dead service is started again: any request its port refused
    (nothing was sent), an idempotent one also when a kept-alive connection to the dead service cut it off. A
    submission during a restart is accepted, not answered 503."""
    stack = Stack(tmp_path / "d", split=True)
    stacks.append(stack)
    stack.start()
    victim = stack.info("split.json")["scheduler"]["pid"]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: not running(victim), 10, "the scheduler to be dead")  # its sockets closed, not yet restarted
    r = stack.api.get("/v1/jobs")
    assert r.status_code == 200, r.text
    assert stack.info("split.json")["scheduler"]["pid"] != victim, "answered by the new scheduler"
    os.kill(victim := stack.info("split.json")["scheduler"]["pid"], signal.SIGKILL)
    wait_until(lambda: not running(victim), 10, "the new scheduler to be dead")
    wait_until(lambda: stack.info("split.json")["scheduler"]["pid"] != victim, 10, "a third to be started")
    during = {"name": "during", "resources": {"gpus": 0}, "command": ["true"]}
    r = stack.api.post("/v1/jobs", json=during, headers={"Idempotency-Key": "during-1"})
    assert r.status_code == 201, r.text
    assert stack.api.get(f"/v1/jobs/{r.json()['id']}").json()["name"] == "during"
    again = stack.api.post("/v1/jobs", json=during, headers={"Idempotency-Key": "during-1"})
    assert again.json()["id"] == r.json()["id"] and again.headers.get("idempotent-replayed") == "true", \
        "the gateway passes the key on, and the answer's header back"
    assert stack.stop() == 0


@pytest.mark.slow
def test_split_service_killed_mid_stream_rebuilds_the_same_state(tmp_path: Path, stacks: list[Stack]):
    stack = Stack(tmp_path / "d", split=True)
    stacks.append(stack)
    stack.start()
    victim = stack.info("split.json")["scheduler"]["pid"]
    envs = list(workload(3000))

    async def write_and_kill() -> None:
        log = await stack.log()
        try:
            for i in range(0, len(envs), 100):
                await log.append_many(envs[i : i + 100])
                if i == 1000:
                    os.kill(victim, signal.SIGKILL)  # while events flow
                await asyncio.sleep(0.02)
        finally:
            await log.close()

    async def log_head() -> int:
        log = await stack.log()
        try:
            return await log.last_seq()
        finally:
            await log.close()

    async def replay_all() -> list[dict]:
        log = await stack.log()
        try:
            return await verify_log(log)
        finally:
            await log.close()

    asyncio.run(write_and_kill())
    wait_until(lambda: stack.info("split.json")["scheduler"]["pid"] != victim, 20, "the supervisor to restart the scheduler")
    # the scheduler's own reactions append a little more: wait until every service holds the log's head
    wait_until(lambda: {s.get("seq") for s in stack.services()} == {asyncio.run(log_head())}, 30, "every service to catch up")
    live = {s["service"]: s for s in stack.services()}
    replayed = asyncio.run(replay_all())
    for fresh in replayed:
        assert live[fresh["service"]]["digest"] == fresh["digest"], fresh["service"]
        assert live[fresh["service"]]["applied"] == fresh["applied"]  # none applied twice, none missed
    assert stack.stop() == 0


def test_schemathesis_with_the_admin_token_finds_nothing_the_openapi_document_does_not_say(tmp_path: Path,
                                                                                           stacks: list[Stack]):
    """Every operation, authenticated (so requests reach the handlers), fuzzed with every check: never a 5xx, every
    status and body as documented, what the schema allows accepted and what it forbids refused (except the refusals
    tests/schemathesis.toml names, which depend on state or on two fields together). No nodes, so nothing it submits
    runs; pools are left out (a simulated pool would start real agent processes)."""
    stack = Stack(tmp_path / "d")
    stacks.append(stack)
    stack.start()
    token = (stack.data_dir / "auth" / "admin.token").read_text().strip()
    out = subprocess.run([str(Path(sys.executable).parent / "schemathesis"), "--config-file",
                          str(REPO / "tests" / "schemathesis.toml"), "run", f"{stack.url}/openapi.json",
                          "-H", f"Authorization: Bearer {token}", "--checks", "all", "--max-examples", "5",
                          "--exclude-path", "/v1/events/stream", "--exclude-path", "/v1/pools/{name}", "--seed", "1",
                          "--no-color"], capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-6000:]
    assert stack.stop() == 0
