from shared.runtime import Metrics, Service
from shared.settings import Settings

from services.health.api import router
from services.health.projection import HealthProjection


def build(settings: Settings, metrics: Metrics | None = None) -> Service:
    return Service("health", HealthProjection(), router=router, snapshot_every=settings.snapshot_every, metrics=metrics)
