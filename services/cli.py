"""The `gpuorch` command."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shlex
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from shared import aio
from shared.agentctl import MAX_LOG_CHUNK
from shared.cluster import CANCELLABLE, TERMINAL
from shared.eventlog import EventLog, Record, Undecodable
from shared.events import export_schemas
from shared.natsauth import Credentials, credentials_from, write_client_files
from shared.natsd import NatsServer
from shared.settings import Settings

from services import stack
from services.stack_procs import surviving_nats

app = typer.Typer(add_completion=False, no_args_is_help=True, help="gpuorch: a GPU cluster orchestrator.")
events_app = typer.Typer(no_args_is_help=True, help="The event log: tail (follow it), replay, verify, export schemas.")
app.add_typer(events_app, name="events")
tokens_app = typer.Typer(no_args_is_help=True, help="API tokens (admins): create, list, revoke.")
app.add_typer(tokens_app, name="tokens")
console = Console(width=None if sys.stdout.isatty() else 250)  # piped output is never cut to 80 columns
err = Console(stderr=True)

NatsOpt = Annotated[str | None, typer.Option("--nats", help="NATS URL of a running stack")]
DataDirOpt = Annotated[Path | None, typer.Option("--data-dir", help="a stopped stack's data dir (nats-server is started on it)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]


_token: dict[str, str | None] = {"value": None}  # --token, set by the callback below


@app.callback()
def _options(
    token: Annotated[str | None, typer.Option("--token", envvar="GPUORCH_TOKEN", show_envvar=True,
                                              help="API token (default: the admin token of the stack running here)")] = None,
) -> None:
    _token["value"] = token.strip() if token else None  # a token read from a file keeps its newline


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
    replicas: Annotated[int, typer.Option(min=1, envvar="GPUORCH_REPLICAS",
                                          help="replicas of every stream, bucket and consumer (3 on a 3-node --nats)")] = 1,
) -> None:
    """Start the whole stack: embedded nats-server, every service, simulated nodes, the HTTP API. Ctrl-C stops it."""
    if replicas > 1 and not nats:
        fail(f"--replicas {replicas} needs a JetStream cluster of at least {replicas} servers: give --nats URL,URL,...")
    stack.up(
        Settings(port=port, data_dir=data_dir, nats_url=nats, sync_always=sync_always, snapshot_every=snapshot_every,
                 nodes=nodes, policy=policy, replicas=replicas),
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
    mig: Annotated[list[str] | None, typer.Option(help="simulated nodes: MIG on a GPU, as GPU=PROFILE[*N][,PROFILE...] "
                                                       "(repeatable), e.g. 7=1g.10gb*7")] = None,
    kill_tasks_on_exit: Annotated[bool, typer.Option(help="SIGKILL every task when the agent stops (simulated nodes)")] = False,
    user_map: Annotated[Path | None, typer.Option(help="YAML: which local account each job owner's tasks run as "
                                                       "(a root agent; default: the same name, else nobody)")] = None,
    allow_root_tasks: Annotated[bool, typer.Option(help="let an owner's tasks run as root (uid or gid 0)")] = False,
    nats_credentials: Annotated[Path | None, typer.Option(
        help='this node\'s bus credentials, JSON {"user", "password"} (default: GPUORCH_NATS_USER/PASSWORD)')] = None,
    replicas: Annotated[int, typer.Option(min=1, envvar="GPUORCH_REPLICAS",
                                          help="replicas of this agent's consumer: as the event log's streams")] = 1,
) -> None:
    """Run the node agent: discover GPUs, register, heartbeat, stream telemetry, run placed tasks."""
    from services.inventory.agent import run_agent
    from services.inventory.runas import UserMapError, load_user_map
    from services.inventory.discovery import NvmlUnavailable, discover_nvml
    from services.inventory.nvml_fake import FakeNvml
    from shared.profiles import UnknownProfile, build, parse_mig

    try:
        users = load_user_map(user_map) if user_map else None
    except UserMapError as e:
        fail(str(e))
    pairs = [kv for item in labels or [] for kv in item.split(",") if kv]
    if any("=" not in kv for kv in pairs):
        fail("--labels takes k=v")
    label_map = dict(kv.split("=", 1) for kv in pairs)
    try:
        if mig and backend != "simulated":
            fail("--mig lays out simulated GPUs; a real GPU's MIG layout is discovered (nvidia-smi mig sets it)")
        if backend == "simulated":
            node = build(profile, node_id, labels=label_map, rack=rack, zone=zone, mig=parse_mig(mig or []))
            nvml: Any = FakeNvml(node)
            nvml.nvmlInit()
        elif backend == "nvml":
            import pynvml

            node = discover_nvml(pynvml, node_id=node_id, labels=label_map, rack=rack, zone=zone)
            pynvml.nvmlInit()
            nvml = pynvml
        else:
            fail(f"--backend is nvml or simulated, not {backend!r}")
    except (UnknownProfile, ValueError) as e:
        fail(str(e))
    except NvmlUnavailable as e:
        fail(f"{e} (use --backend simulated on a machine without GPUs)")
    node = node.model_copy(update={"address": address, "agent_url": f"http://{host}:{port}", "pool": pool,
                                   "hostname": node.hostname or node_id})
    stack.setup_logging(Settings().log_level)
    stack.setup_tracing("gpuorch-agent", node_id)
    try:
        user, password = credentials_from(os.environ, nats_credentials)
    except (OSError, ValueError, KeyError) as e:
        fail(f"--nats-credentials {nats_credentials}: {e}")
    try:
        aio.run(run_agent(node, nats, host, port, work_dir, nvml, kill_tasks_on_exit=kill_tasks_on_exit,
                              user_map=users, allow_root_tasks=allow_root_tasks, user=user, password=password,
                              replicas=replicas))
    except PermissionError as e:
        fail(str(e))


@app.command()
def gateway(
    nats: Annotated[str, typer.Option("--nats", help="NATS URL")],
    service: Annotated[list[str], typer.Option("--service", help="NAME=URL of a service process, once per service")],
    port: Annotated[int, typer.Option(help="HTTP API port")] = 8080,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    replicas: Annotated[int, typer.Option(min=1, envvar="GPUORCH_REPLICAS",
                                          help="replicas of the buckets it may create (3 in a JetStream cluster)")] = 1,
) -> None:
    """Serve the API on one port in front of services running in their own processes or containers."""
    upstreams = dict(s.split("=", 1) for s in service if "=" in s)
    unknown = set(upstreams) - set(stack.SERVICES)
    if unknown or len(upstreams) != len(service):
        fail(f"--service takes NAME=URL with NAME one of {', '.join(stack.SERVICES)}")
    settings = Settings(nats_url=nats, port=port, host=host, replicas=replicas)
    stack.setup_logging(settings.log_level)
    stack.setup_tracing("gpuorch-gateway")
    aio.run(stack.serve_gateway(settings, nats, upstreams))


# --- API client ----------------------------------------------------------------------

UrlOpt = Annotated[str, typer.Option("--url", envvar="GPUORCH_URL",
                                     help="gpuorch API (default: the stack running on ./.gpuorch, else this)")]
DEFAULT_URL = "http://127.0.0.1:8080"


def local_data_dir() -> Path:
    return Path(os.environ.get("GPUORCH_DATA_DIR") or ".gpuorch")


def local_stack_api(data_dir: Path) -> str | None:
    """The API URL of the stack running on ``data_dir`` (None if none runs there)."""
    if not stack_running(data_dir):
        return None
    try:
        return str(json.loads((data_dir / "stack.json").read_text())["api"])
    except (OSError, ValueError, KeyError):
        return None


def resolve_url(url: str, data_dir: Path | None = None) -> str:
    """The default URL means "the stack running here": its API, wherever `gpuorch up --port` put it."""
    if url != DEFAULT_URL:
        return url
    return local_stack_api(data_dir or local_data_dir()) or url


def resolve_token(url: str) -> str | None:
    """--token or GPUORCH_TOKEN, else GPUORCH_TOKEN_FILE, else the admin token of the stack running here
    (<data-dir>/auth/admin.token, as kubeconfig) but only when talking to that stack, else ~/.config/gpuorch/token."""
    if _token["value"]:
        return _token["value"]
    files = [Path(f) for f in [os.environ.get("GPUORCH_TOKEN_FILE")] if f]
    data_dir = local_data_dir()
    if not files and local_stack_api(data_dir) == url.rstrip("/"):
        files.append(stack.admin_token_path(data_dir))
    files.append(Path.home() / ".config" / "gpuorch" / "token")
    for f in files:
        try:
            return f.read_text().strip() or None
        except OSError:
            continue
    return None


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
    return api_response(method, url, path, **kw).json()


SUBMIT_RETRY_S = 15.0  # how long a keyed submission is sent again while gpuorch restarts under it
SUBMIT_RETRY_EVERY_S = 0.5


def api_response(method: str, url: str, path: str, key: str | None = None, **kw: Any) -> Any:
    """The API's answer as an httpx response (for its headers too), every failure a message as for ``api``.

    ``key``: the request's Idempotency-Key (a submission). It is then sent again, for up to SUBMIT_RETRY_S, when
    the connection broke after it was sent or the answer was 503 (gpuorch restarting under it): recorded once
    however often it arrives. A refused first connection still fails at once (nothing is listening)."""
    import time

    import httpx

    url = resolve_url(url)
    token = resolve_token(url)
    headers = {"authorization": f"Bearer {token}"} if token else {}
    if key is not None:
        headers["idempotency-key"] = key
    deadline, reached, told = time.monotonic() + SUBMIT_RETRY_S, False, False
    while True:
        try:
            resp = httpx.request(method, url.rstrip("/") + path, timeout=30, headers=headers, **kw)
            why = f"HTTP 503: {resp.text[:200]}" if resp.status_code == 503 else None
        except httpx.HTTPError as e:
            reached = reached or not isinstance(e, httpx.ConnectError)  # sent, maybe acted on
            if key is None or not reached or time.monotonic() >= deadline:
                if key is not None and reached:
                    fail(f"no answer from gpuorch at {url} ({type(e).__name__}): the submission may have been "
                         f"recorded: send it again with --idempotency-key {key} (recorded once)")
                fail(f"cannot reach gpuorch at {url} ({type(e).__name__}): is `gpuorch up` running? (--url or "
                     "GPUORCH_URL)")
            why = type(e).__name__
        reached = True
        if why is None or key is None or time.monotonic() >= deadline:
            break
        if not told:
            err.print(f"[dim]note:[/dim] no answer from gpuorch ({why}): sending the same submission again "
                      f"(Idempotency-Key {key})")
            told = True
        time.sleep(SUBMIT_RETRY_EVERY_S)
    refused(resp, url, token)
    return resp


def refused(resp: Any, url: str, token: str | None) -> None:
    """Fail with the API's reason if it answered 4xx or 5xx (``resp``: an httpx response, read or streamed)."""
    if resp.status_code == 401 and not token:
        fail(f"{url} wants a token: set GPUORCH_TOKEN (or --token, GPUORCH_TOKEN_FILE, ~/.config/gpuorch/token); "
             "an admin issues one with `gpuorch tokens create`")
    if resp.status_code >= 400:
        resp.read()
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


