from shared.runtime import Metrics, Service
from shared.settings import Settings

from services.inventory.api import router
from services.inventory.projection import InventoryProjection
from services.inventory.relay import relay


def build(settings: Settings, metrics: Metrics | None = None) -> Service:
    return Service("inventory", InventoryProjection(), router=router, timers=[relay], snapshot_every=settings.snapshot_every,
                   metrics=metrics, instance=settings.instance)
