from shared.runtime import Metrics, Service
from shared.settings import Settings

from services.autoscaler.api import router
from services.autoscaler.projection import AutoscalerProjection


def build(settings: Settings, metrics: Metrics | None = None) -> Service:
    return Service("autoscaler", AutoscalerProjection(), router=router, snapshot_every=settings.snapshot_every, metrics=metrics,
                   instance=settings.instance)
