from shared.cluster import ClusterProjection


class InventoryProjection(ClusterProjection):
    name = "inventory"
