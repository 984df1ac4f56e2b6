"""The autoscaler: grows node pools for waiting gangs, shrinks idle ones, scales inference replicas.

Run by the holder of the ``autoscaler`` lease. Nodes requested but not yet
registered count as hypothetical nodes in the next plan, so a slow provider is
never asked twice for the same gang.

A pool names its provider; the name is resolved against the admin's providers file
when the autoscaler acts, so nothing in the log can make it run a command. A pool
whose provider is not configured here is left alone, and says why.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

from nats.js.kv import KeyValue

from services.autoscaler.api import router
from services.autoscaler.projection import AutoscalerProjection
from services.autoscaler.providers import (SIMULATED, CommandProvider, ProviderError, ProvidersFileError,
                                          SimulatedProvider, load_providers, providers_path)
from services.autoscaler.scaling import ReplicaHistory, desired_replicas, lost_to_replace, scale_down, scale_up
from services.scheduler.snapshot import node_snap, snapshot_from_cluster
from shared import events as ev
from shared.cluster import ACTIVE, PENDING, NodeState
from shared.events import Envelope, new_id
from shared.fairshare import Ratios, job_share
from shared.leadership import Leadership
from shared.model import JobSpec
from shared.natsauth import Credentials
from shared.profiles import PROFILES, build as build_profile
from shared.runtime import Metrics, NotCaughtUp, Service
from shared.settings import Settings

log = logging.getLogger("gpuorch.autoscaler")
LOAD_BUCKET = "gpuorch_deployment_load"  # deployment -> the queue length its server last posted
LOAD_TTL_S = 3600.0


class Autoscaler:
    def __init__(self, settings: Settings, metrics: Metrics | None = None, *,
                 clock: Callable[[], float] = time.time) -> None:
        """``clock``: the time decisions are made at (epoch seconds): idle timeouts, replica history, metrics."""
        self.settings = settings
        self.clock = clock
        self.interval = settings.autoscale_interval_s
        self.leadership = Leadership("autoscaler", source="/gpuorch/autoscaler")
        self.history: dict[str, ReplicaHistory] = {}
        self._load_kv: KeyValue | None = None  # the bucket of posted queue lengths, once looked up
        self.simulated: SimulatedProvider | None = None
        self.providers = {name: CommandProvider.from_config(c) for name, c in load_providers(providers_path(settings)).items()}
        self.unscaled: dict[str, str] = {}  # pool -> why it is left alone (logged once)
        self.failures: dict[str, str] = {}  # pool -> what failed when it last grew or shrank (logged once)
        self.deployment_failures: dict[str, str] = {}  # deployment -> what failed when it last scaled
        self.svc = Service(
            "autoscaler", AutoscalerProjection(), timers=[self.leadership.hold, self.loop],
            router=lambda svc: router(svc, self), snapshot_every=settings.snapshot_every, metrics=metrics,
            instance=settings.instance,
        )

    @property
    def proj(self) -> AutoscalerProjection:
        return self.svc.projection  # type: ignore[return-value]

    def provider_names(self) -> list[str]:
        return [SIMULATED, *sorted(self.providers)]

    def config_error(self, pool: str) -> str | None:
        """Why this pool cannot be scaled as defined (a provider not configured here, a profile this release does
        not know: an old or forged pool.defined); None if it can."""
        profile = self.proj.pools[pool]["spec"].get("profile")
        if profile not in PROFILES:
            return f"unknown node profile {profile!r}; profiles: {', '.join(PROFILES)}"
        name = self.proj.pools[pool]["provider"]
        if name == SIMULATED or name in self.providers:
            return None
        return f"provider {name!r} is not configured on this server"

    def provider_error(self, pool: str) -> str | None:
        """What keeps the pool from scaling (GET /v1/pools): its definition, or what failed when it last acted."""
        return self.config_error(pool) or self.failures.get(pool)

    def provider(self, pool: str) -> SimulatedProvider | CommandProvider:
        if why := self.config_error(pool):
            raise ProviderError(why)
        name = self.proj.pools[pool]["provider"]
        if name != SIMULATED:
            return self.providers[name]
        if self.simulated is None:
            assert self.svc.log is not None
            url = self.svc.log.nc.connected_url
            nats_url = f"nats://{url.hostname}:{url.port}" if url else (self.settings.nats_url or "")
            creds = Credentials.of_data_dir(Path(self.settings.data_dir))
            self.simulated = SimulatedProvider(nats_url, Path(self.settings.data_dir) / "pools", self.settings.host,
                                               creds if creds.path.exists() else None, self.svc.log.replicas)
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
                t0 = time.perf_counter()
                now = self.clock()
                for step in (self.scale_pools, self.scale_deployments):  # a failure of one never stops the other
                    try:
                        await step(now)
                    except Exception:  # noqa: BLE001 - logged; the next tick decides again
                        log.exception("event=autoscale_failed step=%s", step.__name__)
                self.svc.metrics.cycle_seconds.labels("autoscaler").observe(time.perf_counter() - t0)
        finally:
            if self.simulated is not None and self.settings.stop_pool_nodes_on_exit:
                self.simulated.stop_all()

    # --- pools -------------------------------------------------------------------------

    async def scale_pools(self, now: float) -> None:
        proj = self.proj
        pools = [p for p in proj.pool_states() if self._scalable(p.spec.name)]
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
                await self._isolated(pool, self.grow(pool, k))
        busy = {n: bool(s.gpu_alloc or s.cpu_alloc) for n, s in proj.nodes.items()}
        idle = scale_down(pools, busy, proj.idle_since, now)
        for pool, nodes in idle.items():
            for node_id in nodes:
                await self._isolated(pool, self.shrink(pool, node_id))
        gone = {n for nodes in idle.values() for n in nodes}  # a lost node may be idle past its timeout too
        for pool, nodes in lost_to_replace(pools, busy, proj.lost_since, now, self.settings.pool_lost_node_s).items():
            for node_id in (n for n in nodes if n not in gone):
                await self._isolated(pool, self.shrink(pool, node_id, f"lost for {self.settings.pool_lost_node_s:g} s"))

    async def _isolated(self, name: str, action: Awaitable[None], failures: dict[str, str] | None = None) -> None:
        """One pool's (or deployment's) failure is its own: recorded (GET /v1/pools shows a pool's), logged once,
        and the others go on."""
        failures = self.failures if failures is None else failures
        try:
            await action
        except Exception as e:  # noqa: BLE001
            why = f"{type(e).__name__}: {e}"
            if failures.get(name) != why:
                log.exception("event=scaling_failed name=%s", name)
            failures[name] = why
        else:
            failures.pop(name, None)

    def _scalable(self, pool: str) -> bool:
        why = self.config_error(pool)
        if why is None:
            self.unscaled.pop(pool, None)
            return True
        if self.unscaled.get(pool) != why:
            log.warning("event=pool_not_scaled pool=%s reason=%r", pool, why)
            self.unscaled[pool] = why
        return False

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
            self.failures[pool] = f"provision failed: {e}"
            await self.emit(ev.PoolScaleRequested(pool=pool, delta=-1, reason=f"provision failed: {e}"))
            return
        await self.emit(ev.PoolNodeProvisioned(pool=pool, node_id=real_id), f"{real_id}-provisioned")
        log.info("event=node_provisioned pool=%s node=%s", pool, real_id)

    async def shrink(self, pool: str, node_id: str, why: str = "idle past the pool's timeout") -> None:
        """Cordon, drain (it is idle: nothing to move), terminate."""
        await self.emit(ev.NodeCordoned(node_id=node_id, reason=why))
        await self.emit(ev.NodeDrainRequested(node_id=node_id, grace_s=0, reason="scale down"))
        await self.emit(ev.NodeDrained(node_id=node_id))
        try:
            await self.provider(pool).terminate(pool, node_id)
        except (ProviderError, OSError, asyncio.TimeoutError) as e:
            log.error("event=terminate_failed pool=%s node=%s error=%s", pool, node_id, e)
            return
        seq = await self.emit(ev.PoolNodeTerminated(pool=pool, node_id=node_id), f"{node_id}-terminated")
        log.info("event=node_terminated pool=%s node=%s", pool, node_id)
        await self.settle(seq)

    # --- inference deployments -------------------------------------------------------------

    def replicas_of(self, name: str) -> list[str]:
        """The deployment's unfinished replicas: jobs of its owner that name it. Another user's job naming it in its
        environment is not one: it would hold replicas back, or be cancelled."""
        owner = self.proj.deployments[name]["spec"].get("owner")
        return [j.job_id for j in self.proj.jobs.values()
                if j.spec.env.get("GPUORCH_DEPLOYMENT") == name and j.owner == owner and j.state in ACTIVE | PENDING]

    async def scale_deployments(self, now: float) -> None:
        for name, dep in sorted(self.proj.deployments.items()):
            await self._isolated(name, self.scale_deployment(name, dep, now), self.deployment_failures)
        gone = self.proj.deleted_deployments
        if gone:  # one scan for them all; the list first: the fold may change the jobs while a cancel is appended
            orphans = [(j.job_id, name) for j in list(self.proj.jobs.values())
                       if (name := j.spec.env.get("GPUORCH_DEPLOYMENT")) in gone and j.owner == gone[name]
                       and j.state in ACTIVE | PENDING]
            for job_id, name in orphans:  # the id: a pass before the fold caught up appends it once
                await self.emit(ev.JobCancelled(job_id=job_id, reason=f"deployment {name} deleted"),
                                f"{job_id}-deployment-deleted")

    async def _loads(self) -> KeyValue:
        """The bucket of posted queue lengths (its handle kept: looking a bucket up is a request)."""
        if self._load_kv is None:
            self._load_kv = await self.svc.log.kv(LOAD_BUCKET, ttl=LOAD_TTL_S)
        return self._load_kv

    async def post_load(self, name: str, pending: float) -> None:
        """A deployment's queue length as its server posted it: kept in a bucket, so that every autoscaler replica
        (the leader decides) reads it, and a restart does not forget it; it expires after LOAD_TTL_S."""
        await (await self._loads()).put(name, json.dumps({"pending_requests": pending}).encode())

    async def forget_load(self, name: str) -> None:
        """A deleted deployment's load: a new one of its name starts from none."""
        await (await self._loads()).delete(name)

    async def load_of(self, name: str) -> float:
        """The last queue length posted for a deployment; 0 if none (or none within LOAD_TTL_S)."""
        from nats.js.errors import KeyDeletedError, KeyNotFoundError

        kv = await self._loads()
        try:
            entry = await kv.get(name)
            return float(json.loads(entry.value or b"{}").get("pending_requests", 0.0))
        except (KeyNotFoundError, KeyDeletedError):
            return 0.0
        except (ValueError, TypeError, AttributeError):
            log.warning("event=deployment_load_unreadable deployment=%s", name)
            return 0.0

    async def scale_deployment(self, name: str, dep: dict, now: float) -> None:
        spec = self.proj.deployment_spec(name)
        live = self.replicas_of(name)
        pending = await self.load_of(name)
        want = desired_replicas(spec, len(live), pending, now, self.history.setdefault(name, ReplicaHistory()))
        if want == len(live):
            return
        log.info("event=deployment_scaled deployment=%s from=%d to=%d pending=%s", name, len(live), want, pending)
        if want > len(live):
            job = JobSpec.model_validate({**dep["spec"]["job"], "env": {**dep["spec"]["job"].get("env", {}),
                                                                      "GPUORCH_DEPLOYMENT": name}})
            for _ in range(want - len(live)):
                job_id = new_id("j-")
                assert self.svc.log is not None
                await self.svc.log.append_many([
                    Envelope(ev.JobSubmitted(job_id=job_id, spec=job, owner=dep["spec"].get("owner")),
                             id=f"{job_id}-submitted", source="/gpuorch/autoscaler"),
                    Envelope(ev.JobQueued(job_id=job_id), id=f"{job_id}-queued", source="/gpuorch/autoscaler"),
                ])
        else:
            for job_id in sorted(live)[want:]:
                await self.emit(ev.JobCancelled(job_id=job_id, reason=f"deployment {name} scaled down"))
        seq = await self.emit(ev.DeploymentScaled(name=name, replicas=want))
        await self.settle(seq)

    async def settle(self, seq: int) -> None:
        """Wait for the fold to reach an own decision, so the next one is made on it."""
        try:
            await self.svc.caught_up(seq)
        except NotCaughtUp as e:
            log.warning("event=autoscaler_not_caught_up reason=%r", str(e))

def build(settings: Settings, metrics: Metrics | None = None) -> Service:
    try:
        return Autoscaler(settings, metrics).svc
    except ProvidersFileError as e:  # an operator's mistake: say which file and field, no traceback
        raise SystemExit(f"error: {e}") from None
