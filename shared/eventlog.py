"""The event log on NATS JetStream: append, replay, durable consumers, dead letters, KV and snapshots.

One stream, ``GPUORCH``, holds every event under ``gpuorch.events.<aggregate>.<id>``.
It denies delete and purge (it is the audit trail) and discards new messages when
full rather than dropping history. A retried append carries the same
``Nats-Msg-Id`` and is stored once within the duplicate window. An append that
depends on an aggregate's state passes the sequence it read; JetStream refuses it
if another writer got there first, and the caller re-reads and decides again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import APIError, BadRequestError, KeyWrongLastSequenceError, NoStreamResponseError, NotFoundError
from nats.js.kv import KeyValue

from pydantic_core import from_json

from shared.aio import wait_event
from shared.events import SUBJECT_PREFIX, Envelope, MalformedEvent, UnknownEventType, decode, subject_token
from shared.telemetry import in_trace, publishing, tracing_on

log = logging.getLogger("gpuorch.eventlog")

STREAM = "GPUORCH"
DLQ_STREAM = "GPUORCH_DLQ"
DLQ_PREFIX = "gpuorch.dlq"
TELEMETRY_STREAM = "GPUORCH_TELEMETRY"
AGENT_STREAM = "GPUORCH_AGENT"  # agents' reports, checked by inventory before they reach the log
WORK_STREAM = "GPUORCH_WORK"  # each node's current work, one message per (node, job): what its agent reads
SNAPSHOT_BUCKET = "gpuorch-snapshots"
SNAPSHOT_ENCODING = "zlib"  # a snapshot object's Gpuorch-Encoding header: deflated (RFC 1950)
HEARTBEAT_BUCKET = "gpuorch_heartbeats"
LEASE_BUCKET = "gpuorch_leases"
LEASE_TTL_S = 3.0  # a dead holder's lease lapses this long after its last renewal; holders renew every second
WRONG_LAST_SEQUENCE = 10071
REPLICAS_NEED_A_CLUSTER = 10074  # "replicas > 1 not supported in non-clustered mode"
NOT_READY = (10005, 10008, 10023)  # no suitable peers yet, JetStream temporarily unavailable, insufficient resources
JETSTREAM_READY_S = 60.0
T = TypeVar("T")
RETRYABLE = (
    asyncio.TimeoutError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionClosedError,
    NoStreamResponseError,
)


class ConcurrencyConflict(Exception):
    """Another writer appended to the aggregate after the sequence this decision was based on."""


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A stored message this code cannot read: an unknown type or a malformed body."""

    seq: int
    reason: str
    unknown_type: bool
    subject: str = ""  # where it was stored: its aggregate still moved on


Handler = Callable[[Envelope], Awaitable[None]]
Record = Envelope | Undecodable


class NoLeaderYet(Exception):
    """A stream just made on a cluster has not elected its leader yet."""


class _ConsumerLost(Exception):
    """A temporary consumer vanished (server restart) or stopped answering."""


def _ack_positions(reply: str) -> tuple[int, int]:
    """(stream sequence, messages pending) from a JetStream ack subject, old or new format."""
    tokens = reply.split(".")
    if len(tokens) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
        return int(tokens[5]), int(tokens[8])
    return int(tokens[7]), int(tokens[10])  # $JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>.<token>


_WHITESPACE = re.compile(r"\s")  # on the decoded name: str.isspace's set, as nats-py's own parser


def _parse_header_lines(raw: bytes) -> dict[str, str]:
    """nats-py's header-block parser, same rules, without a generator per character of every name.

    It ran at ~25 µs per message on our five headers and was the largest single cost of a replay.
    Installed on our own client instance only (see ``EventLog.connect``).
    """
    out: dict[str, str] = {}
    for line in raw.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        name = name.strip()
        if not name.isascii() or _WHITESPACE.search(key := name.decode("ascii")):
            continue
        out[key] = value.strip().decode("utf-8", "replace")
    return out


@dataclass(frozen=True)
class RawRecord:
    """A stored event not decoded yet (``EventLog.replay(raw=True)``); ``decoded()`` is the Record."""

    seq: int
    subject: bytes
    body: bytes

    def decoded(self) -> Record:
        return _decode_body(self.body, self.seq, self.subject)


def _decode_msg(msg: Msg) -> Record:
    return _decode_body(msg.data, msg.metadata.sequence.stream, msg.subject)


