"""Each node's work, as its agent reads it: one message per (node, job) on ``gpuorch.work.<node>.<job>``.

An agent does not read the whole event log (every job's events, on every node: the
log's traffic times the nodes). Inventory, which folds the log, writes each node's
share of it into the stream GPUORCH_WORK, which keeps the latest message per subject
(a key-value view): a job placed there (its spec, owner, attempt, gang and the gang's
addresses), a stop with its grace, the end of the job there; and a node's own notice
(``_node``: it was marked lost). The agent follows only its node's subjects (its bus
permissions say so), from each subject's latest message: after a restart it reads
its node's current work and nothing else, as a kubelet lists its pods.

Every message names the log's sequence of the event it comes from (``seq``), and is
written only over an older one (``Nats-Expected-Last-Subject-Sequence``): a
redelivered or lagging writer (an inventory replica behind another) never replaces
a later word. An ended job's last word lapses after an hour (``Nats-TTL``).
"""

from __future__ import annotations

import asyncio

from nats.js.errors import APIError, NotFoundError
from pydantic import BaseModel, ConfigDict

from shared import events as ev
from shared.eventlog import WORK_STREAM, WRONG_LAST_SEQUENCE, EventLog
from shared.events import Envelope, TaskPlacement, subject_token
from shared.model import JobId, JobSpec
from shared.natsauth import node_token
from shared.projection import Projection
from shared.runtime import Reaction, Service
from shared.telemetry import current_traceparent

WORK_PREFIX = "gpuorch.work"
NODE_NOTICE = "_node"  # the last token of a node's own notice (job ids start with a letter)
ENDED_TTL_S = 3600
STORED = {"stored": True}  # JobSpec's validation context for what was logged already
GRACE = (ev.JobPreempting, ev.JobTimedOut)
ENDS = (ev.JobSucceeded, ev.JobFailed, ev.JobCancelled, ev.JobPreempted, ev.JobRequeued)


def work_subject(node_id: str, job_id: str = NODE_NOTICE) -> str:
    return f"{WORK_PREFIX}.{node_token(node_id)}.{subject_token(job_id)}"


def node_work(node_id: str) -> str:
    """The subjects of one node's work (its agent's filter, and the bound of its permissions)."""
    return f"{WORK_PREFIX}.{node_token(node_id)}.>"


