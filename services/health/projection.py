from shared.cluster import ClusterProjection


class HealthProjection(ClusterProjection):
    name = "health"
