"""Our own history as a trace: the nodes, job submissions and recorded placements of a gpuorch event log.

``recorded(envelopes)`` is a pure fold; ``read_log(url)`` replays a log into it.
Each job keeps its submit time and how long it held its resources once placed
(its last placement until it ended; still holding at the end of the log: until
the simulation ends). A job that ended without ever being placed is cancelled
at the same time in the replay, if it is still waiting then.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.simulation.engine import Signature, SimResult, signature
from services.simulation.traces import TraceJob
from shared import events as ev
from shared.events import Envelope, Event
from shared.model import JobSpec

NODE_EVENTS = (ev.NodeRegistered, ev.NodeCordoned, ev.NodeDrainRequested, ev.NodeDrained, ev.NodeResumed,
               ev.NodeLost, ev.GpuUnhealthy)
ENDS = (ev.JobSucceeded, ev.JobFailed, ev.JobCancelled)


@dataclass
class _Job:
    spec: JobSpec
    submitted: float
    placed: float | None = None
    first: Signature | None = None
    ended: float | None = None
    holding: bool = False


@dataclass
class RecordedLog:
    infra: list[tuple[float, Event]] = field(default_factory=list)  # node events, in log order
    jobs: list[TraceJob] = field(default_factory=list)
    placements: dict[str, Signature] = field(default_factory=dict)  # each job's first recorded placement
    placed_at: dict[str, float] = field(default_factory=dict)
    policies: Counter = field(default_factory=Counter)  # job.placed events per recorded policy
    events: int = 0
    start: float = 0.0
    end: float = 0.0

    @property
    def policy(self) -> str:
        """The policy that made most recorded placements ("fgd", the live default, if none)."""
        return self.policies.most_common(1)[0][0] if self.policies else "fgd"


def recorded(envelopes: Iterable[Envelope]) -> RecordedLog:
    out = RecordedLog()
    jobs: dict[str, _Job] = {}
    for env in envelopes:
        e, t = env.data, env.timestamp
        if not out.events:
            out.start = t
        out.events += 1
        out.end = t
        if isinstance(e, NODE_EVENTS):
            out.infra.append((t, e))
        elif isinstance(e, ev.JobSubmitted) and e.job_id not in jobs:
            jobs[e.job_id] = _Job(e.spec, t if e.submitted_at is None else e.submitted_at)
        elif (job := jobs.get(getattr(e, "job_id", ""))) is None:
            continue
        elif isinstance(e, ev.JobPlaced):
            job.placed, job.holding = t, True
            if job.first is None:
                job.first = signature(e.placements)
                out.placed_at[e.job_id] = t
                out.policies[e.policy or "?"] += 1
        elif isinstance(e, (ev.JobPreempted, ev.JobRequeued)):
            job.holding = False
        elif isinstance(e, ENDS) and job.ended is None:
            job.ended = t
        elif isinstance(e, ev.JobRejected):
            job.ended = job.ended or t
    for job_id, job in jobs.items():
        if job.first is not None:
            out.placements[job_id] = job.first
        if job.holding and job.ended is not None and job.placed is not None:
            duration: float | None = max(0.0, job.ended - job.placed)
            cancel = None
        elif job.placed is None:
            duration, cancel = None, job.ended
        else:
            duration, cancel = None, None  # still holding when the log ends
        out.jobs.append(TraceJob(job_id, job.submitted, duration, job.spec, cancel))
    return out


async def read_log(url: str) -> RecordedLog:
    """Replay a whole event log (a running stack's NATS URL) into a RecordedLog."""
    from shared.eventlog import EventLog

    log = await EventLog.connect(url, ensure=False)
    try:
        return recorded([rec async for rec in log.replay(1) if isinstance(rec, Envelope)])
    finally:
        await log.close()


def compare(log: RecordedLog, result: SimResult, limit: int = 20) -> dict:
    """How the replay's placements and waits differ from the recorded ones."""
    same, moved, unplaced = 0, [], []
    waits = []
    for job_id, rec in log.placements.items():
        out = result.outcomes.get(job_id)
        if out is None or out.started is None:
            unplaced.append(job_id)
            continue
        waits.append((out.started - out.submitted) - (log.placed_at[job_id] - out.submitted))
        if out.placement == rec:
            same += 1
        else:
            moved.append({"job": job_id, "recorded": _text(rec), "simulated": _text(out.placement)})
    newly = [j for j, o in result.outcomes.items() if o.started is not None and j not in log.placements]
    return {
        "recorded_placements": len(log.placements),
        "same_placement": same,
        "different_placement": len(moved),
        "not_placed_in_simulation": len(unplaced),
        "placed_only_in_simulation": len(newly),
        "mean_wait_change_s": round(sum(waits) / len(waits), 3) if waits else None,
        "differences": moved[:limit],
    }


def _text(sig: Signature) -> list[str]:
    return [f"{node}:{','.join(gpus)}" for node, gpus in sig]
