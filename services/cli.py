"""The `gpuorch` command."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from shared.eventlog import EventLog, Record, Undecodable
from shared.events import export_schemas
from shared.natsd import NatsServer
from shared.settings import Settings

from services import stack

app = typer.Typer(add_completion=False, no_args_is_help=True, help="gpuorch: a GPU cluster orchestrator.")
events_app = typer.Typer(no_args_is_help=True, help="The event log: follow, replay, verify, export schemas.")
app.add_typer(events_app, name="events")
console = Console(width=None if sys.stdout.isatty() else 250)  # piped output is never cut to 80 columns
err = Console(stderr=True)

NatsOpt = Annotated[str | None, typer.Option("--nats", help="NATS URL of a running stack")]
DataDirOpt = Annotated[Path | None, typer.Option("--data-dir", help="a stopped stack's data dir (nats-server is started on it)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]


def fail(message: str, code: int = 1) -> None:
    err.print(f"[red]error:[/red] {message}")
    raise typer.Exit(code)


@app.command()
def up(
    port: Annotated[int, typer.Option(help="HTTP API port")] = 8080,
    data_dir: Annotated[Path, typer.Option(help="where the event log and logs live")] = Path(".gpuorch"),
    split: Annotated[bool, typer.Option("--split", help="one OS process per service")] = False,
    nats: Annotated[str | None, typer.Option("--nats", help="use this NATS instead of the embedded one")] = None,
    sync_always: Annotated[bool, typer.Option(help="fsync every write (slower; no acked write lost on power loss)")] = False,
    snapshot_every: Annotated[int, typer.Option(help="snapshot projections every N events")] = 10_000,
    nodes: Annotated[str, typer.Option(help="simulated nodes to start, profile:count,... ('' for none)")] = Settings().nodes,
    policy: Annotated[str, typer.Option(help="placement policy: fgd+ (default), fgd, bestfit, binpack, spread, random")] = "fgd+",
) -> None:
    """Start the whole stack: embedded nats-server, every service, simulated nodes, the HTTP API. Ctrl-C stops it."""
    stack.up(
        Settings(port=port, data_dir=data_dir, nats_url=nats, sync_always=sync_always, snapshot_every=snapshot_every,
                 nodes=nodes, policy=policy),
        split=split,
    )


@app.command()
def agent(
    node_id: Annotated[str, typer.Option("--node-id", help="this node's name")],
    backend: Annotated[str, typer.Option(help="nvml (real GPUs) or simulated")] = "nvml",
    profile: Annotated[str, typer.Option(help="simulated node profile: dgx-h100, hgx-a100-40gb, a100-pcie-2x2, l4-8x, t4-4x")] = "dgx-h100",
    labels: Annotated[list[str] | None, typer.Option("--labels", help="k=v (repeatable, or comma-separated)")] = None,
    rack: Annotated[str, typer.Option()] = "",
    zone: Annotated[str, typer.Option()] = "",
    nats: Annotated[str, typer.Option("--nats", envvar="GPUORCH_NATS_URL", help="NATS URL")] = "nats://127.0.0.1:4222",
    port: Annotated[int, typer.Option(help="the agent's HTTP port (task logs)")] = 8090,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    address: Annotated[str, typer.Option(help="address gang peers use to reach this node")] = "127.0.0.1",
    work_dir: Annotated[Path, typer.Option(help="task directories and logs")] = Path(".gpuorch-agent"),
    pool: Annotated[str | None, typer.Option(help="node pool this node belongs to")] = None,
    kill_tasks_on_exit: Annotated[bool, typer.Option(help="SIGKILL every task when the agent stops (simulated nodes)")] = False,
) -> None:
    """Run the node agent: discover GPUs, register, heartbeat, stream telemetry, run placed tasks."""
    from services.inventory.agent import run_agent
    from services.inventory.discovery import NvmlUnavailable, discover_nvml
    from services.inventory.nvml_fake import FakeNvml
    from shared.profiles import UnknownProfile, build

    pairs = [kv for item in labels or [] for kv in item.split(",") if kv]
    if any("=" not in kv for kv in pairs):
        fail("--labels takes k=v")
    label_map = dict(kv.split("=", 1) for kv in pairs)
    try:
        if backend == "simulated":
            node = build(profile, node_id, labels=label_map, rack=rack, zone=zone)
            nvml: Any = FakeNvml(node)
            nvml.nvmlInit()
        elif backend == "nvml":
            import pynvml

            node = discover_nvml(pynvml, node_id=node_id, labels=label_map, rack=rack, zone=zone)
            pynvml.nvmlInit()
            nvml = pynvml
        else:
            fail(f"--backend is nvml or simulated, not {backend!r}")
    except UnknownProfile as e:
        fail(str(e))
    except NvmlUnavailable as e:
        fail(f"{e} (use --backend simulated on a machine without GPUs)")
    node = node.model_copy(update={"address": address, "agent_url": f"http://{host}:{port}", "pool": pool,
                                   "hostname": node.hostname or node_id})
    stack.setup_logging(Settings().log_level)
    asyncio.run(run_agent(node, nats, host, port, work_dir, nvml, kill_tasks_on_exit=kill_tasks_on_exit))


@app.command()
def gateway(
    nats: Annotated[str, typer.Option("--nats", help="NATS URL")],
    service: Annotated[list[str], typer.Option("--service", help="NAME=URL of a service process, once per service")],
    port: Annotated[int, typer.Option(help="HTTP API port")] = 8080,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
) -> None:
    """Serve the API on one port in front of services running in their own processes or containers."""
    upstreams = dict(s.split("=", 1) for s in service if "=" in s)
    unknown = set(upstreams) - set(stack.SERVICES)
    if unknown or len(upstreams) != len(service):
        fail(f"--service takes NAME=URL with NAME one of {', '.join(stack.SERVICES)}")
    settings = Settings(nats_url=nats, port=port, host=host)
    stack.setup_logging(settings.log_level)
    asyncio.run(stack.serve_gateway(settings, nats, upstreams))


# --- API client ----------------------------------------------------------------------

UrlOpt = Annotated[str, typer.Option("--url", envvar="GPUORCH_URL",
                                     help="gpuorch API (default: the stack running on ./.gpuorch, else this)")]
DEFAULT_URL = "http://127.0.0.1:8080"


def resolve_url(url: str, data_dir: Path = Path(".gpuorch")) -> str:
    """The default URL means "the stack running here": its API, wherever `gpuorch up --port` put it."""
    if url != DEFAULT_URL or not stack_running(data_dir):
        return url
    try:
        return str(json.loads((data_dir / "stack.json").read_text())["api"])
    except (OSError, ValueError, KeyError):
        return url


def stack_running(data_dir: Path) -> bool:
    """A stack holds the data dir's lock while it runs."""
    import fcntl

    try:
        with open(data_dir / "stack.lock", "rb") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fh, fcntl.LOCK_UN)
    except OSError:
        pass
    return False