def _decode_body(body: bytes, seq: int, subject: bytes | str = "") -> Record:
    try:
        return decode(body, seq)
    except UnknownEventType as e:
        return Undecodable(seq, f"unknown event type {e}", True, _text(subject))
    except MalformedEvent as e:
        return Undecodable(seq, str(e), False, _text(subject))


def _text(subject: bytes | str) -> str:
    return subject.decode(errors="replace") if isinstance(subject, bytes) else subject


async def _check_credentials(servers: list[str], auth: dict[str, str | None]) -> None:
    """One quick connect: a server that refuses these credentials is an error now, not a silent retry forever."""
    async def quiet(e: Exception) -> None:
        pass

    try:
        nc = await nats.connect(servers=servers, allow_reconnect=False, connect_timeout=2, error_cb=quiet, **auth)
    except nats.errors.Error as e:
        if "authorization" in str(e).lower():
            who = f"user {auth['user']!r}" if auth else "a client without credentials"
            raise PermissionError(f"NATS at {', '.join(servers)} refused {who} (set GPUORCH_NATS_USER and "
                                  "GPUORCH_NATS_PASSWORD, or use the stack's own credentials)") from None
        return
    except (OSError, asyncio.TimeoutError):
        return  # not up yet: the real connect waits for it
    await nc.close()


