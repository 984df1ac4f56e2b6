"""One settings object, read from flags and GPUORCH_* environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUORCH_", extra="ignore")

    nats_url: str | None = None  # None: start the embedded nats-server on data_dir
    nats_user: str | None = None  # the bus credentials of this process (GPUORCH_NATS_USER / GPUORCH_NATS_PASSWORD)
    nats_password: str | None = None
    data_dir: Path = Path(".gpuorch")
    host: str = "127.0.0.1"
    port: int = 8080
    replicas: int = 1  # stream replicas: 3 in a JetStream cluster
    sync_always: bool = False  # nats-server fsyncs every write (slower; no acked write lost on power loss)
    snapshot_every: int = 10_000
    cycle_interval_s: float = 2.0  # scheduler and other deciders run at least this often
    heartbeat_timeout_s: float = 10.0  # a node silent this long is lost (health)
    free_unstarted_requeues: int = Field(2, ge=0)  # a job lost before it started is requeued this often without a retry
    debounce_s: float = 0.02  # deciders' cycles start at least this far apart (bench.e2e: 0.05 cost a one-node
    # mix a third of its throughput; bench.ingest: 0.01 lengthened the POST tail over a long queue)
    reason_refresh_s: float = 300.0  # a waiting job's reason is logged when its kind changes, else at most this often
    policy: str = "fgd+"  # FGD over FGD's F and the fill measure: above FGD on every openb workload
    half_life_s: float = 7 * 86400  # decayed usage for fair share, as Slurm's PriorityDecayHalfLife
    reclaim_grace_s: int = 300  # grace a job gets when quota reclaims its GPUs
    reclaim_after_s: float = 0.0  # a queue below its guarantee reclaims only for work that waited this long
    max_preemptions_per_hour: int = 3  # thrashing guard: a job preempted this often is left alone
    db_url: str | None = None  # read models: SQLite file under data_dir by default, PostgreSQL by URL
    log_level: str = "INFO"
    # who may call the API (shared/auth.py): our tokens in KV, and optionally an OIDC issuer's JWTs
    admin_token: str | None = None  # bootstrap admin token (compose); `gpuorch up` keeps one in <data_dir>/auth/admin.token
    oidc_issuer: str | None = None
    oidc_audience: str | None = None
    oidc_jwks_url: str | None = None  # default: the issuer's discovery document names it
    oidc_user_claim: str = "preferred_username"
    oidc_groups_claim: str = "groups"
    oidc_role_claim: str = "gpuorch_role"
    oidc_admin_groups: list[str] = []
    oidc_operator_groups: list[str] = []
    max_body_bytes: int = 1 << 20  # larger request bodies get 413 (a request becomes one event: keep it below NATS max_payload)
    submit_rate_per_s: float = 100.0  # jobs per second per user (admins are not limited)
    submit_burst: int = 1000
    secret_env_pattern: str = r"(?i)(secret|token|passw(or)?d|api_?key|credential|private_?key|access_?key)"
    autoscale_interval_s: float = 2.0
    stop_pool_nodes_on_exit: bool = True  # simulated pool nodes stop with the stack
    pool_lost_node_s: float = 300.0  # a pool node lost this long (and holding no work) is terminated and replaced
    instance: str | None = None  # replica name (durable consumer suffix); default: the host name
    nodes: str = "dgx-h100:2,l4-8x:1,t4-4x:1"  # simulated agents `gpuorch up` starts: profile:count,...
    providers_file: Path | None = None  # pool providers an admin configured (YAML); None: <data_dir>/providers.yaml if it exists
    jobfile_map: Path | None = None  # YAML: what this site's Slurm partitions/QOS and Kubernetes priority classes mean (README)
