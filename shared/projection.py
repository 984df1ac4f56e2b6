"""A projection: state folded from events, ``apply(state, event) -> state``, with its digest and snapshots.

Pure: no I/O, no clock (time is the envelope's), nothing of the bus or the HTTP edge, so the decision modules
that read a projection stay pure too. ``shared.runtime`` runs projections against the event log.

A snapshot records the version of the code that wrote it: the ``SNAPSHOT_VERSION`` of every class in the
projection's hierarchy that declares one (bumped when that class's ``state()`` shape, or what its folds
compute, changes) and a fingerprint of the event types the code reads (an event older code skipped as unknown
is folded by newer code: its snapshot would miss it). ``restore`` refuses a snapshot of another version, or one
it cannot read, with ``SnapshotUnusable``: the service then replays the log from the start.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, ClassVar, NamedTuple

from pydantic_core import from_json, to_json

from shared.events import REGISTRY, UPCASTERS, Envelope, Event, LeaderElected


def canonical(value: Any) -> str:
    """The JSON a digest hashes: keys sorted, no spaces."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class Canonical(str):
    """A part of a digest's state, encoded already (``canonical``)."""


def digest_parts(doc: dict[str, Any]) -> dict[str, str]:
    """Each part of a ``Projection.digest_document`` encoded (in a thread of its own: it shares nothing)."""
    return {k: v if isinstance(v, Canonical) else canonical(v) for k, v in doc.items()}


def state_digest(pos: tuple[int, int, int], parts: dict[str, str], keys: frozenset[str] | None = None) -> str:
    """sha256 of ``canonical({"applied": .., "invalid": .., "state": {k: part}})``, assembled from the parts encoded
    already: the very bytes one ``canonical`` call on the whole would make."""
    _, applied, invalid = pos
    state = ",".join(f"{canonical(k)}:{v}" for k, v in sorted(parts.items()) if keys is None or k in keys)
    body = f'{{"applied":{canonical(applied)},"invalid":{canonical(invalid)},"state":{{{state}}}}}'
    return hashlib.sha256(body.encode()).hexdigest()[:16]


class SnapshotUnusable(Exception):
    """A snapshot this code must not read (another version, not a snapshot at all): replay the log instead."""


def events_generation() -> str:
    """A fingerprint of the event types (and old versions, upcast on read) this code folds."""
    known = sorted({*REGISTRY, *UPCASTERS})
    return hashlib.sha256("\n".join(known).encode()).hexdigest()[:12]


CHUNK = 256  # entries of a large dict or list that encode_json serializes in one call


def encode_json(value: Any, depth: int = 4) -> bytes:
    """``to_json(value)``, byte for byte, made of many short ``to_json`` calls: a dict or list of more than CHUNK
    entries (the jobs of a backlog) in pieces of CHUNK, the dicts above it key by key (``depth`` levels down). One
    call over 20,000 jobs holds the GIL for 0.2 s or more; in a thread, the event loop runs between two pieces."""
    out: list[bytes] = []
    _encode(value, out, depth)
    return b"".join(out)


class Encoded(bytes):
    """JSON already encoded: ``encode_json`` puts these bytes where the value would go."""


def _encode(value: Any, out: list[bytes], depth: int) -> None:
    if type(value) is Encoded:
        out.append(value)
    elif depth > 0 and isinstance(value, dict) and all(type(k) is str for k in value):
        if len(value) > CHUNK:
            items = list(value.items())
            out.append(b"{")
            for i in range(0, len(items), CHUNK):
                out.append(b"," if i else b"")
                out.append(to_json(dict(items[i:i + CHUNK]))[1:-1])
            out.append(b"}")
            return
        out.append(b"{")
        for i, (k, v) in enumerate(value.items()):
            out.append(b"," if i else b"")
            out.append(to_json(k))
            out.append(b":")
            _encode(v, out, depth - 1)
        out.append(b"}")
    elif depth > 0 and type(value) is list and len(value) > CHUNK:
        out.append(b"[")
        for i in range(0, len(value), CHUNK):
            out.append(b"," if i else b"")
            out.append(to_json(value[i:i + CHUNK])[1:-1])
        out.append(b"]")
    else:
        out.append(to_json(value))