def age(ts: float | None, now: float) -> str:
    if not ts:
        return "-"
    s = int(max(0, now - ts))
    return f"{s // 86400}d{s % 86400 // 3600}h" if s >= 86400 else f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


# --- jobs ------------------------------------------------------------------------------


class _SubmitCommand(typer.core.TyperCommand):
    """`gpuorch submit python train.py --lr 3` reads --lr as gpuorch's own option: the refusal says where it goes."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except Exception as e:  # typer's own click raises it (not the click package's): known by its name
            if type(e).__name__ == "NoSuchOption":
                e.message += (" (a command's own options go after --: gpuorch submit [OPTIONS] -- python train.py "
                              "--lr 3)")
                e.possibilities = None
            raise


@app.command(cls=_SubmitCommand)
def submit(
    command: Annotated[list[str] | None, typer.Argument(help="the command each task runs")] = None,
    file: Annotated[Path | None, typer.Option("-f", "--file", help="a job as YAML/JSON, an sbatch script, or "
                                                                   "Kubernetes manifests (Job, PyTorchJob, Volcano Job, "
                                                                   "KAI PodGroup): each job in it is submitted")] = None,
    name: Annotated[str | None, typer.Option("--name", "-J", "--job-name", help="job name (-J as sbatch)")] = None,
    queue: Annotated[str | None, typer.Option("-q", "--queue", help="leaf queue, e.g. research.nlp")] = None,
    priority: Annotated[str | None, typer.Option(help="critical|high|normal|low")] = None,
    tasks: Annotated[int | None, typer.Option("-n", "--tasks", help="gang size: all start together or none")] = None,
    gpus: Annotated[float | None, typer.Option("-g", "--gpus", help="GPUs per task: whole, or a fraction below 1")] = None,
    cpu: Annotated[int | None, typer.Option(help="milli-CPU per task")] = None,
    memory: Annotated[int | None, typer.Option(help="MiB per task")] = None,
    model: Annotated[list[str] | None, typer.Option(help="allowed GPU model (repeatable)")] = None,
    mig: Annotated[str | None, typer.Option(help="MIG profile, e.g. 1g.10gb")] = None,
    topology: Annotated[str | None, typer.Option(help="nvlink|node|rack|zone|any")] = None,
    time_limit: Annotated[str | None, typer.Option("--time-limit", "-t", "--time", help="as Slurm's --time (-t): "
                                                         "minutes, MM:SS, HH:MM:SS, "
                                                         "D-HH[:MM[:SS]], UNLIMITED; or 90s, 30m, 2h, 1h30m")] = None,
    max_retries: Annotated[int | None, typer.Option(help="times to requeue it after its node is lost once running "
                                                        "(0); lost before it started, it is requeued twice "
                                                        "without spending one")] = None,
    env: Annotated[list[str] | None, typer.Option("-e", "--env", help="K=V (repeatable)")] = None,
    array: Annotated[str | None, typer.Option("-a", "--array", help="a job array, as Slurm writes it: 0-9, 1,3,5-7, "
                                                                    "0-15:4, 1-100%10 (at most 10 at once)")] = None,
    dependency: Annotated[str | None, typer.Option("-d", "--dependency", help="wait for other jobs, as Slurm writes "
                                                   "it with gpuorch ids: afterok:ID[:ID...], afternotok:ID, "
                                                   "afterany:ID, singleton; several with ','")] = None,
    hold: Annotated[bool, typer.Option("--hold", "-H", help="submit it held (-H as sbatch): it waits unplaced until "
                                                           "`gpuorch release`")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="show the job it would submit, every warning, and where "
                                                             "it would be placed now; submit nothing")] = False,
    jobfile_map: Annotated[Path | None, typer.Option("--map", envvar="GPUORCH_JOBFILE_MAP", show_envvar=True,
                                                     help="YAML: what this site's Slurm partitions and QOS, and "
                                                          "Kubernetes priority classes, mean here")] = None,
    idempotency_key: Annotated[str | None, typer.Option(
        "--idempotency-key", help="name this submission (default: a new random key): sent again with the same key, "
                                  "as a script's retry, it is recorded once")] = None,
    url: UrlOpt = DEFAULT_URL,
    as_json: JsonOpt = False,
) -> None:
    """Submit a job from flags, a YAML/JSON file, an sbatch script or Kubernetes manifests (flags override the file)."""
    from services.jobfiles import JobFileError, Translated, load_file
    from services.jobfiles.sbatch import array_request, dependency_request

    slurm: dict[str, Any] = {}
    try:
        if array:
            slurm["array"] = array_request(array, f"--array={array}")
        if dependency:
            slurm.update(dependency_request(dependency, f"--dependency={dependency}"))
    except JobFileError as e:
        fail(str(e).removeprefix("#SBATCH "))
    translated = [Translated({}, (), "flags")]
    known_queues: tuple[str, ...] | None = None
    if file is None and (named := _job_file_named(command)) is not None:  # `sbatch job.sbatch`, as Slurm users type it
        instead = "" if named.suffix in (".yaml", ".yml", ".json") else \
            f" (to run the script as a command on the nodes instead: gpuorch submit -- bash {named})"
        err.print(f"[dim]note:[/dim] {named} is a job file here, read as -f {named} would read it{instead}")
        file, command = named, None
    if file:
        ctx = _jobfile_context(url, jobfile_map)
        known_queues = ctx.queues
        try:
            loaded = load_file(file, ctx)
        except JobFileError as e:
            fail(str(e))
        for note in loaded.notes:
            err.print(f"[dim]note:[/dim] {note}")
        for q in loaded.queues:
            err.print(f"[dim]note:[/dim] {q.origin}: a queue: apply it with gpuorch queues apply -f {file}")
        if not loaded.jobs:
            fail(f"{file} holds no job")
        translated = list(loaded.jobs)
    bad = [e for e in env or [] if "=" not in e]
    if bad:
        fail(f"--env takes K=V, got {bad[0]!r}")
    limit_s = time_limit_s(time_limit) if time_limit is not None else None
    bodies = []
    for t in translated:
        body = _with_flags(dict(t.job), command, name=name, queue=queue, priority=priority, tasks=tasks, gpus=gpus,
                           cpu=cpu, memory=memory, model=model, mig=mig, topology=topology, time_limit_s=limit_s,
                           max_retries=max_retries, env=env)
        bodies.append({**body, **slurm, **({"hold": True} if hold else {})})
        label = f"{t.origin}: " if len(translated) > 1 else ""
        named = body.get("queue") if queue is None else None  # the file named it: a partition, an account, a label
        if named is not None and known_queues is not None and named not in known_queues:
            fail(f"{label}the file asks for queue {named!r}, which is not a queue here (queues: "
                 f"{', '.join(sorted(known_queues)) or 'none'}): pass -q QUEUE, or map this site's partitions, "
                 "accounts and labels to queues in GPUORCH_JOBFILE_MAP (--map)")
        for w in t.warnings:
            err.print(f"[yellow]warning:[/yellow] {label}{w}")
    # the jobs of one file go in one request, a batch: every one is accepted, or none is (jobs[i] says which not)
    params = {"dry_run": "true"} if dry_run else None
    key = idempotency_key or uuid.uuid4().hex
    resp = api_response("POST", url, "/v1/jobs", json=bodies if len(bodies) > 1 else bodies[0], params=params, key=key)
    answered = resp.json() if len(bodies) > 1 else [resp.json()]
    submitted = "already submitted (same --idempotency-key):" if resp.headers.get("idempotent-replayed") else "submitted"
    answers = []
    for t, job in zip(translated, answered):
        label = f"{t.origin}: " if len(translated) > 1 else ""
        job["warnings"] = [*t.warnings, *job.get("warnings", [])]
        if t.logs:
            job["logs"] = t.logs
        answers.append(job)
        if not as_json:
            for w in job["warnings"][len(t.warnings):]:
                err.print(f"[yellow]warning:[/yellow] {label}{w}")
            if dry_run:
                _print_dry_run(job)
            elif "jobs" in job:
                limit = f", at most {job['max_running']} at once" if job.get("max_running") else ""
                console.print(f"{submitted} array [bold]{job['id']}[/bold] ({job['name']}): {job['count']} jobs "
                              f"{job['id']}-INDEX{limit}, to queue {job['queue']}")
            else:
                console.print(f"{submitted} [bold]{job['id']}[/bold] ({job['name']}) to queue {job['queue']}: "
                              f"{job['state']}")
    if as_json:
        print_json(answers[0] if len(answers) == 1 else answers)
    if dry_run and any(a.get("refused") for a in answers):
        raise typer.Exit(1)


def _job_file_named(command: list[str] | None) -> Path | None:
    """The job file a lone command names, if it is one here: an sbatch script (#! or #SBATCH) or YAML/JSON."""
    from services.jobfiles import is_sbatch

    if not command or len(command) != 1:
        return None
    path = Path(command[0])
    try:
        if not path.is_file():
            return None
        if path.suffix in (".yaml", ".yml", ".json"):
            return path
        with path.open("rb") as f:
            head = f.read(1 << 20).decode()
    except (OSError, UnicodeDecodeError):
        return None  # not readable here, or not text: a program for the nodes
    return path if is_sbatch(head) else None


def time_limit_s(text: str) -> int | None:
    """--time-limit in seconds, read as Slurm reads --time (a bare number is minutes; 0 or UNLIMITED: none),
    or as a duration with units (90s, 30m, 2h, 1h30m)."""
    from services.jobfiles import JobFileError
    from services.jobfiles.sbatch_options import slurm_time
    from shared.timespec import duration_s

    if (seconds := duration_s(text)) is not None:
        return max(1, round(seconds)) if seconds else None
    try:
        return slurm_time(text, f"--time={text}")
    except JobFileError:
        fail(f"--time-limit {text!r}: write minutes (90), MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, UNLIMITED, "
             "or a duration with units (90s, 30m, 2h, 1h30m)")
    return None


def _with_flags(body: dict[str, Any], command: list[str] | None, **flags: Any) -> dict[str, Any]:
    """A job body with the command line's flags over what the file said."""
    plain = {k: v for k, v in flags.items() if k in ("name", "queue", "priority", "tasks", "topology", "time_limit_s",
                                                      "max_retries") and v is not None}
    body.update(plain)
    res = body.setdefault("resources", {})
    for k, v in (("gpus", flags["gpus"]), ("cpu_milli", flags["cpu"]), ("memory_mib", flags["memory"])):
        if v is not None:
            res[k] = int(v) if k == "gpus" and v == int(v) else v
    if flags["model"] or flags["mig"]:
        body.setdefault("gpu", {}).update({k: v for k, v in (("models", flags["model"]), ("mig", flags["mig"])) if v})
    if flags["env"]:
        body.setdefault("env", {}).update(dict(e.split("=", 1) for e in flags["env"]))
    if command:
        body["command"] = command
    if "name" not in body:
        body["name"] = (Path(body["command"][0]).name if body.get("command") else "job")[:63] or "job"
    return body


def _quietly(method: str, url: str, path: str) -> Any:
    """An API answer, or None without a word if there is none (what the CLI would like to know, not must)."""
    global err
    saved, err = err, Console(file=io.StringIO())
    try:
        return api(method, url, path)
    except (typer.Exit, SystemExit):
        return None
    finally:
        err = saved


def _jobfile_context(url: str, jobfile_map: Path | None) -> Any:
    """What a job file's names mean here: the site map, and the cluster's queues and GPU models if it answers."""
    from services.jobfiles import Context, JobFileError, load_site_map

    try:
        site = load_site_map(jobfile_map)
    except JobFileError as e:
        fail(str(e))
    queues = _quietly("GET", url, "/v1/queues")
    nodes = _quietly("GET", url, "/v1/nodes") or []
    models = sorted({g.get("model") for n in nodes for g in n.get("gpus", []) if g.get("model")})
    return Context(site=site, queues=tuple(q["path"] for q in queues) if isinstance(queues, list) else None,
                   models=tuple(models), environ=dict(os.environ))


def _per_task(gpus: float, mig: str | None, unit: str = "") -> str:
    """What each task holds: GPUs ('2', '0.5'), or MIG slices ('1g.10gb', '2x1g.10gb')."""
    if mig:
        return f"{int(gpus)}x{mig}" if gpus > 1 else mig
    return f"{int(gpus) if gpus == int(gpus) else gpus}{unit}"


def _print_dry_run(res: dict[str, Any]) -> None:
    spec = res["spec"]
    r = spec["resources"]
    per_node = f", {spec['tasks_per_node']} per node" if spec.get("tasks_per_node") else ""
    console.print(f"[bold]{spec['name']}[/bold] would be submitted to queue {spec['queue']} at priority "
                  f"{spec['priority']}: {spec['tasks']} task(s) x "
                  f"{_per_task(r['gpus'], spec.get('gpu', {}).get('mig'), ' GPU(s)')}{per_node}, "
                  f"topology {spec['topology']}" + (f", time limit {spec['time_limit_s']} s" if spec.get('time_limit_s')
                                                    else ""))
    if spec.get("gpu", {}).get("models"):
        console.print(f"  GPU models: {', '.join(spec['gpu']['models'])}")
    if res.get("refused"):
        console.print(f"[red]it would be refused[/red] (HTTP {res['refused']['status']}): {res['refused']['detail']}")
    elif res.get("placed_now"):
        by_node: dict[str, list[str]] = {}
        for t in res["placement"]:
            by_node.setdefault(t["node"], []).append(str(t["task"]))
        where = "; ".join(f"{n}: task {', '.join(ts)}" for n, ts in by_node.items())
        console.print(f"it would be placed now ({res.get('spread')}): {where}")
    else:
        console.print(f"it would wait: {res.get('reason')}")
    if res.get("ahead"):
        console.print(f"  ({res['ahead']} job(s) of its queue wait ahead of it and may go first)")


JOB_STATES = ("submitted", "queued", "held", "placed", "running", "preempting", "preempted", "succeeded", "failed",
              "cancelled", "rejected")
SLURM_STATES = {
    "PD": ("submitted", "queued", "held"), "PENDING": ("submitted", "queued", "held"),  # a held job is PD in squeue
    "CF": ("placed",), "CONFIGURING": ("placed",),
    "R": ("placed", "running"), "RUNNING": ("placed", "running"),
    "CG": ("preempting",), "COMPLETING": ("preempting",),
    "PR": ("preempted",), "PREEMPTED": ("preempted",),
    "CD": ("succeeded",), "COMPLETED": ("succeeded",),
    "F": ("failed",), "FAILED": ("failed",),
    "CA": ("cancelled",), "CANCELLED": ("cancelled",),
    "ALL": JOB_STATES,
}  # squeue's state codes and names; gpuorch's own names are taken as they are
StateOpt = Annotated[str | None, typer.Option(
    "-s", "--state", "-t", help="comma-separated (-t as squeue and scancel): Slurm codes PD, CF, R, CG, PR, CD, F, CA (or their long names), "
                          "all, or gpuorch's states (queued, held, running, preempting, succeeded, ...)")]


def job_states(text: str) -> list[str]:
    """gpuorch states for a --state list, Slurm codes expanded; an unknown one fails naming the accepted."""
    out: list[str] = []
    for word in (w.strip() for w in text.split(",") if w.strip()):
        states = SLURM_STATES.get(word.upper()) or ((word.lower(),) if word.lower() in JOB_STATES else None)
        if states is None:
            fail(f"--state {word!r}: use {', '.join(k for k in SLURM_STATES if len(k) <= 2)}, all or "
                 f"{', '.join(JOB_STATES)}")
        out += [st for st in states if st not in out]
    return out


JOBS_PAGE = 1000  # jobs asked for at once: the API's largest page


def list_jobs(url: str, queue: str | None, states: list[str] | None, limit: int,
              owner: str | None = None) -> list[dict[str, Any]]:
    """Up to ``limit`` of the jobs the caller may see, newest first: page after page, following X-Next-Cursor."""
    params: dict[str, Any] = {k: v for k, v in (("queue", queue), ("owner", owner)) if v is not None}
    if states is not None:
        params["state"] = states
    rows: list[dict[str, Any]] = []
    cursor = None
    while len(rows) < limit:
        page_params = {**params, "limit": min(limit - len(rows), JOBS_PAGE), **({"cursor": cursor} if cursor else {})}
        resp = api_response("GET", url, "/v1/jobs", params=page_params)
        rows += resp.json()
        cursor = resp.headers.get("x-next-cursor")
        if not cursor:
            break
    return rows


def exit_code(job: dict[str, Any]) -> int | None:
    """A finished job's exit code, as Slurm's ExitCode: the failing code, else the highest its tasks exited with,
    else the signal that ended the first task a signal ended (negative)."""
    if job["state"] not in TERMINAL:
        return None
    if job.get("exit_code") is not None:
        return job["exit_code"]
    codes = [c for c in (job.get("task_exits") or {}).values() if c is not None]
    if failing := [c for c in codes if c != 0]:  # a failed job's is never a peer's 0
        return max(failing) if max(failing) > 0 else failing[0]
    return 0 if codes or job["state"] == "succeeded" else None


@app.command()
def jobs(
    queue: Annotated[str | None, typer.Option("-q", "--queue")] = None,
    state: StateOpt = None,
    all_: Annotated[bool, typer.Option("--all", "-a", help="include finished jobs")] = False,
    user: Annotated[str | None, typer.Option("--user", "-u", help="only this user's jobs (-u as squeue)")] = None,
    limit: Annotated[int, typer.Option(min=1, help="at most this many, the newest first")] = 200,
    url: UrlOpt = DEFAULT_URL,
    as_json: JsonOpt = False,
) -> None:
    """List jobs, like squeue (-s PD,R as squeue's --states). EXIT: a finished job's exit code."""
    import time

    from rich.table import Table

    unfinished = [st for st in JOB_STATES if st not in TERMINAL]
    states = job_states(state) if state else (None if all_ else unfinished)
    rows = list_jobs(url, queue, states, limit + 1, user)  # one more than shown: whether there are more
    more, rows = len(rows) > limit, rows[:limit]
    if as_json:
        print_json(rows)
        return
    now = time.time()
    table = Table(box=None, header_style="bold")
    for col in ("ID", "NAME", "QUEUE", "STATE", "TASKSxGPUS", "NODES", "AGE", "EXIT", "REASON"):
        table.add_column(col, overflow="fold" if col == "REASON" else "ellipsis", no_wrap=col != "REASON")
    for j in rows:
        nodes = ",".join(sorted({p["node"] for p in j["placement"]})) or "-"
        code = exit_code(j)
        per_task = _per_task(j["gpus_per_task"], (j.get("spec") or {}).get("gpu", {}).get("mig"))
        table.add_row(j["id"], j["name"], j["queue"], j["state"], f"{j['tasks']}x{per_task}", nodes,
                      age(j["submitted_at"], now), "-" if code is None else _exit_text(code), j["reason"] or "")
    console.print(table)
    if more:  # say so, or 200 of 20,000 waiting jobs read as all of them
        err.print(f"[dim]the newest {limit} shown; --limit N shows more[/dim]")


@app.command()
def cancel(
    job_ids: Annotated[list[str] | None, typer.Argument(help="job ids (or give filters instead)")] = None,
    name: Annotated[str | None, typer.Option("--name", "-n", help="every job of this name")] = None,
    queue: Annotated[str | None, typer.Option("--queue", "-q", help="every job of this queue")] = None,
    state: StateOpt = None,
    url: UrlOpt = DEFAULT_URL,
    as_json: JsonOpt = False,
) -> None:
    """Cancel jobs, like scancel: by id, or every unfinished job you may cancel that matches all the filters
    given (--name, --queue, --state). Their tasks are stopped and their GPUs freed."""
    filters = name is not None or queue is not None or state is not None
    if job_ids and filters:
        fail("give job ids or filters (--name, --queue, --state), not both")
    if job_ids and len(job_ids) == 1:
        done = api("DELETE", url, f"/v1/jobs/{job_ids[0]}")
        if as_json:
            print_json(done)
        else:
            array = f" (an array: {len(done['cancelled'])} unfinished job(s) cancelled)" if "array" in done else ""
            console.print(f"cancelled {job_ids[0]}{array}")
        return
    if not job_ids and not filters:
        fail("give a job id, or filters (--name, --queue, --state) to cancel every job that matches")
    if job_ids:
        body: dict[str, Any] = {"ids": job_ids}
    else:
        states = [st for st in (job_states(state) if state else JOB_STATES) if st in CANCELLABLE]
        if not states:
            fail(f"--state {state}: only unfinished jobs can be cancelled (PD, CF, R, CG, PR)")
        body = {k: v for k, v in (("name", name), ("queue", queue), ("states", states)) if v is not None}
    # one request for them all: the server appends the cancellations in batches (one DELETE per job took 10 minutes
    # for 20,000)
    done = api("POST", url, "/v1/jobs:cancel", json=body)
    if as_json:
        print_json(done)
        return
    skipped = done["skipped"]
    console.print(f"cancelled {len(done['cancelled'])} job(s)" + (
        f"; {len(skipped)} could not be (not yours, ended, or unknown)" if skipped else ""))
    if job_ids and skipped:  # as for one id (an unknown, ended or forbidden one fails): a script learns it
        for s in skipped[:20]:
            err.print(f"[yellow]not cancelled:[/yellow] {s['id']}: {s['why']}")
        raise typer.Exit(1)


JobIds = Annotated[list[str], typer.Argument(help="job ids, or array ids (each element it applies to)")]


@app.command()
def hold(job_ids: JobIds, url: UrlOpt = DEFAULT_URL, as_json: JsonOpt = False) -> None:
    """Hold waiting jobs, like scontrol hold: they stay unplaced, and want nothing of quota, fair share or the
    autoscaler, until `gpuorch release`. A job placed already cannot be held (cancel it)."""
    _hold_or_release("hold", job_ids, url, as_json)


@app.command()
def release(job_ids: JobIds, url: UrlOpt = DEFAULT_URL, as_json: JsonOpt = False) -> None:
    """Release held jobs, like scontrol release: they wait in their queues again (an admin's hold: admins only)."""
    _hold_or_release("release", job_ids, url, as_json)


@app.command()
def update(
    job_ids: JobIds,
    priority: Annotated[str | None, typer.Option(help="critical|high|normal|low: while the job waits")] = None,
    time_limit: Annotated[str | None, typer.Option("--time-limit", "-t", "--time", help="as submit's: while the job "
                                                   "waits or runs; only an admin raises one")] = None,
    url: UrlOpt = DEFAULT_URL,
    as_json: JsonOpt = False,
) -> None:
    """Change jobs, like scontrol update: the priority of a waiting job, the time limit of a waiting or running one.
    An array's id changes every element that may be changed."""
    change: dict[str, Any] = {}
    if priority is not None:
        change["priority"] = priority
    if time_limit is not None:
        if (limit := time_limit_s(time_limit)) is None:
            fail(f"--time-limit {time_limit}: a job's limit can be lowered or raised, not removed")
        change["time_limit_s"] = limit
    if not change:
        fail("nothing to change: give --priority, --time-limit or both")
    for job_id in job_ids:  # in order; the first refused stops the command, as scontrol does
        done = api("PATCH", url, f"/v1/jobs/{job_id}", json=change)
        if as_json:
            print_json(done)
        elif "array" in done:
            console.print(f"updated array {job_id}: {len(done['updated'])} job(s)")
        else:
            spec = done["spec"]
            limit = f", time limit {_seconds(spec.get('time_limit_s'))}" if "time_limit_s" in change else ""
            console.print(f"updated {job_id}: {done['state']}, priority {spec['priority']}{limit}")


def _hold_or_release(verb: str, job_ids: list[str], url: str, as_json: bool) -> None:
    done_word = "held" if verb == "hold" else "released"  # as the API names an array's list
    for job_id in job_ids:  # in order; the first refused stops the command, as scontrol does
        done = api("POST", url, f"/v1/jobs/{job_id}/{verb}")
        if as_json:
            print_json(done)
        elif "array" in done:
            console.print(f"{done_word} array {job_id}: {len(done[done_word])} job(s)")
        else:
            console.print(f"{done_word} {job_id}: {done['state']}")


def _at(ts: float | None, now: float) -> str:
    """A time as UTC ISO 8601 with how long ago (or ahead) it is; '-' for none."""
    from datetime import UTC, datetime

    if not ts:
        return "-"
    when = datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"{when} (in {age(now, ts)})" if ts > now + 1 else f"{when} ({age(ts, now)} ago)"


def _seconds(s: int | None) -> str:
    """A time limit as Slurm prints one: [D-]HH:MM:SS."""
    if not s:
        return "none"
    hms = f"{s % 86400 // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{s // 86400}-{hms}" if s >= 86400 else hms


def _exit_text(code: int | None) -> str:
    """A task's exit: its code, the signal that ended it (kept negative, as Python's returncode), or unknown."""
    if code is None:
        return "unknown"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return str(code)


def job_lines(job: dict[str, Any], now: float) -> list[tuple[str, str]]:
    """What `gpuorch show` prints of a job, field by field (an archived job has no spec: only its summary)."""
    import shlex

    spec = job.get("spec") or {}
    res = spec.get("resources", {})
    g = job.get("gpus_per_task", res.get("gpus"))
    code = exit_code(job) if "state" in job else None
    lines = [
        ("id", job["id"]), ("name", job["name"]), ("owner", job.get("owner") or "-"), ("queue", job["queue"]),
        ("priority", job["priority"]), ("state", job["state"]), ("reason", job.get("reason") or "-"),
    ]
    if "estimated_start" in job and job["state"] in ("submitted", "queued"):
        lines.append(("estimated start", _at(job["estimated_start"], now) if job["estimated_start"] else "unknown"))
    lines += [(k, _at(job.get(f), now)) for k, f in (("submitted", "submitted_at"), ("placed", "placed_at"),
                                                     ("started", "started_at"), ("ended", "ended_at"))]
    if spec:
        per_node = f", {spec['tasks_per_node']} per node" if spec.get("tasks_per_node") else ""
        lines += [("time limit", _seconds(spec.get("time_limit_s"))),
                  ("tasks", f"{job['tasks']} x {_per_task(g, spec.get('gpu', {}).get('mig'), ' GPU(s)')}{per_node}, "
                            f"topology {spec.get('topology', 'any')}"),
                  ("per task", f"{res.get('cpu_milli', 0) / 1000:g} CPU, {res.get('memory_mib', 0)} MiB")]
        if spec.get("gpu", {}).get("models") or spec.get("gpu", {}).get("mig"):
            lines.append(("gpu", ", ".join(f"{k} {' or '.join(v) if isinstance(v, list) else v}"
                                           for k, v in spec["gpu"].items() if v)))
    for p in job.get("placement") or []:
        lines.append((f"task {p['task']}", f"node {p['node']}, {len(p['gpus'])} GPU(s): {gpu_list(p)}"))
    if job.get("nodes"):
        lines.append(("nodes", job["nodes"]))
    lines.append(("exit code", "-" if code is None else _exit_text(code)))
    if job.get("task_exits"):
        lines.append(("task exits", ", ".join(f"{t}:{_exit_text(c)}" for t, c in job["task_exits"].items())))
    free = f" (+{n} free: its node lost before it started)" if (n := job.get("lost_before_start")) else ""
    lines += [("retries", f"{job.get('retries', 0)} of {spec.get('max_retries', 0)}{free}"),
              ("preemptions", str(job.get("preemptions", 0)))]
    if arr := spec.get("array"):
        cap = f", at most {arr['max_running']} running" if arr.get("max_running") else ""
        lines.append(("array", f"{arr['id']} index {arr['index']}{cap}"))
    if spec.get("dependencies"):
        lines.append(("dependencies", ",".join(f"{d['kind']}:{d['job']}" for d in spec["dependencies"])))
    if spec.get("singleton"):
        lines.append(("singleton", "yes"))
    if spec.get("command"):
        lines.append(("command", shlex.join(spec["command"])))
    if spec.get("env"):
        lines.append(("env", " ".join(f"{k}={v}" for k, v in spec["env"].items())))
    return lines


@app.command()
def show(job_id: Annotated[str, typer.Argument()], url: UrlOpt = DEFAULT_URL, as_json: JsonOpt = False) -> None:
    """Everything about a job, like scontrol show job: state and why it waits, when it should start, times,
    limits, placement, exit codes, retries, array and dependencies, command; then its events, as kubectl describe."""
    import time

    from rich.markup import escape

    job = api("GET", url, f"/v1/jobs/{job_id}", params={"estimate": "true"})
    if as_json:
        print_json(job)
        return
    if "states" in job:  # an array's id: its summary
        lines = [("array", job["id"]), ("name", job["name"]), ("queue", job["queue"]), ("elements", str(job["count"])),
                 ("at once", str(job["max_running"] or "no limit")),
                 ("states", ", ".join(f"{n} {s}" for s, n in sorted(job["states"].items()))),
                 ("jobs", " ".join(job["jobs"]))]
    else:
        lines = job_lines(job, time.time())
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        console.print(f"[bold]{k + ':':<{width + 1}}[/bold] {escape(v)}", highlight=False)
    if "states" not in job and not job.get("archived"):  # what happened to it, as kubectl describe's Events
        history = api("GET", url, f"/v1/jobs/{job_id}/events")
        console.print("[bold]events (UTC):[/bold]" + (f" (the last {SHOWN_EVENTS} of {len(history)})"
                                                if len(history) > SHOWN_EVENTS else ""), highlight=False)
        placed = 0  # the latest placement's sequence: a task event of another attempt is an earlier one's
        for i, e in enumerate(history):
            placed = e["seq"] if "placements" in (e.get("data") or {}) else placed
            if i >= len(history) - SHOWN_EVENTS:
                console.print("  " + escape(history_line(e, placed)), highlight=False, soft_wrap=True)


SHOWN_EVENTS = 20  # a job's latest events `gpuorch show` prints


def gpu_list(placed: dict[str, Any]) -> str:
    """A task's GPUs by their index on the node, in ranges as Slurm's IDX:0-3,6; by the start of their UUID where
    an index is unknown (a MIG slice, a node gone since); a shared GPU with its share."""
    indexes = placed.get("indexes") or [None] * len(placed["gpus"])
    shares = placed.get("shares") or [1000] * len(placed["gpus"])
    share = "" if all(m == 1000 for m in shares) else f" ({', '.join(f'{m / 1000:g}' for m in shares)} of a GPU)"
    if None in indexes:
        return ", ".join(uuid[:12] for uuid in placed["gpus"]) + share
    runs: list[list[int]] = []
    for i in sorted(indexes):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) + share


