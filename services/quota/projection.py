from shared.cluster import ClusterProjection


class QuotaProjection(ClusterProjection):
    name = "quota"