class Term(NamedTuple):
    """A leader's term as the log recorded it: the epoch, and the sequence of its ``leader.elected``."""

    epoch: int
    seq: int


class Projection:
    """State folded from events. ``apply`` is a deterministic function of (state, event).

    Subclasses write ``on_<aggregate>_<verb>(self, env, event)`` methods (for
    ``job.placed``: ``on_job_placed``) and ``state()``/``load()`` for snapshots and
    digests. A method calls ``self.invalid(env, why)`` for a transition that must not
    happen (a GPU already taken, a job already ended): the event is recorded and
    changes nothing, and ``apply`` returns False so that no reaction acts on it.
    ``kind`` tells the rejections the design expects from real invalid transitions
    (``gpuorch events verify`` fails only on those): ``fenced`` (a decision of a
    leader whose term is over), ``refused`` (a report or an election from the wrong
    source), ``invalid`` (anything else).
    """

    name: ClassVar[str] = "projection"
    SNAPSHOT_VERSION: ClassVar[int] = 1  # of the fields below (seq, applied, rejections, epochs, terms)
    _dispatch: ClassVar[dict[type[Event], str]] = {}
    MAX_INVALID = 1000

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls._dispatch = {
            ev: f"on_{ev.TYPE.replace('.', '_')}" for ev in REGISTRY.values() if hasattr(cls, f"on_{ev.TYPE.replace('.', '_')}")
        }

    def __init__(self) -> None:
        self.seq = 0
        self.applied = 0
        self.invalid_count = 0
        self.invalid_transitions: list[str] = []
        self.invalid_kinds: list[str] = []  # the kind of each of invalid_transitions
        self.kinds: dict[str, int] = {}  # invalid events per kind
        self.epochs: dict[str, int] = {}  # source -> highest epoch seen, for a source with no election in the log yet
        self.terms: dict[str, Term] = {}  # source -> its latest leader.elected: the one epoch its decisions may carry
        self.rejected: dict[int, None] = {}  # sequences of the latest events recorded invalid, oldest first

    def apply(self, env: Envelope) -> bool:
        """Fold one event. False if it changed nothing: a redelivery (at or below the last applied
        sequence), or an event recorded invalid (``was_rejected`` tells them apart).

        A decision (an event with a leader epoch) counts only if its epoch is the current term of
        its source: the epoch of the latest ``leader.elected`` for that source, in log order, not the
        highest. So a made-up epoch changes nothing, and a forged election lasts only until the real
        leader records its term again. A source with no election in the log yet (a log written
        before elections were recorded) keeps the older rule, so that such a log replays to the same
        state: an epoch below the highest one seen from that source is stale.
        """
        if env.seq and env.seq <= self.seq:
            return False
        if env.seq:
            self.seq = env.seq
        if env.epoch is not None:
            term = self.terms.get(env.source)
            if term is None:
                seen = self.epochs.get(env.source, 0)
                if env.epoch < seen:
                    return self._reject(env, f"stale leader epoch {env.epoch} < {seen}", "fenced")
                self.epochs[env.source] = env.epoch
            elif env.epoch != term.epoch:
                return self._reject(env, f"epoch {env.epoch} is not the current term {term.epoch} of {env.source}", "fenced")
        if isinstance(env.data, LeaderElected):  # like epochs, terms are no state: a restart's new term keeps the digest
            if env.data.source != env.source:
                return self._reject(env, f"an election for {env.data.source} appended by {env.source}", "refused")
            self.terms[env.source] = Term(env.data.epoch, env.seq)
            return True
        invalid = self.invalid_count
        method = self._dispatch.get(type(env.data))
        self.applied += 1
        if method is not None:
            getattr(self, method)(env, env.data)
        return self.invalid_count == invalid

    def _reject(self, env: Envelope, why: str, kind: str) -> bool:
        self.invalid(env, why, kind)
        return False

    def was_rejected(self, seq: int) -> bool:
        """Whether the event at ``seq`` was recorded invalid (known for the latest MAX_INVALID of them)."""
        return seq in self.rejected

    def skip(self, seq: int, subject: str = "") -> None:
        """Advance past an event this code cannot read (stored on ``subject``)."""
        self.seq = max(self.seq, seq)

    def invalid(self, env: Envelope, why: str, kind: str = "invalid") -> None:
        self.invalid_count += 1
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        if len(self.invalid_transitions) < self.MAX_INVALID:
            self.invalid_transitions.append(f"seq={env.seq} {env.type} {env.subject}: {why}")
            self.invalid_kinds.append(kind)
        self.rejected[env.seq] = None
        if len(self.rejected) > self.MAX_INVALID:
            del self.rejected[next(iter(self.rejected))]

    # --- state -----------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {}

    def load(self, state: dict[str, Any]) -> None:
        pass

    def position(self) -> tuple[int, int, int]:
        """(seq, applied, invalid_count): what a digest is of, with the state."""
        return self.seq, self.applied, self.invalid_count

    def digest(self, keys: frozenset[str] | None = None) -> str:
        """sha256 of the canonical state (only its ``keys``, for one service's view of a projection that several
        share: shared.runtime.fold_once); kept per position, since a poll of /v1/services should not refold, and
        its parts encoded once per position for all the services that share it."""
        pos = self.position()
        found = self.digest_kept(pos, keys)
        if found is None:
            parts = self.digest_parts_at(pos)
            if parts is None:
                parts = digest_parts(self.digest_document())
            found = self.keep_digest(pos, parts, keys, state_digest(pos, parts, keys))
        return found

    def digest_document(self) -> dict[str, Any]:
        """The state, every part of it that the folds change encoded already (``Canonical``); the FRESH_STATE parts
        (a backlog's jobs: most of the work) are left to encode (``digest_parts``), after the folds resume. Reads the
        projection and changes nothing, so it may run in a thread while nothing folds (``Service.read_in_thread``)."""
        return {k: v if k in self.FRESH_STATE else Canonical(canonical(v)) for k, v in self.state().items()}

    def digest_kept(self, pos: tuple[int, int, int], keys: frozenset[str] | None) -> str | None:
        kept = self.__dict__.get("_digest")
        return kept[2].get(keys) if kept is not None and kept[0] == pos else None

    def digest_parts_at(self, pos: tuple[int, int, int]) -> dict[str, str] | None:
        kept = self.__dict__.get("_digest")
        return kept[1] if kept is not None and kept[0] == pos else None

    def keep_digest(self, pos: tuple[int, int, int], parts: dict[str, str], keys: frozenset[str] | None,
                    digest: str) -> str:
        """Keep ``digest`` (of ``parts``, the state's at ``pos``): only the latest position's are kept."""
        kept = self.__dict__.get("_digest")
        if kept is None or kept[0] != pos:
            kept = self.__dict__["_digest"] = (pos, parts, {})
        kept[2][keys] = digest
        return digest

    # keys of ``state()`` whose values it builds anew at every call, sharing nothing the folds change: a snapshot
    # encodes them after the folds resume (``snapshot_document``)
    FRESH_STATE: ClassVar[frozenset[str]] = frozenset()

    def snapshot_document(self) -> dict[str, Any]:
        """The snapshot as a document that shares nothing with the projection: every part ``state()`` may hand out
        as the projection's own (a dict the next fold changes) is encoded here (``Encoded``), the FRESH_STATE parts
        (a backlog's jobs: most of the work) are left to encode later. Reads the projection and changes nothing,
        so it may run in a thread while nothing folds (``shared.runtime`` holds the folds for this part only)."""
        state = self.state()
        return {
            "version": self.snapshot_version(),
            "seq": self.seq,
            "applied": self.applied,
            "invalid_count": self.invalid_count,
            "invalid": Encoded(to_json(self.invalid_transitions)),
            "invalid_kinds": Encoded(to_json(self.invalid_kinds)),
            "kinds": Encoded(to_json(self.kinds)),
            "epochs": Encoded(to_json(self.epochs)),
            "terms": Encoded(to_json(self.terms)),
            "rejected": list(self.rejected),
            "state": {k: v if k in self.FRESH_STATE else Encoded(to_json(v)) for k, v in state.items()},
        }

    def snapshot(self) -> bytes:
        """The snapshot document: ``to_json`` of it byte for byte, written in pieces (``encode_json``)."""
        return encode_json(self.snapshot_document())

    @classmethod
    def snapshot_version(cls) -> dict[str, Any]:
        """What a snapshot must have been written by to be read: each class's SNAPSHOT_VERSION, the events'
        generation."""
        classes = {k.__name__: k.__dict__["SNAPSHOT_VERSION"] for k in reversed(cls.__mro__)
                   if "SNAPSHOT_VERSION" in k.__dict__}
        return {**classes, "events": events_generation()}

    def loaded(self, blob: bytes) -> "Projection":
        """A new projection of this class holding a snapshot; SnapshotUnusable if it is of another version (one
        written before snapshots had versions too) or cannot be read. Reads nothing of this one's state, so it may
        run in a thread while the event loop reads this one."""
        try:
            doc = from_json(blob)
        except ValueError as e:
            raise SnapshotUnusable(f"not JSON ({e})") from None
        if not isinstance(doc, dict):
            raise SnapshotUnusable(f"not a snapshot document (a JSON {type(doc).__name__})")
        found, wanted = doc.get("version"), self.snapshot_version()
        if found != wanted:
            why = "no version (written before snapshots had versions)" if found is None else \
                f"version {json.dumps(found, sort_keys=True)}"
            raise SnapshotUnusable(f"{why}; this code reads {json.dumps(wanted, sort_keys=True)}")
        fresh = type(self)()
        try:
            fresh._restore(doc)
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # a pydantic ValidationError is a ValueError
            raise SnapshotUnusable(f"unreadable state ({type(e).__name__}: {e})") from None
        return fresh

    def restore(self, blob: bytes) -> None:
        """Load a snapshot (``loaded``) into this projection; SnapshotUnusable leaves it unchanged."""
        self.adopt(self.loaded(blob))

    def adopt(self, other: "Projection") -> None:
        """Become ``other`` (a projection of this class loaded elsewhere, e.g. in a thread)."""
        self.__dict__.clear()
        self.__dict__.update(other.__dict__)

    def _restore(self, doc: dict[str, Any]) -> None:
        for key, kind in (("seq", int), ("applied", int), ("invalid_count", int), ("invalid", list), ("epochs", dict),
                          ("state", dict)):
            if not isinstance(doc[key], kind):
                raise TypeError(f"{key} is {type(doc[key]).__name__}, not {kind.__name__}")
        self.seq, self.applied = doc["seq"], doc["applied"]
        self.invalid_count, self.invalid_transitions = doc["invalid_count"], doc["invalid"]
        # older snapshots did not tell kinds apart: their rejections count as invalid
        self.invalid_kinds = doc.get("invalid_kinds", ["invalid"] * len(self.invalid_transitions))
        self.kinds = doc.get("kinds", {"invalid": self.invalid_count} if self.invalid_count else {})
        self.epochs = doc["epochs"]
        self.terms = {source: Term(*t) for source, t in doc.get("terms", {}).items()}  # older snapshots: none
        self.rejected = dict.fromkeys(doc.get("rejected", []))
        self.load(doc["state"])