def history_line(e: dict[str, Any], attempt: int = 0) -> str:
    """One of a job's events as the API answers it (``record_json``), in words: its time (UTC), what, and why
    (``attempt``: the sequence of the job's latest placement so far)."""
    d, what = e.get("data") or {}, e["type"].removeprefix("io.gpuorch.").rsplit(".v", 1)[0]
    if "placements" in d:
        detail = "on " + ", ".join(sorted({p["node_id"] for p in d["placements"]}))
    elif "task" in d:
        detail = f"task {d['task']} on {d.get('node_id', '?')}"
        if what == "job.task_exited":
            code = _exit_text(d.get("code") if d.get("signal") is None else -d["signal"])
            detail += ": " + (f"code {code}" if code.isdigit() else code)
        if d.get("reason"):
            detail += f" ({d['reason']})"
        if d.get("attempt") not in (None, attempt):
            detail += " (an earlier attempt)"
    else:
        detail = d.get("reason") or ""
    by = f"(by {e['gpuorchactor']})" if e.get("gpuorchactor") else ""
    return (f"{str(e.get('time', ''))[11:19]}  {what:<18} " + " ".join(x for x in (detail, by) if x)).rstrip()


@app.command()
def logs(
    job_id: Annotated[str, typer.Argument()],
    task: Annotated[int, typer.Option("--task", "-t", help="task index (rank)")] = 0,
    stderr: Annotated[bool, typer.Option("--stderr", help="stderr instead of stdout")] = False,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing until the job ends (a job still "
                                                                          "queued: from when it is placed)")] = False,
    tail: Annotated[int | None, typer.Option("--tail", "-n", min=0, help="only its last N lines (then -f goes on "
                                                                             "from there)")] = None,
    url: UrlOpt = DEFAULT_URL,
) -> None:
    """Print a task's output: all of it, its last --tail lines, or, with -f, what it writes until it ends."""
    import time

    path, params = f"/v1/jobs/{job_id}/logs", {"task": task, "stream": "stderr" if stderr else "stdout"}
    offset = 0
    if follow:
        _wait_to_be_placed(url, job_id)
    if tail is not None:
        text, offset = _last_lines(url, path, params, tail)
        sys.stdout.write(text)
        if not follow:
            return
    while True:
        chunk = api("GET", url, path, params={**params, "offset": offset})
        sys.stdout.write(chunk["data"])
        sys.stdout.flush()
        read, offset = chunk["next_offset"] - offset, chunk["next_offset"]
        if read > MAX_LOG_CHUNK - 4:  # a full chunk (less a character it would have cut): there is more now
            continue
        if not follow:
            return
        if not read:
            if api("GET", url, f"/v1/jobs/{job_id}")["state"] in TERMINAL:
                return
            time.sleep(0.5)


