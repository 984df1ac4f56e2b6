from shared.runtime import Metrics, Service
from shared.settings import Settings

from services.inventory.api import router
from services.inventory.metrics import InventoryCollector
from services.inventory.projection import InventoryProjection
from services.inventory.relay import relay
from services.inventory.work import work_reaction


def build(settings: Settings, metrics: Metrics | None = None) -> Service:
    # the work writes are right in any order (each word only over an older one): many at once, so that a cycle that
    # places a hundred jobs does not wait a hundred round trips before the last node hears of its task
    svc = Service("inventory", InventoryProjection(), router=router, timers=[relay],
                  snapshot_every=settings.snapshot_every, metrics=metrics, instance=settings.instance,
                  reactions_at_once=64)
    svc.reaction = work_reaction(svc)  # each node's work, for its agent
    svc.metrics.own("inventory-collector", lambda r: r.register(InventoryCollector(lambda: svc.projection)))
    return svc