def api(method: str, url: str, path: str, **kw: Any) -> Any:
    """Call the API; turn every failure into a message a person can act on."""
    import httpx

    url = resolve_url(url)
    try:
        resp = httpx.request(method, url.rstrip("/") + path, timeout=30, **kw)
    except httpx.HTTPError as e:
        fail(f"cannot reach gpuorch at {url} ({type(e).__name__}): is `gpuorch up` running? (--url or GPUORCH_URL)")
    if resp.status_code >= 400:
        try:
            detail = resp.json().get("detail", resp.text)
        except ValueError:
            detail = resp.text
        if isinstance(detail, list):  # FastAPI validation errors: one line per bad field
            detail = "\n  ".join(
                f"{'.'.join(str(p) for p in d.get('loc', [])[1:]) or 'body'}: {d.get('msg', d)}" for d in detail
            )
            detail = "invalid request:\n  " + detail
        fail(f"{detail} (HTTP {resp.status_code})")
    return resp.json()


def age(ts: float | None, now: float) -> str:
    if not ts:
        return "-"
    s = int(max(0, now - ts))
    return f"{s // 86400}d{s % 86400 // 3600}h" if s >= 86400 else f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


# --- jobs ------------------------------------------------------------------------------


@app.command()
def submit(
    command: Annotated[list[str] | None, typer.Argument(help="the command each task runs")] = None,
    file: Annotated[Path | None, typer.Option("-f", "--file", help="a job as YAML/JSON, or an sbatch script")] = None,
    name: Annotated[str | None, typer.Option(help="job name")] = None,
    queue: Annotated[str | None, typer.Option("-q", "--queue", help="leaf queue, e.g. research.nlp")] = None,
    priority: Annotated[str | None, typer.Option(help="critical|high|normal|low")] = None,
    tasks: Annotated[int | None, typer.Option("-n", "--tasks", help="gang size: all start together or none")] = None,
    gpus: Annotated[float | None, typer.Option("-g", "--gpus", help="GPUs per task: whole, or a fraction below 1")] = None,
    cpu: Annotated[int | None, typer.Option(help="milli-CPU per task")] = None,
    memory: Annotated[int | None, typer.Option(help="MiB per task")] = None,
    model: Annotated[list[str] | None, typer.Option(help="allowed GPU model (repeatable)")] = None,
    mig: Annotated[str | None, typer.Option(help="MIG profile, e.g. 1g.10gb")] = None,
    topology: Annotated[str | None, typer.Option(help="nvlink|node|rack|zone|any")] = None,
    time_limit: Annotated[int | None, typer.Option(help="seconds")] = None,
    max_retries: Annotated[int | None, typer.Option(help="times to requeue it after its node is lost (0)")] = None,
    env: Annotated[list[str] | None, typer.Option("-e", "--env", help="K=V (repeatable)")] = None,
    url: UrlOpt = DEFAULT_URL,
    as_json: JsonOpt = False,
) -> None:
    """Submit a job from flags, a YAML/JSON file, or an sbatch script."""
    from services.jobfile import JobFileError, load_job_file

    try:
        body: dict[str, Any] = load_job_file(file) if file else {}
    except JobFileError as e:
        fail(str(e))
    flags = {"name": name, "queue": queue, "priority": priority, "tasks": tasks, "topology": topology, "time_limit_s": time_limit,
             "max_retries": max_retries}
    body.update({k: v for k, v in flags.items() if v is not None})
    res = body.setdefault("resources", {})
    for k, v in (("gpus", gpus), ("cpu_milli", cpu), ("memory_mib", memory)):
        if v is not None:
            res[k] = int(v) if k == "gpus" and v == int(v) else v
    if model or mig:
        body.setdefault("gpu", {}).update({k: v for k, v in (("models", model), ("mig", mig)) if v})
    if env:
        bad = [e for e in env if "=" not in e]
        if bad:
            fail(f"--env takes K=V, got {bad[0]!r}")
        body.setdefault("env", {}).update(dict(e.split("=", 1) for e in env))
    if command:
        body["command"] = command
    if "name" not in body:
        body["name"] = (Path(body["command"][0]).name if body.get("command") else "job")[:63] or "job"
    job = api("POST", url, "/v1/jobs", json=body)
    if as_json:
        print_json(job)
    else:
        console.print(f"submitted [bold]{job['id']}[/bold] ({job['name']}) to queue {job['queue']}: {job['state']}")