def _wait_to_be_placed(url: str, job_id: str) -> None:
    """A job still waiting to be placed (just submitted, or queued behind others): say so once, and wait."""
    import time

    told = False
    while (job := api("GET", url, f"/v1/jobs/{job_id}")).get("state") in ("submitted", "queued"):
        if not told:
            err.print(f"{job_id} is {job['state']}: {job.get('reason') or 'not placed yet'}; its output will follow "
                      "once it is placed (Ctrl-C to stop)", highlight=False)
            told = True
        time.sleep(1.0)


def _last_lines(url: str, path: str, params: dict[str, Any], n: int) -> tuple[str, int]:
    """A log's last ``n`` lines (within its last MiB) and the offset after them: asks for more of its end until the
    lines are whole (the first line of a chunk that does not start the log may be cut)."""
    want = 64 << 10
    while True:
        chunk = api("GET", url, path, params={**params, "tail_bytes": want})
        lines = chunk["data"].splitlines(keepends=True)
        if len(lines) > n or chunk["offset"] == 0 or want == MAX_LOG_CHUNK:
            return "".join(lines[-n:] if n else []), chunk["next_offset"]
        want = min(MAX_LOG_CHUNK, want * 4)


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
    for col in ("NODE", "STATE", "MODEL", "GPUS(free/total)", "MIG(free/total)", "NVLINK", "RACK", "LABELS", "HEALTH"):
        table.add_column(col)
    for n in rows:
        gpus = [g for g in n["gpus"] if not g.get("mig_enabled")]  # a MIG GPU is placed by its slices only
        slices = [(m, g) for g in n["gpus"] if g.get("mig_enabled") for m in g.get("mig_slices", [])]
        models = ",".join(sorted({g["model"] for g in n["gpus"]})) or "-"
        free = sum(1000 - g["allocated_milli"] for g in gpus if g["health"] == "healthy") / 1000
        free_slices = sum(1 for m, g in slices if not m.get("allocated") and g["health"] == "healthy")
        sick = [f"{g['index']}:{g['health_reason'] or 'unhealthy'}" for g in n["gpus"] if g["health"] != "healthy"]
        table.add_row(n["id"], n["state"], models, f"{free:g}/{len(gpus)}",
                      f"{free_slices}/{len(slices)}" if slices else "-", str(len(n["nvlink_domains"])),
                      n["rack"] or "-", ",".join(f"{k}={v}" for k, v in n["labels"].items()) or "-",
                      "; ".join(sick) or "ok")
    console.print(table)


