"""The `gpuorch` command."""

from __future__ import annotations

import asyncio
import contextlib
import json
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
console = Console()
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
) -> None:
    """Start the whole stack: embedded nats-server, every service, the HTTP API. Ctrl-C stops it."""
    stack.up(
        Settings(port=port, data_dir=data_dir, nats_url=nats, sync_always=sync_always, snapshot_every=snapshot_every),
        split=split,
    )


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
        except SystemExit:
            fail(f"a stack is running on {data_dir}: use --nats {_stack_nats(data_dir)} instead")
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


def _stack_nats(data_dir: Path) -> str:
    try:
        return json.loads((data_dir / "stack.json").read_text())["nats_url"]
    except (OSError, ValueError, KeyError):
        return "URL"


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


def main() -> None:
    app()


if __name__ == "__main__":
    main()