class WorkOrder(BaseModel):
    """A job's tasks on one node: run them (``attempt``, the log sequence of their job.placed), stop them within
    ``stop_grace_s``, or, ``ended``, stop what is left and forget the job."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    seq: int
    job_id: JobId
    attempt: int = 0
    ended: bool = False
    stop_grace_s: int | None = None
    owner: str = ""
    spec: JobSpec | None = None
    placements: list[TaskPlacement] = []
    addresses: dict[str, str] = {}
    traceparent: str | None = None

    def tasks_on(self, node_id: str) -> list[int]:
        return [p.task for p in self.placements if p.node_id == node_id]


class NodeNotice(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")
    seq: int
    event_id: str
    lost: str = ""  # why the control plane marked the node lost: its agent registers again


class WorkWriter:
    """Writes GPUORCH_WORK, each message only over an older one."""

    def __init__(self, log_: EventLog, remember: int = 100_000) -> None:
        self.log = log_
        # subject -> (its stream sequence, its word's seq) as this writer last wrote it: the next word of the same
        # (node, job) is written without reading it first; a stale guess is refused by the server, then read
        self.written: dict[str, tuple[int, int]] = {}
        self.remember = remember

    async def put(self, subject: str, word: WorkOrder | NodeNotice, ttl_s: int | None = None) -> None:
        body = word.model_dump_json(exclude_defaults=True).encode()
        guess = self.written.pop(subject, None)
        for _ in range(10):
            if guess is None:
                guess = await self._last(subject)
            last_seq, last_word = guess
            if last_word >= word.seq:
                self.written[subject] = guess
                return  # a later event (or this one, redelivered) wrote it already
            headers = {"Nats-Expected-Last-Subject-Sequence": str(last_seq)}
            if ttl_s:
                headers["Nats-TTL"] = f"{ttl_s}s"
            try:
                ack = await self.log.js.publish(subject, body, stream=WORK_STREAM, headers=headers, timeout=5)
            except APIError as e:
                if e.err_code != WRONG_LAST_SEQUENCE:
                    raise
                guess = None  # written meanwhile (another replica), or lapsed: read it
                continue
            self.written[subject] = (ack.seq, word.seq)
            if len(self.written) > self.remember:
                self.written.pop(next(iter(self.written)))
            return
        raise RuntimeError(f"{subject}: written over too often while writing seq {word.seq}")

    async def _last(self, subject: str) -> tuple[int, int]:
        try:
            last = await self.log.js.get_last_msg(WORK_STREAM, subject)
        except NotFoundError:
            return 0, 0
        return last.seq or 0, _seq_of(last.data)


class _Seq(BaseModel):
    model_config = ConfigDict(extra="ignore")
    seq: int = 0


def _seq_of(body: bytes | None) -> int:
    try:
        return _Seq.model_validate_json(body or b"{}").seq
    except ValueError:
        return 0  # unreadable: any word replaces it


def orders(env: Envelope, proj: Projection) -> list[tuple[str, WorkOrder | NodeNotice, int | None]]:
    """What the event means for the nodes' work: (subject, message, ttl) to write, from the event and the job as
    folded (its spec and owner do not change; which nodes hold it is read from the event where it says so)."""
    e = env.data
    if isinstance(e, ev.NodeLost):
        return [(work_subject(e.node_id), NodeNotice(seq=env.seq, event_id=env.id, lost=e.reason or "lost"), None)]
    job = proj.jobs.get(getattr(e, "job_id", "")) if isinstance(e, (ev.JobPlaced, *GRACE, *ENDS)) else None
    if job is None:
        return []
    if isinstance(e, ev.JobPlaced):
        nodes = list(dict.fromkeys(p.node_id for p in e.placements))
        addresses = {n: s.info.address or s.info.hostname for n in nodes if (s := proj.nodes.get(n)) is not None}
        # as folded, not checked again (a spec logged before a bound was added stays readable: see JobSpec, stored)
        order = WorkOrder.model_validate(
            {"seq": env.seq, "job_id": e.job_id, "attempt": env.seq, "owner": job.owner or "", "spec": job.spec,
             "placements": list(e.placements), "addresses": addresses, "traceparent": current_traceparent()},
            context=STORED)
        return [(work_subject(n, e.job_id), order, None) for n in nodes]
    # the nodes of the placements the job has as folded (the reaction adds every node holding a word of it)
    nodes = list(dict.fromkeys(p.node_id for p in [*job.last_placements, *job.placements]))
    word, ttl = stop_word(env)
    return [(work_subject(n, e.job_id), word, ttl) for n in nodes]


def stop_word(env: Envelope) -> tuple[WorkOrder, int | None]:
    """A stop (with the event's grace) or an end (lapsing) of the event's job, for every node that holds it."""
    e = env.data
    if isinstance(e, GRACE):
        return WorkOrder(seq=env.seq, job_id=e.job_id, stop_grace_s=e.grace_s), None
    return WorkOrder(seq=env.seq, job_id=e.job_id, ended=True), ENDED_TTL_S


def work_reaction(svc: Service) -> Reaction:
    """Inventory's reaction: write what each event means for the nodes' work (idempotent: see WorkWriter)."""
    writer: WorkWriter | None = None

    async def react(env: Envelope) -> None:
        nonlocal writer
        todo = orders(env, svc.projection)
        job = svc.projection.jobs.get(env.data.job_id) if isinstance(env.data, (*GRACE, *ENDS)) else None
        if job is not None and job.seq > env.seq:
            # the fold is past this event (another service of the process folded later ones: the job may have been
            # placed again elsewhere since): every node that holds a word of the job; one that holds a later word
            # keeps it (WorkWriter)
            word, ttl = stop_word(env)
            held = await svc.log.js.stream_info(WORK_STREAM, subjects_filter=work_subject("*", env.data.job_id))
            todo = [(subject, word, ttl) for subject in {*(s for s, _, _ in todo), *(held.state.subjects or {})}]
        if not todo:
            return
        if writer is None:
            writer = WorkWriter(svc.log)
        await asyncio.gather(*(writer.put(subject, word, ttl) for subject, word, ttl in todo))  # one per node
    return react