SinceOpt = Annotated[str, typer.Option(help="start: 30m, 2h, 7d (ago), epoch seconds or ISO 8601")]
UntilOpt = Annotated[str, typer.Option(help="end: like --since, or now")]


def window_params(since: str, until: str) -> dict[str, str]:
    """--since/--until checked here with the parser the API uses, then sent as typed: the API reads them alike."""
    import time

    from shared.timespec import TimeSpecError, parse_window

    try:
        parse_window(since, until, time.time())
    except TimeSpecError as e:
        fail(str(e))
    return {"since": since, "until": until}


queues_app = typer.Typer(help="Queues: list them (like sshare); set, delete, or apply queue manifests.")
app.add_typer(queues_app, name="queues")


@queues_app.callback(invoke_without_command=True)
def queues(ctx: typer.Context, since: SinceOpt = "24h", until: UntilOpt = "now", url: UrlOpt = DEFAULT_URL,
           as_json: JsonOpt = False) -> None:
    """List queues, like sshare. ALLOCATED and PENDING in GPUs, with (GPU-equivalents) where a queue's CPU or
    memory share is the larger: fair share counts those (dominant resource). DECAYED(GPUh): the usage fair share
    weighs (all time, halved every half-life); USED(GPUh): GPU-hours held from --since to --until, as
    `gpuorch usage` counts them. `gpuorch queues set|delete|apply` change them."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.table import Table

    rows = api("GET", url, "/v1/queues", params=window_params(since, until))
    if as_json:
        print_json(rows)
        return
    table = Table(box=None, header_style="bold")
    if rows:
        u = rows[0]["usage"]
        table.caption = (f"USED(GPUh): {_span(u['since'], u['until'])}; "
                         f"DECAYED(GPUh): half-life {u['half_life_s'] / 3600:g} h")
    for col in ("QUEUE", "GUARANTEED", "LIMIT", "WEIGHT", "ALLOCATED", "PENDING", "ENTITLED", "FAIRSHARE",
                "DECAYED(GPUh)", "USED(GPUh)"):
        table.add_column(col, justify="right" if "GPUh" in col else "left")
    def amount(a: dict) -> str:
        """GPUs, and the GPU-equivalents fair share counts when CPU or memory is the larger share."""
        dom = a.get("dominant_gpus", a["gpus"])
        return f"{a['gpus']:g}" + (f" ({dom:g})" if abs(dom - a["gpus"]) > 1e-3 else "")

    for q in rows:
        depth = q["path"].count(".")
        table.add_row("  " * depth + q["path"].rsplit(".", 1)[-1], f"{q['guaranteed']['gpus']:g}",
                      "-" if q["limit"] is None else f"{q['limit']['gpus']:g}", f"{q['weight']:g}",
                      amount(q["allocated"]), amount(q["pending"]), f"{q['entitlement']['gpus']:g}",
                      f"{q['fair_share']['gpus']:g}", f"{q['usage']['gpu_hours_decayed']:.4f}",
                      f"{q['usage'].get('gpu_hours', 0.0):.4f}")
    console.print(table)
    if any(q.get("overcommitted") for q in rows):
        err.print("[yellow]warning:[/yellow] the top-level queues are guaranteed more GPUs than the cluster can divide "
                  "now: guarantees cannot all be honoured")


queues_app.command("list", help="List queues (as `gpuorch queues`).")(queues)


QUEUE_FIELDS = ("guaranteed", "limit", "weight", "priority", "preempt_min_runtime_s", "groups", "group_access",
                "max_priority")


@queues_app.command("set")
def queues_set(
    name: Annotated[str, typer.Argument(help="the queue's path, e.g. research.nlp (created if new)")],
    guarantee: Annotated[float | None, typer.Option("--guarantee", "--guaranteed", help="GPUs guaranteed")] = None,
    limit: Annotated[str | None, typer.Option("--limit", help="GPUs at most, or none")] = None,
    weight: Annotated[float | None, typer.Option(help="share of what is left over, against its siblings")] = None,
    priority: Annotated[int | None, typer.Option(help="reclaim order: higher keeps its GPUs longer")] = None,
    groups: Annotated[str | None, typer.Option(help="comma-separated groups whose users may submit here; "
                                                     "none: as the parent queue")] = None,
    group_access: Annotated[str | None, typer.Option(help="what users of those groups may do with each other's "
                                                           "jobs here: none, read or cancel")] = None,
    max_priority: Annotated[str | None, typer.Option(help="the highest priority a user may submit at here")] = None,
    url: UrlOpt = DEFAULT_URL,
    as_json: JsonOpt = False,
) -> None:
    """Create a queue, or change what these options say of it (the rest stays as it is)."""
    current = next((q for q in api("GET", url, "/v1/queues") if q["path"] == name), None)
    spec = {k: current[k] for k in QUEUE_FIELDS if k in current} if current else {}
    if guarantee is not None:
        spec["guaranteed"] = {"gpus": guarantee}
    if limit is not None:
        if limit.lower() in ("none", "-", ""):
            spec["limit"] = None
        else:
            try:
                spec["limit"] = {"gpus": float(limit)}
            except ValueError:
                fail(f"--limit takes a number of GPUs or none, not {limit!r}")
    if weight is not None:
        spec["weight"] = weight
    if priority is not None:
        spec["priority"] = priority
    if groups is not None:
        spec["groups"] = [] if groups.lower() in ("none", "-", "") else [g.strip() for g in groups.split(",") if g.strip()]
    if group_access is not None:
        spec["group_access"] = group_access
    if max_priority is not None:
        spec["max_priority"] = max_priority
    res = api("PUT", url, f"/v1/queues/{name}", json=spec)  # the API validates every field and says why not
    if as_json:
        print_json(res)
    else:
        what = ("created" if current is None else "updated") if res.get("changed", True) else "unchanged"
        console.print(f"queue {name} {what}: {_queue_line(res)}")


def _queue_line(q: dict[str, Any]) -> str:
    limit = "none" if q.get("limit") is None else f"{q['limit']['gpus']:g}"
    groups = (f", groups {','.join(q['groups'])} (each other's jobs: {q.get('group_access', 'none')})"
              if q.get("groups") else "")
    g = q["guaranteed"]["gpus"]
    return (f"guaranteed {g:g} GPU{'' if g == 1 else 's'}, limit {limit}, weight {q['weight']:g}, "
            f"priority {q['priority']}{groups}")


@queues_app.command("delete")
def queues_delete(name: Annotated[str, typer.Argument(help="the queue's path")], url: UrlOpt = DEFAULT_URL,
                  as_json: JsonOpt = False) -> None:
    """Delete a queue that has no child queues and no pending or running jobs."""
    res = api("DELETE", url, f"/v1/queues/{name}")
    print_json(res) if as_json else console.print(f"queue {name} deleted")


@queues_app.command("apply")
def queues_apply(
    path: Annotated[Path | None, typer.Argument(help="the file (or give it with -f, as kubectl apply)")] = None,
    file: Annotated[Path | None, typer.Option("-f", "--file", help="queue manifests: KAI Queue, Kueue ClusterQueue / "
                                                                    "LocalQueue / Cohort, Volcano Queue")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="show the queues it would apply; apply nothing")] = False,
    url: UrlOpt = DEFAULT_URL,
    as_json: JsonOpt = False,
) -> None:
    """Create or update the queues a file defines, parents first; jobs and other kinds in it are skipped."""
    from services.jobfiles import JobFileError, load_file

    if (path is None) == (file is None):
        fail("name one file: gpuorch queues apply FILE (or -f FILE)")
    file = path or file
    assert file is not None
    try:
        loaded = load_file(file, _jobfile_context(url, None))
    except JobFileError as e:
        fail(str(e))
    for note in loaded.notes:
        err.print(f"[dim]note:[/dim] {note}")
    for t in loaded.jobs:
        err.print(f"[dim]note:[/dim] {t.origin}: a job: submit it with gpuorch submit -f {file}")
    if not loaded.queues:
        fail(f"{file} defines no queue")
    out = []
    for q in loaded.queues:
        for w in q.warnings:
            err.print(f"[yellow]warning:[/yellow] {w}")
        if dry_run:
            out.append({"path": q.path, **q.spec})
            if not as_json:
                console.print(f"{q.path}: {q.spec}")
            continue
        res = api("PUT", url, f"/v1/queues/{q.path}", json=q.spec)
        out.append(res)
        if not as_json:
            console.print(f"queue {q.path} {'applied' if res.get('changed', True) else 'unchanged'}: {_queue_line(res)}")
    if as_json:
        print_json(out)


def _span(since: float, until: float) -> str:
    from datetime import UTC, datetime

    iso = lambda t: datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    return f"{iso(since)} to {iso(until)} ({(until - since) / 3600:.4g} h)"


@app.command()
def usage(since: SinceOpt = "24h", until: UntilOpt = "now", url: UrlOpt = DEFAULT_URL,
          as_json: JsonOpt = False) -> None:
    """GPU-hours per queue held from --since to --until, like sreport: exact at the window's edges."""
    rep = api("GET", url, "/v1/usage", params={"by": "queue", **window_params(since, until)})
    if as_json:
        print_json(rep)
        return
    from rich.table import Table

    console.print(f"GPU-hours held from {_span(rep['since'], rep['until'])}")
    table = Table(box=None, header_style="bold")
    table.add_column("QUEUE")
    table.add_column("GPU-HOURS", justify="right")
    for q, v in rep["queues"].items():
        table.add_row(q, f"{v['gpu_hours']:.4f}")
    console.print(table)


