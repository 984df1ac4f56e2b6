from shared.runtime import Metrics, Service
from shared.settings import Settings

from services.quota.api import router
from services.quota.metrics import QuotaCollector
from services.quota.projection import QuotaProjection


def build(settings: Settings, metrics: Metrics | None = None) -> Service:
    svc = Service("quota", QuotaProjection(), router=lambda svc: router(svc, settings.half_life_s),
                  snapshot_every=settings.snapshot_every, metrics=metrics,
                  instance=settings.instance)
    collector = QuotaCollector(lambda: svc.projection, settings.half_life_s)
    svc.metrics.own("quota-collector", lambda r: r.register(collector))
    return svc
