"""One settings object, read from flags and GPUORCH_* environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUORCH_", extra="ignore")

    nats_url: str | None = None  # None: start the embedded nats-server on data_dir
    data_dir: Path = Path(".gpuorch")
    host: str = "127.0.0.1"
    port: int = 8080
    replicas: int = 1  # stream replicas: 3 in a JetStream cluster
    sync_always: bool = False  # nats-server fsyncs every write (slower; no acked write lost on power loss)
    snapshot_every: int = 10_000
    cycle_interval_s: float = 2.0  # scheduler and other deciders run at least this often
    heartbeat_timeout_s: float = 10.0  # a node silent this long is lost (health)
    debounce_s: float = 0.05
    policy: str = "fgd+"  # FGD with CPU-aware fragmentation: above published FGD on every openb workload
    half_life_s: float = 7 * 86400  # decayed usage for fair share, as Slurm's PriorityDecayHalfLife
    reclaim_grace_s: int = 300  # grace a job gets when quota reclaims its GPUs
    reclaim_after_s: float = 0.0  # a queue below its guarantee reclaims only for work that waited this long
    max_preemptions_per_hour: int = 3  # thrashing guard: a job preempted this often is left alone
    db_url: str | None = None  # read models: SQLite file under data_dir by default, PostgreSQL by URL
    log_level: str = "INFO"
    autoscale_interval_s: float = 2.0
    stop_pool_nodes_on_exit: bool = True  # simulated pool nodes stop with the stack
    instance: str | None = None  # replica name (durable consumer suffix); default: the host name
    nodes: str = "dgx-h100:2,l4-8x:1,t4-4x:1"  # simulated agents `gpuorch up` starts: profile:count,...