@app.command()
def jobs(
    queue: Annotated[str | None, typer.Option("-q", "--queue")] = None,
    state: Annotated[str | None, typer.Option("-s", "--state")] = None,
    all_: Annotated[bool, typer.Option("--all", "-a", help="include finished jobs")] = False,
    limit: Annotated[int, typer.Option(min=1)] = 200,
    url: UrlOpt = DEFAULT_URL,
    as_json: JsonOpt = False,
) -> None:
    """List jobs, like squeue."""
    import time

    from rich.table import Table

    params = {k: v for k, v in (("queue", queue), ("state", state), ("limit", limit if (state or all_) else 100_000)) if v}
    rows = api("GET", url, "/v1/jobs", params=params)
    if not (all_ or state):
        rows = [j for j in rows if j["state"] not in ("succeeded", "failed", "cancelled", "rejected")][:limit]
    if as_json:
        print_json(rows)
        return
    now = time.time()
    table = Table(box=None, header_style="bold")
    for col in ("ID", "NAME", "QUEUE", "STATE", "TASKSxGPUS", "NODES", "AGE", "REASON"):
        table.add_column(col, overflow="fold" if col == "REASON" else "ellipsis", no_wrap=col != "REASON")
    for j in rows:
        nodes = ",".join(sorted({p["node"] for p in j["placement"]})) or "-"
        g = j["gpus_per_task"]
        table.add_row(j["id"], j["name"], j["queue"], j["state"], f"{j['tasks']}x{int(g) if g == int(g) else g}", nodes,
                      age(j["submitted_at"], now), j["reason"] or "")
    console.print(table)


