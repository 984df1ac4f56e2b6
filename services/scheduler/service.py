from shared.runtime import Metrics, Service
from shared.settings import Settings

from services.scheduler.api import router
from services.scheduler.projection import SchedulerProjection


def build(settings: Settings, metrics: Metrics | None = None) -> Service:
    return Service("scheduler", SchedulerProjection(), router=router, snapshot_every=settings.snapshot_every, metrics=metrics)
