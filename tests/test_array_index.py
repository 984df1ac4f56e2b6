"""An array's elements are found through an index of the projection (``ClusterProjection.array_elements``), not by
walking every job: ``GET /v1/jobs/<array id>``, its cancel, a dependency on an array, and an id that is no job at
all each walked 20,000 queued jobs on the event loop (14 ms). The oracle walks every job held, as the API did."""

from __future__ import annotations

from shared import cluster as cluster_module
from shared import events as ev
from shared.cluster import ClusterProjection
from shared.events import Envelope
from shared.model import ArrayElement, JobSpec

SPEC = JobSpec(name="a", command=["true"], resources={"gpus": 1})


def walked(proj: ClusterProjection, array_id: str) -> list[str]:
    return [j.job_id for j in proj.jobs.values() if j.spec.array is not None and j.spec.array.id == array_id]


def test_an_arrays_elements_are_those_held_through_submissions_evictions_and_a_restore(monkeypatch):
    monkeypatch.setattr(cluster_module, "KEEP_FINISHED", 6)
    proj, seq = ClusterProjection(), 0

    def apply(event: ev.Event) -> None:
        nonlocal seq
        seq += 1
        proj.apply(Envelope(event, seq=seq))

    def check() -> None:
        for array_id in ("arr-a", "arr-b", "arr-none", "j-plain-0"):
            assert [j.job_id for j in proj.array_elements(array_id)] == walked(proj, array_id), array_id

    for i in range(5):
        for array_id in ("arr-a", "arr-b"):
            element = SPEC.model_copy(update={"array": ArrayElement(id=array_id, index=i)})
            apply(ev.JobSubmitted(job_id=f"{array_id}-{i}", spec=element))
        apply(ev.JobSubmitted(job_id=f"j-plain-{i}", spec=SPEC))
    check()
    assert len(proj.array_elements("arr-a")) == 5
    for job_id in [f"arr-a-{i}" for i in range(5)] + ["j-plain-0", "arr-b-0", "j-plain-1", "arr-b-1"]:
        apply(ev.JobCancelled(job_id=job_id, reason="test"))  # the first ended are evicted past KEEP_FINISHED
        check()
    assert [j.job_id for j in proj.array_elements("arr-a")] == ["arr-a-3", "arr-a-4"], "three evicted"
    restored = ClusterProjection()
    restored.restore(proj.snapshot())
    proj = restored
    check()
    apply(ev.JobCancelled(job_id="arr-b-2", reason="test"))
    check()
    assert [j.job_id for j in proj.array_elements("arr-a")] == ["arr-a-4"]