@app.command()
def cancel(job_id: Annotated[str, typer.Argument()], url: UrlOpt = DEFAULT_URL, as_json: JsonOpt = False) -> None:
    """Cancel a job: its tasks are stopped and its GPUs freed."""
    job = api("DELETE", url, f"/v1/jobs/{job_id}")
    print_json(job) if as_json else console.print(f"cancelled {job_id}")


@app.command()
def logs(
    job_id: Annotated[str, typer.Argument()],
    task: Annotated[int, typer.Option("--task", "-t", help="task index (rank)")] = 0,
    stderr: Annotated[bool, typer.Option("--stderr", help="stderr instead of stdout")] = False,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing until the job ends")] = False,
    url: UrlOpt = DEFAULT_URL,
) -> None:
    """Print a task's output."""
    import time

    offset = 0
    while True:
        chunk = api("GET", url, f"/v1/jobs/{job_id}/logs", params={"task": task, "offset": offset,
                                                                   "stream": "stderr" if stderr else "stdout"})
        sys.stdout.write(chunk["data"])
        sys.stdout.flush()
        offset = chunk["next_offset"]
        if not follow:
            return
        if not chunk["data"]:
            if api("GET", url, f"/v1/jobs/{job_id}")["state"] in ("succeeded", "failed", "cancelled", "rejected"):
                return
            time.sleep(0.5)


# --- nodes and queues ------------------------------------------------------------------


@app.command()
def nodes(url: UrlOpt = DEFAULT_URL, as_json: JsonOpt = False) -> None:
    """List nodes, like sinfo: state, GPU model, free/total GPUs, NVLink domains, labels, health."""
    from rich.table import Table

    rows = api("GET", url, "/v1/nodes")
    if as_json:
        print_json(rows)
        return
    table = Table(box=None, header_style="bold")
    for col in ("NODE", "STATE", "MODEL", "GPUS(free/total)", "NVLINK", "RACK", "LABELS", "HEALTH"):
        table.add_column(col)
    for n in rows:
        gpus = n["gpus"]
        models = ",".join(sorted({g["model"] for g in gpus})) or "-"
        free = sum(1000 - g["allocated_milli"] for g in gpus if g["health"] == "healthy") / 1000
        sick = [f"{g['index']}:{g['health_reason'] or 'unhealthy'}" for g in gpus if g["health"] != "healthy"]
        table.add_row(n["id"], n["state"], models, f"{free:g}/{len(gpus)}", str(len(n["nvlink_domains"])), n["rack"] or "-",
                      ",".join(f"{k}={v}" for k, v in n["labels"].items()) or "-", "; ".join(sick) or "ok")
    console.print(table)


@app.command()
def queues(url: UrlOpt = DEFAULT_URL, as_json: JsonOpt = False) -> None:
    """List queues, like sshare. ALLOCATED and PENDING in GPUs, with (GPU-equivalents) where a queue's CPU or
    memory share is the larger: fair share counts those (dominant resource)."""
    from rich.table import Table

    rows = api("GET", url, "/v1/queues")
    if as_json:
        print_json(rows)
        return
    table = Table(box=None, header_style="bold")
    for col in ("QUEUE", "GUARANTEED", "LIMIT", "WEIGHT", "ALLOCATED", "PENDING", "ENTITLED", "FAIRSHARE", "USAGE(GPUh)"):
        table.add_column(col)
    def amount(a: dict) -> str:
        """GPUs, and the GPU-equivalents fair share counts when CPU or memory is the larger share."""
        dom = a.get("dominant_gpus", a["gpus"])
        return f"{a['gpus']:g}" + (f" ({dom:g})" if abs(dom - a["gpus"]) > 1e-3 else "")

    for q in rows:
        depth = q["path"].count(".")
        table.add_row("  " * depth + q["path"].rsplit(".", 1)[-1], f"{q['guaranteed']['gpus']:g}",
                      "-" if q["limit"] is None else f"{q['limit']['gpus']:g}", f"{q['weight']:g}",
                      amount(q["allocated"]), amount(q["pending"]), f"{q['entitlement']['gpus']:g}",
                      f"{q['fair_share']['gpus']:g}", f"{q['usage']['gpu_hours_decayed']:g}")
    console.print(table)