def _node_action(action: str, node_id: str, url: str, body: dict | None = None) -> None:
    res = api("POST", url, f"/v1/nodes/{node_id}/{action}", json=body or {})
    console.print(f"{action}: {node_id} " + (f"(seq {res['seq']})" if res.get("changed", True) else "(already so: nothing to do)"))


@app.command()
def cordon(node_id: str, reason: Annotated[str, typer.Option()] = "operator", url: UrlOpt = DEFAULT_URL) -> None:
    """Stop placing work on a node; what runs there keeps running."""
    _node_action("cordon", node_id, url, {"reason": reason})


@app.command()
def drain(node_id: str, grace: Annotated[str, typer.Option("--grace", help="how long each task has to exit after "
                                                                            "SIGTERM, before SIGKILL: 90s, 5m, or "
                                                                            "seconds")] = "300",
          reason: Annotated[str, typer.Option()] = "operator", url: UrlOpt = DEFAULT_URL) -> None:
    """Cordon a node and move its jobs elsewhere now: their tasks get SIGTERM (SIGKILL after --grace), the jobs
    go back to their queues."""
    _node_action("drain", node_id, url, {"grace_s": round(_duration_opt(grace, "--grace") or 0), "reason": reason})


@app.command()
def resume(node_id: str, url: UrlOpt = DEFAULT_URL) -> None:
    """Make a cordoned or drained node schedulable again."""
    _node_action("resume", node_id, url)


@app.command("inject-xid")
def inject_xid(node_id: str, xid: int, gpu: Annotated[int, typer.Option(help="GPU index on the node")] = 0,
               url: UrlOpt = DEFAULT_URL) -> None:
    """Simulated nodes: make a GPU report an XID as its driver would (79: fallen off the bus), to watch health act."""
    res = api("POST", url, f"/v1/nodes/{node_id}/inject-xid", json={"gpu_index": gpu, "xid": xid})
    console.print(f"xid {xid} on {node_id} GPU {gpu} ({res['gpu_uuid']}): watch `gpuorch nodes` and `gpuorch jobs`")


# --- pools and deployments ---------------------------------------------------------------

pools_app = typer.Typer(help="Node pools the autoscaler grows and shrinks (operators list, admins change).")
app.add_typer(pools_app, name="pools")
deployments_app = typer.Typer(help="Inference deployments: replicas that follow a posted queue length.")
app.add_typer(deployments_app, name="deployments")


@pools_app.callback(invoke_without_command=True)
def pools(ctx: typer.Context, url: UrlOpt = DEFAULT_URL, as_json: JsonOpt = False) -> None:
    """List pools: profile, nodes (min/now/max), coming, cost per hour, provider and its last error."""
    _listing(ctx, url, "/v1/pools", as_json,
             ("POOL", "PROFILE", "NODES(min/now/max)", "COMING", "IDLE-TIMEOUT", "COST/H", "PROVIDER"),
             lambda p: (p["name"], p["profile"], f"{p['min_nodes']}/{len(p['nodes'])}/{p['max_nodes']}",
                        str(p["in_flight"]), f"{p['idle_timeout_s']:g}s", f"{p['cost_per_hour']:g}",
                        p["provider"] + (f" (error: {p['provider_error']})" if p.get("provider_error") else "")))


pools_app.command("list", help="List pools (as `gpuorch pools`).")(pools)


POOL_FIELDS = ("profile", "min_nodes", "max_nodes", "provision_delay_s", "idle_timeout_s", "cost_per_node_hour",
               "hourly_cost_cap", "provider")


