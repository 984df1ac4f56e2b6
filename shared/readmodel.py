"""The job history read model: every job ever submitted, projected into SQL (SQLite file or PostgreSQL).

The in-memory projections keep only recent finished jobs; this table keeps them
all, for `GET /v1/jobs/{id}` of an old job and for reports. The projector stores
the last applied stream sequence in the same transaction as the rows, so applying
a batch twice (a redelivery, a restart) changes nothing: exactly once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path

from sqlalchemy import Engine, bindparam, insert, update
from sqlmodel import Field, Session, SQLModel, create_engine, select

from shared import events as ev
from shared.eventlog import EventLog, RawRecord, Undecodable
from shared.events import Envelope

log = logging.getLogger("gpuorch.readmodel")


class JobRow(SQLModel, table=True):
    __tablename__ = "gpuorch_jobs"
    job_id: str = Field(primary_key=True)
    name: str
    queue: str = Field(index=True)
    priority: str
    state: str = Field(index=True)
    tasks: int
    gpu_milli: int
    submitted_at: float
    placed_at: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    reason: str = ""
    nodes: str = ""
    preemptions: int = 0
    owner: str = Field(default="", index=True)


class Cursor(SQLModel, table=True):
    __tablename__ = "gpuorch_cursors"
    name: str = Field(primary_key=True)
    seq: int = 0


def engine_for(url: str | None, data_dir: Path) -> Engine:
    """SQLite under the data dir by default; PostgreSQL (or any SQLAlchemy URL) when given."""
    if not url:
        data_dir.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{data_dir / 'readmodel.db'}"
    engine = create_engine(url, pool_pre_ping=True)
    SQLModel.metadata.create_all(engine)
    _add_missing_columns(engine)
    return engine


def _add_missing_columns(engine: Engine) -> None:
    """Tables made by an older version lack newer columns (create_all adds tables only): add them, with defaults."""
    from sqlalchemy import inspect, literal, text

    for table in SQLModel.metadata.sorted_tables:
        have = {c["name"] for c in inspect(engine).get_columns(table.name)}
        for col in table.columns:
            if col.name in have:
                continue
            default = col.default.arg if col.default is not None else None
            clause = "" if default is None else \
                f" DEFAULT {literal(default).compile(engine, compile_kwargs={'literal_binds': True})}"
            with engine.begin() as conn:
                conn.execute(text(f"ALTER TABLE {table.name} ADD COLUMN {col.name} {col.type.compile(engine.dialect)}{clause}"))
            log.info("event=column_added table=%s column=%s", table.name, col.name)


ENDS = {ev.JobSucceeded: "succeeded", ev.JobFailed: "failed", ev.JobCancelled: "cancelled", ev.JobRejected: "rejected"}


class Row:
    """A job's row while a batch folds: plain attributes (an ORM object paid SQLAlchemy's bookkeeping on every
    attribute set and flush: 60 us an event, an eighth of the stack's CPU during batch submissions)."""

    __slots__ = COLUMNS = tuple(JobRow.model_fields)

    def __init__(self, **values: object) -> None:
        for name in self.COLUMNS:
            setattr(self, name, values[name] if name in values else JobRow.model_fields[name].default)

    def values(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.COLUMNS}


def fold_row(row: Row | None, env: Envelope) -> Row | None:
    """One job event onto its row (None for events that are not about jobs, or a job never submitted)."""
    e, t = env.data, env.timestamp
    if isinstance(e, ev.JobSubmitted):
        s = e.spec
        return row or Row(job_id=e.job_id, name=s.name, queue=s.queue, priority=s.priority, state="submitted",
                          tasks=s.tasks, gpu_milli=s.gpu_milli * s.tasks, submitted_at=e.submitted_at or t,
                          owner=e.owner or "")
    if row is None:
        return None
    if isinstance(e, ev.JobQueued | ev.JobReleased):
        row.state, row.reason = "queued", ""
    elif isinstance(e, ev.JobHeld):
        row.state, row.reason = "held", e.reason
    elif isinstance(e, ev.JobUnschedulable):
        row.reason = e.reason
    elif isinstance(e, ev.JobPlaced):
        row.state, row.placed_at = "placed", t
        row.nodes = ",".join(sorted({p.node_id for p in e.placements}))
    elif isinstance(e, ev.JobTaskStarted):
        row.state, row.started_at = "running", row.started_at or t
    elif isinstance(e, ev.JobPreempting):
        row.state, row.reason = "preempting", e.reason
    elif isinstance(e, ev.JobPreempted):
        row.state, row.preemptions = "preempted", row.preemptions + 1
    elif type(e) in ENDS:
        row.state, row.ended_at = ENDS[type(e)], t
        row.reason = getattr(e, "reason", "") or row.reason
        row.exit_code = getattr(e, "code", None)
    return row