@app.command()
def usage(
    since: Annotated[float | None, typer.Option(help="hours ago to start from (default 24)")] = None,
    url: UrlOpt = DEFAULT_URL,
    as_json: JsonOpt = False,
) -> None:
    """GPU-hours per queue, like sreport."""
    import time

    params = {"by": "queue", **({"since": time.time() - since * 3600} if since is not None else {})}
    rep = api("GET", url, "/v1/usage", params=params)
    if as_json:
        print_json(rep)
        return
    from rich.table import Table

    table = Table(box=None, header_style="bold", title=f"GPU-hours over the last {(rep['until'] - rep['since']) / 3600:g} h")
    table.add_column("QUEUE")
    table.add_column("GPU-HOURS", justify="right")
    for q, v in rep["queues"].items():
        table.add_row(q, f"{v['gpu_hours']:.3f}")
    console.print(table)


def _node_action(action: str, node_id: str, url: str, body: dict | None = None) -> None:
    res = api("POST", url, f"/v1/nodes/{node_id}/{action}", json=body or {})
    console.print(f"{action}: {node_id} (seq {res['seq']})")


@app.command()
def cordon(node_id: str, reason: Annotated[str, typer.Option()] = "operator", url: UrlOpt = DEFAULT_URL) -> None:
    """Stop placing work on a node; what runs there keeps running."""
    _node_action("cordon", node_id, url, {"reason": reason})


@app.command()
def drain(node_id: str, grace: Annotated[int, typer.Option("--grace", help="seconds")] = 300,
          reason: Annotated[str, typer.Option()] = "operator", url: UrlOpt = DEFAULT_URL) -> None:
    """Cordon a node and move its jobs elsewhere after a grace period."""
    _node_action("drain", node_id, url, {"grace_s": grace, "reason": reason})


@app.command()
def resume(node_id: str, url: UrlOpt = DEFAULT_URL) -> None:
    """Make a cordoned or drained node schedulable again."""
    _node_action("resume", node_id, url)


@app.command("inject-xid")
def inject_xid(node_id: str, xid: int, gpu: Annotated[int, typer.Option(help="GPU index on the node")] = 0,
               url: UrlOpt = DEFAULT_URL) -> None:
    """Simulated nodes: make a GPU report an XID as its driver would (79: fallen off the bus), to watch health act."""
    agent = api("GET", url, f"/v1/nodes/{node_id}").get("agent_url")
    if not agent:
        fail(f"node {node_id} has no agent endpoint to inject into")
    res = api("POST", agent, "/v1/agent/inject-xid", json={"gpu_index": gpu, "xid": xid})
    console.print(f"xid {xid} on {node_id} GPU {gpu} ({res['gpu_uuid']}): watch `gpuorch nodes` and `gpuorch jobs`")


# --- events ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def open_log(nats: str | None, data_dir: Path | None) -> AsyncIterator[EventLog]:
    if nats and data_dir:
        fail("give --nats or --data-dir, not both")
    server = None
    if not nats:
        data_dir = data_dir or Path(".gpuorch")
        if not (data_dir / "nats").exists():
            fail(f"no event log under {data_dir}: start the stack there first, or pass --nats URL")
        lock = stack.data_dir_lock(data_dir)
        try:
            lock.__enter__()
        except SystemExit:  # a stack is running there: read through its own server
            nats = _stack_nats(data_dir)
            if nats is None:
                fail(f"a stack is running on {data_dir} but its {data_dir / 'stack.json'} names no NATS URL: pass --nats URL")
        else:
            server = NatsServer(data_dir / "nats").start()
            nats = server.url
    try:
        evlog = await EventLog.connect(nats, ensure=False)
    except Exception as e:  # noqa: BLE001
        fail(f"cannot reach NATS at {nats}: {e!r}")
    try:
        yield evlog
    finally:
        await evlog.close()
        if server is not None:
            server.stop()
            lock.__exit__(None, None, None)


def _stack_nats(data_dir: Path) -> str | None:
    try:
        return str(json.loads((data_dir / "stack.json").read_text())["nats_url"])
    except (OSError, ValueError, KeyError):
        return None