@pools_app.command("set")
def pools_set(
    name: Annotated[str, typer.Argument(help="the pool's name (created if new)")],
    profile: Annotated[str | None, typer.Option(help="the node shape it buys, e.g. dgx-h100")] = None,
    min_nodes: Annotated[int | None, typer.Option("--min", help="nodes it keeps")] = None,
    max_nodes: Annotated[int | None, typer.Option("--max", help="nodes it may have (0: shrink to nothing)")] = None,
    idle_timeout: Annotated[str | None, typer.Option(help="a node idle this long goes (90s, 10m)")] = None,
    provision_delay: Annotated[str | None, typer.Option(help="simulated pools: how long a node takes to come")] = None,
    cost_per_node_hour: Annotated[float | None, typer.Option(help="price of one node for an hour")] = None,
    cost_cap: Annotated[float | None, typer.Option(help="the most it may cost per hour")] = None,
    provider: Annotated[str | None, typer.Option(help="a provider of the server's providers file, or simulated")] = None,
    url: UrlOpt = DEFAULT_URL,
    as_json: JsonOpt = False,
) -> None:
    """Create a pool, or change what these options say of it (the rest stays as it is)."""
    current = next((p for p in api("GET", url, "/v1/pools") if p["name"] == name), None)
    body = {k: current[k] for k in POOL_FIELDS} if current else {}
    given = {"profile": profile, "min_nodes": min_nodes, "max_nodes": max_nodes,
             "idle_timeout_s": _duration_opt(idle_timeout, "--idle-timeout"),
             "provision_delay_s": _duration_opt(provision_delay, "--provision-delay"),
             "cost_per_node_hour": cost_per_node_hour, "hourly_cost_cap": cost_cap, "provider": provider}
    body.update({k: v for k, v in given.items() if v is not None})
    if current is None and ("profile" not in body or "max_nodes" not in body):
        fail(f"pool {name} is new: give --profile and --max")
    res = api("PUT", url, f"/v1/pools/{name}", json=body)
    if as_json:
        print_json(res)
    else:
        console.print(f"pool {name} {'updated' if current else 'created'}: {res['profile']}, "
                      f"{res['min_nodes']}-{res['max_nodes']} nodes, provider {res['provider']}")


@pools_app.command("delete")
def pools_delete(name: str, url: UrlOpt = DEFAULT_URL) -> None:
    """Delete a pool that has no node left (set --min 0 --max 0 first: its nodes go when idle)."""
    api("DELETE", url, f"/v1/pools/{name}")
    console.print(f"pool {name} deleted")


@deployments_app.callback(invoke_without_command=True)
def deployments(ctx: typer.Context, url: UrlOpt = DEFAULT_URL, as_json: JsonOpt = False) -> None:
    """List deployments: replicas (min/live/max), waiting requests per replica target, queue, command."""
    _listing(ctx, url, "/v1/deployments", as_json,
             ("DEPLOYMENT", "REPLICAS(min/live/max)", "PENDING", "PER-REPLICA", "QUEUE", "GPUS", "COMMAND"),
             lambda d: (d["name"], f"{d['spec']['min_replicas']}/{d['live_replicas']}/{d['spec']['max_replicas']}",
                        f"{d['pending_requests']:g}", f"{d['spec']['target_pending_per_replica']:g}",
                        d["spec"]["job"]["queue"], f"{d['spec']['job']['resources']['gpus']:g}",
                        shlex.join(d["spec"]["job"]["command"])[:60]))


deployments_app.command("list", help="List deployments (as `gpuorch deployments`).")(deployments)


@deployments_app.command("set")
def deployments_set(
    name: Annotated[str, typer.Argument(help="the deployment's name")],
    command: Annotated[list[str], typer.Argument(help="what each replica runs")],
    queue: Annotated[str, typer.Option("-q", "--queue")] = "default",
    gpus: Annotated[float, typer.Option("-g", "--gpus", help="GPUs per replica")] = 1.0,
    cpu: Annotated[int, typer.Option(help="milli-CPU per replica")] = 0,
    memory: Annotated[int, typer.Option(help="MiB per replica")] = 0,
    min_replicas: Annotated[int, typer.Option("--min")] = 0,
    max_replicas: Annotated[int, typer.Option("--max")] = 1,
    per_replica: Annotated[float, typer.Option(help="waiting requests one replica takes")] = 1.0,
    stabilization: Annotated[str, typer.Option(help="scale down only after demand stayed lower this long")] = "60s",
    scale_to_zero_after: Annotated[str, typer.Option(help="with --min 0: no request for this long")] = "300s",
    env: Annotated[list[str] | None, typer.Option("-e", "--env", help="K=V (repeatable)")] = None,
    url: UrlOpt = DEFAULT_URL,
    as_json: JsonOpt = False,
) -> None:
    """Define a deployment, whole (what is not given takes its default). Its server posts its queue length to
    POST /v1/deployments/NAME/metrics; replicas follow it."""
    bad = [e for e in env or [] if "=" not in e]
    if bad:
        fail(f"--env takes K=V, got {bad[0]!r}")
    body = {"command": command, "queue": queue, "resources": {"gpus": gpus, "cpu_milli": cpu, "memory_mib": memory},
            "min_replicas": min_replicas, "max_replicas": max_replicas, "target_pending_per_replica": per_replica,
            "stabilization_s": _duration_opt(stabilization, "--stabilization"),
            "scale_to_zero_after_s": _duration_opt(scale_to_zero_after, "--scale-to-zero-after"),
            "env": dict(e.split("=", 1) for e in env or [])}
    res = api("PUT", url, f"/v1/deployments/{name}", json=body)
    if as_json:
        print_json(res)
    else:
        console.print(f"deployment {name}: {min_replicas}-{max_replicas} replicas of {gpus:g} GPU(s) in queue "
                      f"{queue}, one per {per_replica:g} waiting requests")


@deployments_app.command("delete")
def deployments_delete(name: str, url: UrlOpt = DEFAULT_URL) -> None:
    """Delete a deployment; its replicas are cancelled."""
    res = api("DELETE", url, f"/v1/deployments/{name}")
    console.print(f"deployment {name} deleted; its {res['replicas']} replica(s) are being cancelled")


def _duration_opt(text: str | None, flag: str) -> float | None:
    from shared.timespec import duration_s

    if text is None:
        return None
    seconds = float(text) if text.strip().isdigit() else duration_s(text)
    if seconds is None:
        fail(f"{flag} {text!r}: write a duration (90s, 10m, 2h) or seconds")
    return seconds


def _listing(ctx: typer.Context, url: str, path: str, as_json: bool, columns: tuple[str, ...],
             row: Callable[[dict[str, Any]], tuple[str, ...]]) -> None:
    """A command group's own listing (``gpuorch pools``): GET ``path``, as JSON or one table row per object."""
    from rich.table import Table

    if ctx.invoked_subcommand is not None:
        return
    rows = api("GET", url, path)
    if as_json:
        print_json(rows)
        return
    table = Table(box=None, header_style="bold")
    for col in columns:
        table.add_column(col)
    for r in rows:
        table.add_row(*row(r))
    console.print(table)


# --- identity ----------------------------------------------------------------------------


@app.command()
def whoami(url: UrlOpt = DEFAULT_URL, as_json: JsonOpt = False) -> None:
    """Who the API takes you for: user, groups, role."""
    me = api("GET", url, "/v1/whoami")
    print_json(me) if as_json else console.print(f"{me['user']} ({me['role']}; groups: {', '.join(me['groups']) or '-'})")


@tokens_app.command("create")
def tokens_create(
    user: Annotated[str, typer.Option("--user", help="the user the token stands for")],
    groups: Annotated[str, typer.Option("--groups", help="comma-separated groups (queues admit groups)")] = "",
    role: Annotated[str, typer.Option("--role", help="user, operator or admin")] = "user",
    name: Annotated[str, typer.Option("--name", help="a note: what the token is for")] = "",
    expires_days: Annotated[float | None, typer.Option("--expires-days", help="valid this many days (default: no end)")] = None,
    url: UrlOpt = DEFAULT_URL,
    as_json: JsonOpt = False,
) -> None:
    """Issue a token (printed once; only its hash is kept)."""
    body = {"user": user, "groups": [g for g in groups.split(",") if g], "role": role, "name": name,
            **({"expires_in_s": int(expires_days * 86400)} if expires_days else {})}
    rec = api("POST", url, "/v1/tokens", json=body)
    if as_json:
        print_json(rec)
    else:
        err.print(f"token {rec['id']} for {rec['user']} ({rec['role']}; groups: {', '.join(rec['groups']) or '-'}):")
        print(rec["token"])


@tokens_app.command("list")
def tokens_list(url: UrlOpt = DEFAULT_URL, as_json: JsonOpt = False) -> None:
    """Every token: id, user, groups, role, expiry (never the token itself)."""
    import time

    from rich.table import Table

    rows = api("GET", url, "/v1/tokens")
    if as_json:
        print_json(rows)
        return
    table = Table(box=None, header_style="bold")
    for col in ("ID", "USER", "ROLE", "GROUPS", "NAME", "AGE", "EXPIRES"):
        table.add_column(col)
    now = time.time()
    for t in rows:
        expires = "-" if not t["expires_at"] else time.strftime("%Y-%m-%d %H:%M", time.localtime(t["expires_at"]))
        table.add_row(t["id"], t["user"], t["role"], ",".join(t["groups"]) or "-", t["name"] or "-",
                      age(t["created_at"], now), expires)
    console.print(table)


@tokens_app.command("revoke")
def tokens_revoke(token_id: Annotated[str, typer.Argument(help="the token's id (gpuorch tokens list)")],
                  url: UrlOpt = DEFAULT_URL) -> None:
    """Revoke a token: every API process refuses it within seconds."""
    rec = api("DELETE", url, f"/v1/tokens/{token_id}")
    console.print(f"revoked {rec['id']} ({rec['user']})")