class JobHistory:
    """Projects job events into SQL in batches, one transaction per batch with the cursor."""

    def __init__(self, url: str | None, data_dir: Path, name: str = "jobs") -> None:
        self.url, self.data_dir, self.name = url, data_dir, name
        self._engine: Engine | None = None

    @property
    def engine(self) -> Engine:
        """Connected on first use: building a service (e.g. for `events verify`) touches no database."""
        if self._engine is None:
            self._engine = engine_for(self.url, self.data_dir)
        return self._engine

    def cursor(self) -> int:
        with Session(self.engine) as s:
            c = s.get(Cursor, self.name)
            return c.seq if c else 0

    def apply(self, envs: Iterable[Envelope | Undecodable | RawRecord]) -> int:
        """Fold a batch (decoding what comes undecoded); events at or below the stored cursor are skipped. Returns
        how many were applied."""
        envs = [e.decoded() if isinstance(e, RawRecord) else e for e in envs]
        with Session(self.engine) as s, s.begin(), s.no_autoflush:
            cur = s.get(Cursor, self.name, with_for_update=True) or Cursor(name=self.name, seq=0)
            todo = [env for env in envs if env.seq > cur.seq]
            if todo:
                cur.seq = max(env.seq for env in todo)
            todo = [env for env in todo if not isinstance(env, Undecodable) and env.data.aggregate == "job"]
            # the batch's rows in a few queries, not one per job (a flood's batch holds a thousand new jobs); then
            # one INSERT of the new rows and one UPDATE of the others, each with many parameter sets
            table = JobRow.__table__
            ids = list(dict.fromkeys(env.data.job_id for env in todo))
            rows: dict[str, Row | None] = dict.fromkeys(ids)
            for i in range(0, len(ids), 500):
                found = s.connection().execute(select(table).where(table.c.job_id.in_(ids[i:i + 500])))
                rows.update((r.job_id, Row(**r._mapping)) for r in found)
            stored = {job_id for job_id, row in rows.items() if row is not None}
            for env in todo:
                rows[env.data.job_id] = fold_row(rows[env.data.job_id], env)
            applied = len(todo)
            new = [row.values() for job_id, row in rows.items() if row is not None and job_id not in stored]
            old = [{**row.values(), "key": job_id} for job_id, row in rows.items()
                   if row is not None and job_id in stored]
            if new:
                s.connection().execute(insert(table), new)
            if old:
                s.connection().execute(update(table).where(table.c.job_id == bindparam("key")), old)
            s.add(cur)
        return applied

    def get(self, job_id: str) -> JobRow | None:
        with Session(self.engine) as s:
            return s.get(JobRow, job_id)

    def name_and_queue(self, job_id: str) -> tuple[str, str] | None:
        """A job's name and queue if it was ever recorded, else None: one indexed read without the ORM (a keyed
        submission asks it of every new job id: 70 us, against 115 for ``get``)."""
        table = JobRow.__table__
        with self.engine.connect() as c:
            row = c.execute(select(table.c.name, table.c.queue).where(table.c.job_id == job_id)).first()
        return None if row is None else (row.name, row.queue)

    def list(self, queue: str | None = None, state: str | None = None, limit: int = 1000) -> list[JobRow]:
        with Session(self.engine) as s:
            q = select(JobRow)
            if queue:
                q = q.where(JobRow.queue == queue)
            if state:
                q = q.where(JobRow.state == state)
            return list(s.exec(q.order_by(JobRow.submitted_at.desc()).limit(limit)))

    async def follow(self, log_: EventLog, interval_s: float = 1.0, batch: int = 2000) -> None:
        """Catch up with the log, then keep up (a service timer)."""
        while True:
            try:
                chunk: list = []
                # undecoded: the thread that applies a chunk decodes it, not the event loop (bench.backlog: a
                # catch-up of thousands of events held every request)
                async for rec in log_.replay(self.cursor() + 1, ["gpuorch.events.job.>"], raw=True):
                    chunk.append(rec)
                    if len(chunk) >= batch:
                        await asyncio.to_thread(self.apply, chunk)
                        chunk = []
                if chunk:
                    await asyncio.to_thread(self.apply, chunk)
            except Exception as e:  # noqa: BLE001 - the next round retries from the stored cursor
                log.warning("read model error=%r", e)
            await asyncio.sleep(interval_s)
