import itertools

from shared.cluster import ClusterProjection
from shared.events import Envelope

_VERSIONS = itertools.count(1)  # process-wide: a version is never reused, even by a projection adopted from a snapshot
SHAPE_AGGREGATES = frozenset({"node", "gpu", "queue", "pool"})  # what admission reads (services.scheduler.admission)


class SchedulerProjection(ClusterProjection):
    name = "scheduler"
    shape_version = 0  # changes whenever what admission reads may have: its verdicts are kept until then

    def apply(self, env: Envelope) -> bool:
        changed = super().apply(env)
        if env.data.aggregate in SHAPE_AGGREGATES:
            self.shape_version = next(_VERSIONS)
        return changed

    def adopt(self, other: "SchedulerProjection") -> None:  # type: ignore[override]
        super().adopt(other)
        self.shape_version = next(_VERSIONS)