@app.command("bus-credentials")
def bus_credentials(
    directory: Annotated[Path, typer.Argument(help="where to write auth.conf and one <user>.json per user")],
    node: Annotated[list[str] | None, typer.Option("--node", help="a node whose agent gets its own user (repeatable)")] = None,
) -> None:
    """Users for an external NATS (compose, a cluster): `include` DIR/auth.conf in nats-server.conf and give each
    process its DIR/<user>.json as GPUORCH_NATS_CREDENTIALS (agents: --nats-credentials). Run again to add nodes."""
    creds = Credentials(directory)
    creds.control()
    for n in node or []:
        try:
            creds.agent(n)
        except ValueError as e:
            fail(str(e))
    files = write_client_files(creds, directory)
    console.print(f"{creds.conf} ({len(files)} users): " + ", ".join(f.name for f in files))


# --- events ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def open_log(nats: str | None, data_dir: Path | None) -> AsyncIterator[EventLog]:
    if nats and data_dir:
        fail("give --nats or --data-dir, not both")
    server, user = None, None
    if not nats:
        data_dir = data_dir or local_data_dir()
        creds = Credentials.of_data_dir(data_dir)
        user = creds.control() if creds.path.exists() else None  # the stack's own bus credentials (0600, its owner's)
        if not (data_dir / "nats").exists():
            fail(f"no event log under {data_dir}: start the stack there first, "
                 "or pass --data-dir DIR (a stack's data dir) or --nats URL")
        lock = stack.data_dir_lock(data_dir)
        try:
            lock.__enter__()
        except SystemExit:  # a stack is running there: read through its own server
            nats = _stack_nats(data_dir)
            if nats is None:
                fail(f"a stack is running on {data_dir} but its {data_dir / 'stack.json'} names no NATS URL: pass --nats URL")
        else:
            nats = surviving_nats(data_dir)  # a killed stack's server still holds the store: read through it
            if nats is not None:
                lock.__exit__(None, None, None)
            else:
                server = NatsServer(data_dir / "nats", credentials=creds if user else None).start()
                nats = server.url
    try:
        evlog = await EventLog.connect(nats, ensure=False, user=user.name if user else None,
                                       password=user.password if user else None)
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
    from shared.redact import redact

    data = redact(rec.data.model_dump(mode="json", exclude={rec.data.KEY}))
    summary = " ".join(f"{k}={json.dumps(v, separators=(',', ':'))[:60]}" for k, v in data.items() if v not in (None, "", [], {}))
    ts = rec.time.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3]
    by = f" by={rec.actor}" if rec.actor else ""
    return f"{rec.seq:>8}  {ts:<24} {rec.data.TYPE:<22} {rec.subject:<32} {summary[:160]}{by}"


def _emit(rec: Record | dict[str, Any], as_json: bool) -> None:
    """One event as ``record_json`` shows it (``rec``: a record, or that JSON as the API answered it)."""
    from shared.api_events import record_json
    from shared.eventlog import RawRecord

    shown = rec if isinstance(rec, dict) else record_json(rec)
    if as_json:
        print(json.dumps(shown), flush=True)
        return
    if isinstance(rec, dict):
        seq = int(rec["seq"])
        rec = (Undecodable(seq, str(rec["undecodable"]), False, "") if "undecodable" in rec
               else RawRecord(seq, b"", json.dumps({k: v for k, v in rec.items() if k != "seq"}).encode()).decoded())
    console.print(event_line(rec), markup=False, highlight=False, soft_wrap=True)


def _log_here(nats: str | None, data_dir: Path | None) -> bool:
    """Read the log from NATS (--nats, --data-dir, or a stack's data dir here, running or stopped), not the API."""
    return bool(nats or data_dir or (local_data_dir() / "nats").exists())


def _api_events(url: str, after: int | None, follow: bool) -> Iterator[dict[str, Any]]:
    """The log's events through the API (operators): from ``after`` + 1 (None: new ones only), page by page until
    caught up, or, to ``follow``, its event stream until interrupted."""
    import httpx

    if not follow:
        while page := api("GET", url, "/v1/events", params={"after": after or 0, "limit": 1000}):
            yield from page
            after = page[-1]["seq"]
        return
    url = resolve_url(url)
    token = resolve_token(url)
    params = {} if after is None else {"after": after}
    try:
        with httpx.stream("GET", url.rstrip("/") + "/v1/events/stream", params=params, timeout=httpx.Timeout(30, read=None),
                          headers={"authorization": f"Bearer {token}"} if token else {}) as resp:
            refused(resp, url, token)
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    yield json.loads(line.removeprefix("data: "))
    except httpx.HTTPError as e:
        fail(f"lost gpuorch at {url} ({type(e).__name__}): is `gpuorch up` running? (--url or GPUORCH_URL)")


@events_app.command("tail")
def events_tail(
    nats: NatsOpt = None,
    data_dir: DataDirOpt = None,
    from_seq: Annotated[int | None, typer.Option("--from", help="start at this sequence (default: new events only)")] = None,
    url: UrlOpt = DEFAULT_URL,
    as_json: JsonOpt = False,
) -> None:
    """Follow the log: one line per event as it is stored. Without --nats or --data-dir and with no stack's data
    dir here, through the API at --url (an operator's token)."""
    if not _log_here(nats, data_dir):
        with contextlib.suppress(KeyboardInterrupt):
            for event in _api_events(url, None if from_seq is None else from_seq - 1, follow=True):
                _emit(event, as_json)
        return

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
    url: UrlOpt = DEFAULT_URL,
    as_json: JsonOpt = False,
) -> None:
    """Print the history from a sequence until caught up. Without --nats or --data-dir and with no stack's data
    dir here, through the API at --url (an operator's token)."""
    if not _log_here(nats, data_dir):
        for n, event in enumerate(_api_events(url, from_seq - 1, follow=False), 1):
            _emit(event, as_json)
            if limit and n >= limit:
                break
        return

    async def run() -> None:
        async with open_log(nats, data_dir) as evlog, contextlib.aclosing(evlog.replay(from_seq)) as records:
            n = 0
            async for rec in records:
                _emit(rec, as_json)
                n += 1
                if limit and n >= limit:
                    break

    asyncio.run(run())


@events_app.command("verify")
def events_verify(nats: NatsOpt = None, data_dir: DataDirOpt = None, as_json: JsonOpt = False) -> None:
    """Re-fold the whole log through every projection; print digests and what each refused. Exit 1 on an invalid
    transition only: skipped events (unknown type, malformed), fenced decisions (a stale leader's, refused by the
    term rule), refused reports (a task report from another node) and late cancellations (of a job that had ended
    meanwhile) are what the log is built to absorb."""

    async def run() -> list[dict[str, Any]]:
        async with open_log(nats, data_dir) as evlog:
            return await verify_log(evlog)

    results = asyncio.run(run())
    bad = max((r["invalid_transitions"] for r in results), default=0)  # every projection folds the same events
    if as_json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            console.print(f"{r['service']:<11} seq={r['seq']:<9} applied={r['applied']:<9} digest={r['digest']} "
                          + " ".join(f"{k}={r[k]}" for k in ("invalid_transitions", *EXPECTED)), highlight=False)
            for kind in ("invalid", *EXPECTED):
                for line in r["details"][kind]:
                    console.print(f"  {kind}: {line}", markup=False, highlight=False)
        expected = {k: max(r[k] for r in results) for k in EXPECTED} if results else {}
        absorbed = ", ".join(f"{n} {k}" for k, n in expected.items() if n)
        if bad:
            console.print(f"[red]{bad} invalid transition(s) found[/red]" + (f" (and {absorbed})" if absorbed else ""))
        else:
            console.print("[green]log verified[/green]" + (f": {absorbed}, as expected" if absorbed else ""))
    raise typer.Exit(1 if bad else 0)


EXPECTED = ("skipped", "fenced", "refused", "late")  # rejections the log is built to absorb (see `events verify`)


async def verify_log(evlog: EventLog) -> list[dict[str, Any]]:
    """Fold the whole log through a fresh copy of every projection: per service, its digest and what it
    refused, by kind (``invalid_transitions`` counts only real invalid transitions)."""
    settings = Settings()
    projections = [stack.build_service(n, settings).projection for n in stack.SERVICES]
    skipped: list[str] = []
    async for rec in evlog.replay(1):
        if isinstance(rec, Undecodable):
            skipped.append(f"seq={rec.seq} {rec.reason}")
            for p in projections:
                p.skip(rec.seq, rec.subject)
            continue
        for p in projections:
            p.apply(rec)
    out = []
    for p in projections:
        details: dict[str, list[str]] = {"invalid": [], "fenced": [], "refused": [], "late": [], "skipped": skipped[:50]}
        for line, kind in zip(p.invalid_transitions, p.invalid_kinds):
            if len(details[kind]) < 50:
                details[kind].append(line)
        out.append({
            "service": p.name, "seq": p.seq, "applied": p.applied, "digest": p.digest(),
            "invalid_transitions": p.kinds.get("invalid", 0), "fenced": p.kinds.get("fenced", 0),
            "refused": p.kinds.get("refused", 0), "late": p.kinds.get("late", 0), "skipped": len(skipped),
            "details": details,
        })
    return out


@events_app.command("schema")
def events_schema(directory: Annotated[Path, typer.Argument(help="where to write one JSON Schema per event type")]) -> None:
    """Export the JSON Schema of every event type."""
    paths = export_schemas(directory)
    console.print(f"wrote {len(paths)} schemas to {directory}")


def _register_simulate() -> None:
    from services.simulate import simulate

    app.command(help="Replay a trace or recorded history through the same cores in virtual time; compare policies.")(simulate)


_register_simulate()


def token_first(argv: list[str]) -> list[str]:
    """``--token T`` is the whole CLI's option: taken from wherever it is written (`gpuorch jobs --token T`, as
    kubectl takes it) to the front, where typer reads it; what follows ``--`` (a job's command) is left alone."""
    end = argv.index("--") if "--" in argv else len(argv)
    head, moved = [], []
    i = 0
    while i < end:
        if argv[i] == "--token" and i + 1 < end:
            moved += argv[i:i + 2]
            i += 2
            continue
        if argv[i].startswith("--token="):
            moved.append(argv[i])
        else:
            head.append(argv[i])
        i += 1
    return moved + head + argv[end:]


def main() -> None:
    app(args=token_first(sys.argv[1:]))


if __name__ == "__main__":
    main()