class EventLog:
    """A connection to the GPUORCH stream. Create with ``await EventLog.connect(url)``."""

    def __init__(self, nc: NATS, replicas: int = 1):
        self.nc = nc
        self.js = nc.jetstream(publish_async_max_pending=8192)
        self.replicas = replicas
        self.delete_temporary = True  # replays delete their temporary consumer when done
        # subscription id -> raw receiver of (subject, reply, body, header block)
        self._sinks: dict[int, Callable[[bytes, bytes, bytes, bytes | None], None]] = {}
        # the services of one process each consume every event: the first decodes it, the others reuse that
        self._decoded: OrderedDict[int, tuple[bytes, Record]] = OrderedDict()  # seq -> (body, record), latest last
        process_msg = nc._process_msg

        async def _process_msg(sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
            """A replay's or a consumer's messages go straight to its receiver: no queue and task hop per message
            (the body is the whole CloudEvent; the reply subject holds the sequence). Everything else as usual."""
            sink = self._sinks.get(sid)
            if sink is None:
                return await process_msg(sid, subject, reply, data, headers)
            sink(subject, reply, data, headers)

        nc._process_msg = _process_msg  # type: ignore[method-assign]  # the parser calls it per message

    @classmethod
    async def connect(cls, url: str, *, replicas: int = 1, name: str = "gpuorch", ensure: bool = True,
                      user: str | None = None, password: str | None = None, inbox_prefix: str | None = None) -> "EventLog":
        """Connect (waiting while the server is away); ``user``/``password`` where the server wants credentials
        (default: GPUORCH_NATS_CREDENTIALS, a file, or GPUORCH_NATS_USER/PASSWORD; refused ones fail at once,
        with the reason); an agent reads its replies under its own ``inbox_prefix``."""
        client: list[NATS] = []
        servers = [u.strip() for u in url.split(",") if u.strip()]
        if not user:
            from shared.natsauth import credentials_from

            user, password = credentials_from(os.environ)
        auth = {"user": user, "password": password} if user else {}
        await _check_credentials(servers, auth)

        async def _disconnected() -> None:  # on our own close too: only an unexpected one is worth a warning
            log.log(logging.DEBUG if client and client[0].is_closed else logging.WARNING, "nats disconnected url=%s", url)

        async def _reconnected() -> None:
            log.info("nats reconnected url=%s", url)

        async def _error(e: Exception) -> None:
            log.debug("nats error=%r", e)

        nc = await nats.connect(
            servers=servers,
            name=name,
            inbox_prefix=inbox_prefix or "_INBOX",
            **auth,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,
            connect_timeout=2,
            disconnected_cb=_disconnected,
            reconnected_cb=_reconnected,
            error_cb=_error,
        )
        nc._parse_header_lines = _parse_header_lines  # this instance only: same rules, faster
        client.append(nc)
        self = cls(nc, replicas)
        if ensure:
            await self.ensure_streams()
        return self

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.drain()

    # --- streams -------------------------------------------------------------------

    async def ensure_streams(self) -> None:
        """Create the streams and buckets (at this log's replicas), or verify the existing ones keep the log's
        guarantees. A JetStream cluster that has just started answers with timeouts and 503s until it has elected
        its meta leader: that is retried, with backoff."""
        await self.until_ready(self._ensure_all, "create the streams")

    async def until_ready(self, op: Callable[[], Awaitable[T]], what: str, timeout: float = JETSTREAM_READY_S) -> T:
        """``op()``, retried while JetStream is not ready (no meta leader yet, peers still joining), up to ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + timeout, 0.1
        while True:
            try:
                return await op()
            except (*RETRYABLE, APIError, NoLeaderYet) as e:
                if self.nc.is_closed:
                    raise
                if isinstance(e, APIError) and e.err_code == REPLICAS_NEED_A_CLUSTER:
                    raise RuntimeError(f"{what}: {self.replicas} replicas need a JetStream cluster of as many servers "
                                       f"({e.description})") from None
                if isinstance(e, APIError) and not (e.err_code in NOT_READY or (e.code or 0) >= 500):
                    raise
                if loop.time() > deadline:
                    raise TimeoutError(f"{what}: JetStream not ready after {timeout:g}s: {e!r}") from None
                log.info("event=jetstream_not_ready what=%r error=%r retry_in_s=%.1f", what, e, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)

    async def _ensure_all(self) -> None:
        await self._ensure_stream(
            api.StreamConfig(
                name=STREAM,
                subjects=[f"{SUBJECT_PREFIX}.>"],
                storage=api.StorageType.FILE,
                retention=api.RetentionPolicy.LIMITS,
                discard=api.DiscardPolicy.NEW,
                deny_delete=True,
                deny_purge=True,
                duplicate_window=300,
                num_replicas=self.replicas,
                allow_direct=True,
            )
        )
        await self._ensure_stream(
            api.StreamConfig(
                name=DLQ_STREAM,
                subjects=[f"{DLQ_PREFIX}.>"],
                storage=api.StorageType.FILE,
                deny_delete=True,
                num_replicas=self.replicas,
            )
        )
        await self._ensure_stream(
            api.StreamConfig(
                name=TELEMETRY_STREAM,
                subjects=["gpuorch.telemetry.>"],
                storage=api.StorageType.FILE,
                max_age=3600,
                num_replicas=self.replicas,
            )
        )
        await self._ensure_stream(
            api.StreamConfig(
                name=AGENT_STREAM,
                subjects=["gpuorch.agent.>"],
                storage=api.StorageType.FILE,
                max_age=7 * 86400,
                duplicate_window=300,
                num_replicas=self.replicas,
            )
        )
        await self._ensure_stream(
            api.StreamConfig(
                name=WORK_STREAM,
                subjects=["gpuorch.work.>"],
                storage=api.StorageType.FILE,
                max_msgs_per_subject=1,  # a (node, job)'s latest word replaces the one before
                allow_msg_ttl=True,  # an ended job's last word lapses (services.inventory.work)
                duplicate_window=120,
                num_replicas=self.replicas,
            )
        )
        # buckets agents use but may not create (their permissions stop at their own keys)
        await self.kv(HEARTBEAT_BUCKET, ttl=60)
        await self.kv(LEASE_BUCKET, ttl=LEASE_TTL_S)
        await self._keep_ttl(LEASE_BUCKET, LEASE_TTL_S)  # a bucket made by an older release lapsed after 10 s

    async def _elected(self, stream: str) -> None:
        """Until a stream just made has a leader (a cluster elects one per stream), a publish gets no answer."""
        async def leader() -> None:
            cluster = (await self.js.stream_info(stream)).cluster
            if cluster is not None and not cluster.leader:
                raise NoLeaderYet(stream)

        await self.until_ready(leader, f"a leader for {stream}")

    async def _keep_ttl(self, bucket: str, ttl: float) -> None:
        config = (await self.js.stream_info(f"KV_{bucket}")).config
        if config.max_age != ttl:
            config.max_age, config.duplicate_window = ttl, min(config.duplicate_window or ttl, ttl)
            await self.js.update_stream(config)

    async def _ensure_stream(self, config: api.StreamConfig) -> None:
        try:
            info = await self.js.stream_info(config.name)
        except NotFoundError:
            await self.js.add_stream(config)
            await self._elected(config.name)
            return
        have = info.config
        if config.name == STREAM and not (have.deny_delete and have.deny_purge):
            raise RuntimeError(f"stream {STREAM} allows delete or purge: the audit log would not be append-only")

    async def last_seq(self) -> int:
        info = await self.js.stream_info(STREAM)
        return info.state.last_seq

    # --- append --------------------------------------------------------------------

    async def append(self, env: Envelope, expected_last_subject_seq: int | None = None, timeout: float = 30,
                     subject: str | None = None) -> int:
        """Store one event; return its stream sequence (the original one for a duplicate id).

        A lost acknowledgement (timeout, reconnect) is retried until ``timeout``: the
        message id makes the retry idempotent. ``subject``: another stream's subject
        (an agent's report) instead of the event's own in the log. Traced, the event
        carries its append's span (a child of the event's own traceparent, else of the
        current span): its consumers continue that trace.
        """
        if tracing_on():
            with publishing(subject or env.data.nats_subject, env.traceparent, message_id=env.id) as traceparent:
                return await self._append(replace(env, traceparent=traceparent) if traceparent else env,
                                          expected_last_subject_seq, timeout, subject)
        return await self._append(env, expected_last_subject_seq, timeout, subject)

    async def _append(self, env: Envelope, expected_last_subject_seq: int | None, timeout: float,
                      subject: str | None) -> int:
        headers = env.headers()
        if expected_last_subject_seq is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(expected_last_subject_seq)
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                ack = await self.js.publish(subject or env.data.nats_subject, env.encode(), headers=headers, timeout=2)
                return ack.seq
            except APIError as e:
                if e.err_code == WRONG_LAST_SEQUENCE:
                    raise ConcurrencyConflict(f"{env.subject}: {e.description}") from None
                if e.code != 503:
                    raise
                error: Exception = e
            except RETRYABLE as e:
                error = e
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"append {env.type} {env.subject}: no acknowledgement within {timeout}s: {error!r}")
            await asyncio.sleep(0.1)

    async def append_many(self, envs: Iterable[Envelope], timeout: float = 60,
                          expected: Sequence[int | None] | None = None) -> list[int]:
        """Store many events with pipelined publishes; return their sequences in order.

        Every publish carries its own reply subject under one inbox, and one raw
        subscription collects the acknowledgements (nats-py's publish_async costs a
        future and a semaphore round per message). Publishes whose acknowledgement is
        lost are sent again: same ids, so stored once. Traced: one append span per trace
        context among the events (a batch of jobs, each in its own trace: one per job).
        ``expected``: per event, the sequence its subject's last event must have (None:
        any), as ``append``'s; an event refused for that is not stored, and its sequence is 0.
        """
        envs = list(envs)
        if expected is not None and len(expected) != len(envs):
            raise ValueError(f"append_many: {len(expected)} expected sequences for {len(envs)} events")
        if in_trace() or (tracing_on() and any(env.traceparent for env in envs)):
            return await self._append_many_traced(envs, timeout, expected)
        return await self._append_many(envs, timeout, expected)

    async def _append_many_traced(self, envs: list[Envelope], timeout: float,
                                  expected: Sequence[int | None] | None) -> list[int]:
        groups: dict[str | None, list[int]] = {None: []}  # the events without a context first: the current span's
        for i, env in enumerate(envs):
            groups.setdefault(env.traceparent, []).append(i)
        stamped = list(envs)
        with contextlib.ExitStack() as spans:
            for parent, members in groups.items():
                if not members:
                    continue
                first = envs[members[0]]
                traceparent = spans.enter_context(publishing(first.data.nats_subject, parent, len(members),
                                                             first.id if len(members) == 1 else None))
                for i in members if traceparent else ():
                    stamped[i] = replace(envs[i], traceparent=traceparent)
            return await self._append_many(stamped, timeout, expected)

    async def _append_many(self, envs: list[Envelope], timeout: float,
                           expected: Sequence[int | None] | None = None) -> list[int]:
        seqs: list[int] = [0] * len(envs)
        errors: dict[int, APIError] = {}
        refused: set[int] = set()  # not where ``expected`` says: settled, not stored
        prefix = self.nc.new_inbox()
        outstanding = 0
        all_acked = asyncio.Event()

        async def on_ack(msg: Msg) -> None:
            nonlocal outstanding
            i = int(msg.subject.rsplit(".", 1)[1])
            if seqs[i] or i in errors or i in refused:
                return
            resp = from_json(msg.data) if msg.data else {}
            if "error" in resp and resp["error"].get("err_code") == WRONG_LAST_SEQUENCE and expected is not None:
                refused.add(i)
            elif "error" in resp:
                errors[i] = APIError.from_error(resp["error"])
            elif "seq" in resp:
                seqs[i] = resp["seq"]
            else:
                return  # no responders: left for the retry
            outstanding -= 1
            if outstanding <= 0:
                all_acked.set()

        sub = await self.nc.subscribe(f"{prefix}.*", cb=on_ack)
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            todo = list(range(len(envs)))
            while todo:
                outstanding = len(todo)
                all_acked.clear()
                try:
                    for i in todo:
                        env = envs[i]
                        headers = env.headers()
                        if expected is not None and expected[i] is not None:
                            headers["Nats-Expected-Last-Subject-Sequence"] = str(expected[i])
                        await self.nc.publish(env.data.nats_subject, env.encode(), reply=f"{prefix}.{i}", headers=headers)
                    # each publish kicks the client's flusher; no flush() here: nats-py sets a PONG's result even
                    # when the flush awaiting it was cancelled, and that error ends its read loop (the connection
                    # then answers nothing: a scheduler stopped mid-append wedged its process so)
                    await wait_event(all_acked, 5)
                except RETRYABLE:
                    pass
                fatal = [e for e in errors.values() if e.code != 503]
                if fatal:
                    raise fatal[0]
                todo = [i for i in range(len(envs)) if not seqs[i] and i not in refused]
                errors.clear()
                if todo and asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"append_many: {len(todo)} events unacknowledged after {timeout}s")
                if todo:
                    await asyncio.sleep(0.1)
        finally:
            await sub.unsubscribe()
        return seqs

    async def subject_last_seq(self, subject: str) -> int:
        """Stream sequence of the last event on one aggregate's subject (0 if none)."""
        try:
            msg = await self.js.get_last_msg(STREAM, subject, direct=True)
        except NotFoundError:
            return 0
        return msg.seq or 0

    # --- read ----------------------------------------------------------------------

    async def replay(
        self, from_seq: int = 1, subjects: list[str] | None = None, batch: int = 5000, raw: bool = False
    ) -> AsyncIterator[Record]:
        """Every stored event from ``from_seq`` until caught up with the log as it was when called.

        The hot path of every restart. It pulls batches from a temporary consumer into
        one raw subscription: nats-py's fetch() makes a task and a timer per message,
        which caps it near 15k msg/s here; this runs at twice that and more. ``raw``: yield
        each event undecoded (``RawRecord``), for a caller that decodes it off the event loop.
        """
        next_seq = max(1, from_seq)
        while True:
            name, pending = await self.until_ready(lambda: self._temporary_consumer(next_seq, subjects), "replay")
            if pending == 0:
                await self._delete_consumer(name)
                return
            try:
                async for rec in self._pull_all(name, pending, batch, raw):
                    next_seq = rec.seq + 1
                    yield rec
                return
            except _ConsumerLost:
                log.info("replay consumer lost at seq=%d; recreating", next_seq)
            finally:
                await self._delete_consumer(name)

    async def _temporary_consumer(self, start: int, subjects: list[str] | None) -> tuple[str, int]:
        config = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start,
            ack_policy=api.AckPolicy.NONE,
            inactive_threshold=60,
            mem_storage=True,
            max_ack_pending=-1,
            num_replicas=1,
        )
        if subjects and len(subjects) > 1:
            config.filter_subjects = subjects
        else:
            config.filter_subject = subjects[0] if subjects else f"{SUBJECT_PREFIX}.>"
        info = await self.js._jsm.add_consumer(STREAM, config=config)
        return info.name, info.num_pending

    async def _delete_consumer(self, name: str) -> None:
        if not self.delete_temporary:
            return  # it lapses by itself after inactive_threshold (agents may not delete consumers)
        try:
            await self.js.delete_consumer(STREAM, name)
        except Exception:  # noqa: BLE001 - it expires by itself after inactive_threshold
            pass

    async def _pull_all(self, consumer: str, pending: int, batch: int, raw: bool = False) -> AsyncIterator[Record]:
        """Pull ``pending`` messages in batches; the next batch is requested before this one is decoded,
        so the server sends while we fold (the two share this machine's cores)."""
        inbox = self.nc.new_inbox()
        got: list[tuple[bytes, bytes, bytes]] = []
        arrived = asyncio.Event()
        want = 0

        def collect(subject: bytes, reply: bytes, body: bytes, _: bytes | None) -> None:
            got.append((subject, reply, body))
            if len(got) >= want or not reply:  # a status message (timeout, no messages) ends a round
                arrived.set()

        async def request(n: int) -> None:
            nonlocal got, want
            got, want = [], n
            arrived.clear()
            body = json.dumps({"batch": n, "expires": 4_000_000_000}).encode()
            await self.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{consumer}", body, reply=inbox)

        sub = await self.nc.subscribe(inbox)
        self._sinks[sub._id] = collect
        try:
            await request(min(batch, pending))
            while pending > 0:
                await wait_event(arrived, 5)
                data = [(subject, reply.decode(), body) for subject, reply, body in got if reply]
                if not data:
                    raise _ConsumerLost(consumer)
                pending = _ack_positions(data[-1][1])[1]
                if pending > 0:
                    await request(min(batch, pending))
                for subject, reply, body in data:
                    seq = _ack_positions(reply)[0]
                    yield RawRecord(seq, subject, body) if raw else _decode_body(body, seq, subject)
        finally:
            self._sinks.pop(sub._id, None)
            with contextlib.suppress(nats.errors.Error):  # closed or draining: the subscription goes with it
                await sub.unsubscribe()

    async def follow(self, from_seq: int | None = None, subject: str = f"{SUBJECT_PREFIX}.>") -> AsyncIterator[Record | None]:
        """Every event from ``from_seq`` (default: only new ones) as it is stored, forever (an ordered consumer).

        Yields ``None`` after each idle second, so a caller can send keep-alives or stop.
        """
        if from_seq:
            config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=from_seq)
        else:
            config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.NEW)
        sub = await self.js.subscribe(subject, stream=STREAM, ordered_consumer=True, config=config)
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=1)
                except (asyncio.TimeoutError, nats.errors.TimeoutError):
                    yield None
                    continue
                yield _decode_msg(msg)
        finally:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001
                pass

    async def read(self, after: int = 0, subjects: list[str] | None = None, limit: int = 100) -> list[Record]:
        """At most ``limit`` events after sequence ``after`` (for the history API)."""
        out: list[Record] = []
        async for rec in self.replay(after + 1, subjects, batch=min(limit, 1000)):
            out.append(rec)
            if len(out) >= limit:
                break
        return out

    async def consume(
        self,
        durable: str,
        handler: Callable[[Record, Msg], Awaitable[None]],
        *,
        start_seq: int = 1,
        max_deliver: int = 5,
        ack_wait: float = 30,
        stop: asyncio.Event,
        batch: int = 256,
        stream: str = STREAM,
        subject: str = f"{SUBJECT_PREFIX}.>",
        last_per_subject: bool = False,
        inactive_s: float = 7 * 86400,
    ) -> None:
        """Run a durable pull consumer (on the event log, or ``stream``) until ``stop`` is set.

        A new durable starts at ``start_seq`` (``last_per_subject``: at each subject's latest
        message, then follows; created by name with its filter, so that subject permissions
        can bound what a client reads); an existing one resumes where it was acknowledged.
        ``handler`` gets each record and its message and must ack, nak or dead-letter it
        (see ``settle``). Survives nats-server restarts.
        """
        config = api.ConsumerConfig(
            durable_name=durable,
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT if last_per_subject else api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=None if last_per_subject else max(1, start_seq),
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=ack_wait,
            max_deliver=max_deliver,
            max_ack_pending=1000,
            num_replicas=self.replicas,
            inactive_threshold=inactive_s,  # a replica gone for a week leaves no consumer behind
        )
        if last_per_subject:
            config = replace(config, name=durable, filter_subject=subject)
        # a streaming pull: one request for up to ``batch`` messages, each handled as it arrives (nats-py's fetch
        # hands them over one awaited queue read, task and uuid at a time: a tenth of a process's CPU, times its
        # consumers); the next request goes out when this one is used up or over (a status: expired, or worse)
        inbox = self.nc.new_inbox()
        got: list[Msg] = []
        arrived = asyncio.Event()
        state = {"left": 0, "status": 0}  # messages the open request may still bring; its closing status

        def collect(subject_: bytes, reply: bytes, body: bytes, headers: bytes | None) -> None:
            if reply:
                got.append(Msg(_client=self.nc, subject=subject_.decode(), reply=reply.decode(), data=body,
                               headers=_parse_header_lines(headers) if headers else None))
                state["left"] -= 1
            else:  # NATS/1.0 408 Request Timeout (expired), 409 (consumer deleted, leader changed), 503, ...
                state["status"] = int(headers[9:12]) if headers and headers[9:12].isdigit() else 0
                state["left"] = 0
            arrived.set()

        expires_s = 0.5
        ready = False
        sub = None
        try:
            while not stop.is_set():
                try:
                    if not ready:
                        await self._ensure_consumer(stream, durable, config)
                        if sub is None:
                            sub = await self.nc.subscribe(inbox)
                            self._sinks[sub._id] = collect
                        ready, state["left"] = True, 0
                    if state["left"] <= 0:
                        if state["status"] not in (0, 408):
                            raise nats.errors.Error(f"pull ended with status {state['status']}")
                        state["left"], state["status"] = batch, 0
                        body = json.dumps({"batch": batch, "expires": int(expires_s * 1e9)}).encode()
                        await self.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}", body, reply=inbox)
                    if not got and not await wait_event(arrived, expires_s + 0.25):
                        # no answer when it expired (a reconnect lost the request): ask again; a late answer only
                        # means two requests were open a moment, and none of their messages is lost
                        state["left"] = 0
                        continue
                except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
                        nats.errors.NoRespondersError, APIError, nats.errors.Error, OSError) as e:
                    log.info("consumer=%s waiting for nats error=%r", durable, e)
                    ready, state["status"] = False, 0
                    await asyncio.sleep(0.25)
                    continue
                arrived.clear()
                msgs = got[:]
                got.clear()
                for i, msg in enumerate(msgs, 1):
                    if i % 32 == 0:
                        await asyncio.sleep(0)  # a flood's batch never holds the loop for all its folds at once
                    try:
                        await handler(self._decode_shared(msg) if stream == STREAM else None, msg)
                    except Exception:  # noqa: BLE001 - one message never stops the consumer: unacked, it comes again
                        log.exception("consumer=%s handler failed seq=%d", durable, msg.metadata.sequence.stream)
        finally:  # also when cancelled: a subscription left behind would hold up the connection's drain
            if sub is not None:
                self._sinks.pop(sub._id, None)
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _ensure_consumer(self, stream: str, durable: str, config: api.ConsumerConfig) -> None:
        """The durable as it is if it exists (it resumes where it was acknowledged), else created with ``config``."""
        try:
            await self.js.consumer_info(stream, durable)
        except NotFoundError:
            await self.js.add_consumer(stream, config=config)

    def _decode_shared(self, msg: Msg, keep: int = 2048) -> Record:
        """Decode a consumed event once per connection: the same sequence with the same body is the same record
        (records are immutable), whichever consumer of this process reads it first. ``keep``: the latest records
        held; the consumers of a process fetch 256 at a time and stay within a few fetches of each other."""
        seq = msg.metadata.sequence.stream
        hit = self._decoded.get(seq)
        if hit is not None and hit[0] == msg.data:
            return hit[1]
        rec = _decode_body(msg.data, seq, msg.subject)
        self._decoded[seq] = (msg.data, rec)
        if len(self._decoded) > keep:
            self._decoded.popitem(last=False)
        return rec

    async def dead_letter(self, msg: Msg, service: str, reason: str) -> None:
        """Copy a message to ``gpuorch.dlq.<service>.<aggregate>.<id>`` with the reason, then terminate it."""
        tail = msg.subject.split(".", 2)[2]  # after gpuorch.events (or gpuorch.agent)
        # the original's Nats-* headers are instructions to JetStream (an expected last sequence, a message id):
        # on the dead-letter stream they would refuse or deduplicate the copy
        headers = {k: v for k, v in (msg.headers or {}).items() if not k.lower().startswith("nats-")}
        headers.update(
            {
                "Gpuorch-Dlq-Reason": reason[:2000].replace("\n", " "),
                "Gpuorch-Dlq-Seq": str(msg.metadata.sequence.stream),
                "Gpuorch-Dlq-Consumer": service,
            }
        )
        await self.js.publish(f"{DLQ_PREFIX}.{subject_token(service)}.{tail}", msg.data, headers=headers)
        await msg.term()

    async def dead_letters(self, service: str | None = None) -> list[dict]:
        subject = f"{DLQ_PREFIX}.{service}.>" if service else f"{DLQ_PREFIX}.>"
        sub = await self.js.pull_subscribe(
            subject,
            stream=DLQ_STREAM,
            config=api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, inactive_threshold=30, mem_storage=True),
        )
        out: list[dict] = []
        try:
            pending = (await sub.consumer_info()).num_pending
            while pending > 0:
                msgs = await sub.fetch(min(pending, 500), timeout=5)
                for m in msgs:
                    out.append({"subject": m.subject, "headers": dict(m.headers or {}), "body": m.data.decode(errors="replace")})
                pending = msgs[-1].metadata.num_pending
        finally:
            await sub.unsubscribe()
        return out

    # --- key-value and snapshots ---------------------------------------------------

    async def kv(self, bucket: str, ttl: float | None = None) -> KeyValue:
        """A KV bucket, created at this log's replicas if missing."""
        async def get_or_create() -> KeyValue:
            try:
                return await self.js.key_value(bucket)
            except (NotFoundError, BadRequestError, nats.js.errors.BucketNotFoundError):
                kv = await self.js.create_key_value(bucket=bucket, ttl=ttl, history=1, replicas=self.replicas)
                await self._elected(f"KV_{bucket}")
                return kv

        return await self.until_ready(get_or_create, f"bucket {bucket}")

    async def save_snapshot(self, name: str, seq: int, state: bytes) -> None:
        """Store a service's snapshot, compressed: the object store hands an object back at about 20 MB/s (its
        chunks come through an ordered push consumer), and 20,000 jobs' JSON (15 MB, 0.8 s to read back, most of a
        restart) deflates about thirty-fold in 0.1 s."""
        store = await self._snapshots()
        packed = await asyncio.to_thread(zlib.compress, state, 1)
        await store.put(name, packed, meta=api.ObjectMeta(name=name, headers={
            "Gpuorch-Seq": str(seq), "Gpuorch-Encoding": SNAPSHOT_ENCODING}))

    async def load_snapshot(self, name: str) -> tuple[int, bytes] | None:
        """(sequence, state) of a service's snapshot, None if it has none; waits out a cluster still electing. A
        snapshot that does not inflate reads as empty (the service then replays the log: a snapshot is a
        shortcut)."""
        async def load() -> tuple[int, bytes] | None:
            store = await self._snapshots()
            try:
                obj = await store.get(name)
            except (nats.js.errors.ObjectNotFoundError, NotFoundError, nats.js.errors.ObjectDeletedError):
                return None
            headers = (obj.info.headers or {}) if obj.info else {}
            data = obj.data or b""
            if headers.get("Gpuorch-Encoding") == SNAPSHOT_ENCODING:  # else written before snapshots were compressed
                try:
                    data = await asyncio.to_thread(zlib.decompress, data)
                except zlib.error as e:
                    log.warning("event=snapshot_unreadable name=%s error=%r action=full_replay", name, e)
                    data = b""
            return int(headers.get("Gpuorch-Seq", "0")), data

        return await self.until_ready(load, "the snapshot store")

    async def _snapshots(self):
        try:
            return await self.js.object_store(SNAPSHOT_BUCKET)
        except (NotFoundError, nats.js.errors.BucketNotFoundError, BadRequestError):
            config = api.ObjectStoreConfig(replicas=self.replicas)
            store = await self.until_ready(lambda: self.js.create_object_store(SNAPSHOT_BUCKET, config=config),
                                           f"object store {SNAPSHOT_BUCKET}")
            await self._elected(f"OBJ_{SNAPSHOT_BUCKET}")
            return store


class Lease:
    """A leader lease in KV: create the key to lead, renew it by revision; the revision is the epoch."""

    def __init__(self, kv: KeyValue, name: str, holder: str):
        self.kv, self.name, self.holder = kv, name, holder
        self.revision: int | None = None
        self.epoch: int | None = None  # the revision at which this holder acquired: a term, not a clock

    async def acquire_or_renew(self) -> bool:
        value = json.dumps({"holder": self.holder}).encode()
        try:
            if self.revision is None:
                self.revision = self.epoch = await self.kv.create(self.name, value)
            else:
                self.revision = await self.kv.update(self.name, value, last=self.revision)
            return True
        except (KeyWrongLastSequenceError, APIError):
            self.revision = self.epoch = None
            return False

    async def release(self) -> None:
        if self.revision is not None:
            try:
                await self.kv.delete(self.name, last=self.revision)
            except Exception:  # noqa: BLE001
                pass
            self.revision = self.epoch = None
