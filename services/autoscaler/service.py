"""The autoscaler: grows node pools for waiting gangs, shrinks idle ones, scales inference replicas.

Run by the holder of the ``autoscaler`` lease. Nodes requested but not yet
registered count as hypothetical nodes in the next plan, so a slow provider is
never asked twice for the same gang.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from pathlib import Path

from services.autoscaler.api import router
from services.autoscaler.projection import AutoscalerProjection
from services.autoscaler.providers import CommandProvider, ProviderError, SimulatedProvider
from services.autoscaler.scaling import ReplicaHistory, desired_replicas, scale_down, scale_up
from services.scheduler.snapshot import node_snap, snapshot_from_cluster
from shared import events as ev
from shared.cluster import ACTIVE, PENDING, NodeState
from shared.events import Envelope, new_id
from shared.fairshare import Ratios, job_share
from shared.leadership import Leadership
from shared.model import JobSpec
from shared.profiles import build as build_profile
from shared.runtime import Metrics, Service
from shared.settings import Settings

log = logging.getLogger("gpuorch.autoscaler")


class Autoscaler:
    def __init__(self, settings: Settings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.interval = settings.autoscale_interval_s
        self.leadership = Leadership("autoscaler")
        self.metrics_in: dict[str, tuple[float, float]] = {}  # deployment -> (pending requests, when posted)
        self.history: dict[str, ReplicaHistory] = {}
        self.simulated: SimulatedProvider | None = None
        self.svc = Service(
            "autoscaler", AutoscalerProjection(), timers=[self.leadership.hold, self.loop],
            router=lambda svc: router(svc, self), snapshot_every=settings.snapshot_every, metrics=metrics,
            instance=settings.instance,
        )

    @property
    def proj(self) -> AutoscalerProjection:
        return self.svc.projection  # type: ignore[return-value]

    def provider(self, pool: str) -> SimulatedProvider | CommandProvider:
        conf = self.proj.pools[pool]["provider"]
        if conf["kind"] == "command":
            return CommandProvider(conf["provision"], conf["terminate"])
        if self.simulated is None:
            assert self.svc.log is not None
            url = self.svc.log.nc.connected_url
            nats_url = f"nats://{url.hostname}:{url.port}" if url else (self.settings.nats_url or "")
            self.simulated = SimulatedProvider(nats_url, Path(self.settings.data_dir) / "pools", self.settings.host)
        return self.simulated

    async def emit(self, event: ev.Event, event_id: str | None = None) -> int:
        assert self.svc.log is not None
        env = Envelope(event, source="/gpuorch/autoscaler", epoch=self.leadership.epoch,
                       **({"id": event_id} if event_id else {}))
        return await self.svc.log.append(env)

    async def loop(self, svc: Service) -> None:
        try:
            while True:
                await asyncio.sleep(self.interval)
                if not self.leadership.leader.is_set():
                    continue
                try:
                    now = time.time()
                    await self.scale_pools(now)
                    await self.scale_deployments(now)
                except Exception:  # noqa: BLE001 - logged; the next tick decides again
                    log.exception("event=autoscale_failed")
        finally:
            if self.simulated is not None and self.settings.stop_pool_nodes_on_exit:
                self.simulated.stop_all()

    # --- pools -------------------------------------------------------------------------

    async def scale_pools(self, now: float) -> None:
        proj = self.proj
        pools = proj.pool_states()
        if not pools:
            return
        snap = snapshot_from_cluster(proj, now)
        # nodes on their way count as if they were here: never buy twice for one gang
        coming = tuple(
            node_snap(NodeState(info=build_profile(p.spec.profile, f"{p.spec.name}-coming-{i}")))
            for p in pools for i in range(p.in_flight + sum(1 for n in p.nodes if n not in proj.nodes))
        )
        snap = replace(snap, nodes=snap.nodes + coming)
        alloc, _ = proj.queue_load()
        waiting = [j for j in snap.pending if proj.jobs[j.job_id].reason and not self._at_limit(j.queue, j, alloc, snap.ratios)]
        plan = scale_up(snap, pools, waiting, build_profile)
        for p in pools:  # the floor
            plan[p.spec.name] = max(plan.get(p.spec.name, 0), p.spec.min_nodes - p.size)
        for pool, k in plan.items():
            if k > 0:
                await self.grow(pool, k)
        busy = {n: bool(s.gpu_alloc or s.cpu_alloc) for n, s in proj.nodes.items()}
        for pool, nodes in scale_down(pools, busy, proj.idle_since, now).items():
            for node_id in nodes:
                await self.shrink(pool, node_id)

    def _at_limit(self, queue: str, job, alloc: dict[str, float], ratios: Ratios) -> bool:
        spec = self.proj.queues.get(queue)
        if spec is None or spec.limit is None:
            return False
        return alloc.get(queue, 0.0) + job_share(job.spec, ratios) > spec.limit.gpus

    async def grow(self, pool: str, k: int) -> None:
        seq = await self.emit(ev.PoolScaleRequested(pool=pool, delta=k, reason="waiting gangs need nodes"))
        spec = self.proj.pools[pool]["spec"]
        log.info("event=scale_up pool=%s nodes=%d delay_s=%s", pool, k, spec["provision_delay_s"])
        for i in range(k):
            asyncio.create_task(self.provision_later(pool, spec["profile"], f"{pool}-{seq}-{i}", spec["provision_delay_s"]))

    async def provision_later(self, pool: str, profile: str, node_id: str, delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            real_id = await self.provider(pool).provision(pool, profile, node_id)
        except (ProviderError, OSError, asyncio.TimeoutError) as e:
            log.error("event=provision_failed pool=%s node=%s error=%s", pool, node_id, e)
            await self.emit(ev.PoolScaleRequested(pool=pool, delta=-1, reason=f"provision failed: {e}"))
            return
        await self.emit(ev.PoolNodeProvisioned(pool=pool, node_id=real_id), f"{real_id}-provisioned")
        log.info("event=node_provisioned pool=%s node=%s", pool, real_id)

    async def shrink(self, pool: str, node_id: str) -> None:
        """Cordon, drain (it is idle: nothing to move), terminate."""
        await self.emit(ev.NodeCordoned(node_id=node_id, reason="idle past the pool's timeout"))
        await self.emit(ev.NodeDrainRequested(node_id=node_id, grace_s=0, reason="scale down"))
        await self.emit(ev.NodeDrained(node_id=node_id))
        try:
            await self.provider(pool).terminate(pool, node_id)
        except (ProviderError, OSError, asyncio.TimeoutError) as e:
            log.error("event=terminate_failed pool=%s node=%s error=%s", pool, node_id, e)
            return
        seq = await self.emit(ev.PoolNodeTerminated(pool=pool, node_id=node_id), f"{node_id}-terminated")
        await self.svc.caught_up(seq)
        log.info("event=node_terminated pool=%s node=%s", pool, node_id)

    # --- inference deployments -------------------------------------------------------------

    def replicas_of(self, name: str) -> list[str]:
        return [j.job_id for j in self.proj.jobs.values()
                if j.spec.env.get("GPUORCH_DEPLOYMENT") == name and j.state in ACTIVE | PENDING]

    async def scale_deployments(self, now: float) -> None:
        for name, dep in sorted(self.proj.deployments.items()):
            spec = self.proj.deployment_spec(name)
            live = self.replicas_of(name)
            pending, _ = self.metrics_in.get(name, (0.0, 0.0))
            want = desired_replicas(spec, len(live), pending, now, self.history.setdefault(name, ReplicaHistory()))
            if want == len(live):
                continue
            log.info("event=deployment_scaled deployment=%s from=%d to=%d pending=%s", name, len(live), want, pending)
            if want > len(live):
                job = JobSpec.model_validate({**dep["spec"]["job"], "env": {**dep["spec"]["job"].get("env", {}),
                                                                          "GPUORCH_DEPLOYMENT": name}})
                for _ in range(want - len(live)):
                    job_id = new_id("j-")
                    assert self.svc.log is not None
                    await self.svc.log.append_many([
                        Envelope(ev.JobSubmitted(job_id=job_id, spec=job), id=f"{job_id}-submitted", source="/gpuorch/autoscaler"),
                        Envelope(ev.JobQueued(job_id=job_id), id=f"{job_id}-queued", source="/gpuorch/autoscaler"),
                    ])
            else:
                for job_id in sorted(live)[want:]:
                    await self.emit(ev.JobCancelled(job_id=job_id, reason=f"deployment {name} scaled down"))
            seq = await self.emit(ev.DeploymentScaled(name=name, replicas=want))
            await self.svc.caught_up(seq)


def build(settings: Settings, metrics: Metrics | None = None) -> Service:
    return Autoscaler(settings, metrics).svc
