from shared.cluster import ClusterProjection


class SchedulerProjection(ClusterProjection):
    name = "scheduler"