def event_line(rec: Record) -> str:
    if isinstance(rec, Undecodable):
        return f"{rec.seq:>8}  {'?':<24} {'undecodable':<28} {rec.reason}"
    data = rec.data.model_dump(mode="json", exclude={rec.data.KEY})
    summary = " ".join(f"{k}={json.dumps(v, separators=(',', ':'))[:60]}" for k, v in data.items() if v not in (None, "", [], {}))
    ts = rec.time.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3]
    return f"{rec.seq:>8}  {ts:<24} {rec.data.TYPE:<22} {rec.subject:<32} {summary[:160]}"


def _emit(rec: Record, as_json: bool) -> None:
    from shared.api_events import record_json

    if as_json:
        print(json.dumps(record_json(rec)), flush=True)
    else:
        console.print(event_line(rec), markup=False, highlight=False, soft_wrap=True)


@events_app.command("tail")
def events_tail(
    nats: NatsOpt = None,
    data_dir: DataDirOpt = None,
    from_seq: Annotated[int | None, typer.Option("--from", help="start at this sequence (default: new events only)")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Follow the log: one line per event as it is stored."""

    async def run() -> None:
        async with open_log(nats, data_dir) as evlog:
            async for rec in evlog.follow(from_seq):
                if rec is not None:
                    _emit(rec, as_json)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


@events_app.command("replay")
def events_replay(
    nats: NatsOpt = None,
    data_dir: DataDirOpt = None,
    from_seq: Annotated[int, typer.Option("--from", min=1, help="first sequence")] = 1,
    limit: Annotated[int | None, typer.Option(min=1, help="at most this many events")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Print the history from a sequence until caught up."""

    async def run() -> None:
        async with open_log(nats, data_dir) as evlog:
            n = 0
            async for rec in evlog.replay(from_seq):
                _emit(rec, as_json)
                n += 1
                if limit and n >= limit:
                    break

    asyncio.run(run())


@events_app.command("verify")
def events_verify(nats: NatsOpt = None, data_dir: DataDirOpt = None, as_json: JsonOpt = False) -> None:
    """Re-fold the whole log through every projection; print digests and invalid transitions (exit 1 if any)."""

    async def run() -> list[dict[str, Any]]:
        async with open_log(nats, data_dir) as evlog:
            return await verify_log(evlog)

    results = asyncio.run(run())
    bad = sum(r["invalid_transitions"] for r in results) + sum(r["skipped"] for r in results)
    if as_json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            console.print(f"{r['service']:<11} seq={r['seq']:<9} applied={r['applied']:<9} digest={r['digest']} "
                          f"invalid={r['invalid_transitions']} skipped={r['skipped']}", highlight=False)
            for line in r["invalid"]:
                console.print(f"  invalid: {line}", markup=False, highlight=False)
            for line in r["skipped_reasons"]:
                console.print(f"  skipped: {line}", markup=False, highlight=False)
        console.print("[green]log verified[/green]" if not bad else f"[red]{bad} problem(s) found[/red]")
    raise typer.Exit(1 if bad else 0)


async def verify_log(evlog: EventLog) -> list[dict[str, Any]]:
    settings = Settings()
    projections = [stack.build_service(n, settings).projection for n in stack.SERVICES]
    skipped: list[str] = []
    async for rec in evlog.replay(1):
        if isinstance(rec, Undecodable):
            skipped.append(f"seq={rec.seq} {rec.reason}")
            for p in projections:
                p.skip(rec.seq)
            continue
        for p in projections:
            p.apply(rec)
    return [
        {
            "service": p.name, "seq": p.seq, "applied": p.applied, "digest": p.digest(),
            "invalid_transitions": p.invalid_count, "invalid": p.invalid_transitions[:50],
            "skipped": len(skipped), "skipped_reasons": skipped[:50],
        }
        for p in projections
    ]


@events_app.command("schema")
def events_schema(directory: Annotated[Path, typer.Argument(help="where to write one JSON Schema per event type")]) -> None:
    """Export the JSON Schema of every event type."""
    paths = export_schemas(directory)
    console.print(f"wrote {len(paths)} schemas to {directory}")


def _register_simulate() -> None:
    from services.simulate import simulate

    app.command(help="Replay a trace or recorded history through the same cores in virtual time; compare policies.")(simulate)


_register_simulate()


def main() -> None:
    app()


if __name__ == "__main__":
    main()

