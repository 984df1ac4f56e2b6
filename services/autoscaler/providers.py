"""Where nodes come from: simulated agents started as real processes, or programs an admin configured.

Nothing here runs a command that did not come from the server's own providers file
(setting ``providers_file``; by default ``<data_dir>/providers.yaml`` if it exists).
A pool names a provider; neither the API nor an event can name a command::

    providers:
      aws-p5:
        kind: command
        provision: ["/opt/gpuorch/provision-p5", "--region", "us-east-1"]
        terminate: ["/opt/gpuorch/terminate-p5"]
        timeout_s: 600
        env: {AWS_PROFILE: gpuorch}

The built-in provider ``simulated`` starts simulated agents for the simulated node profiles.

A ``command`` provider execs its argv (no shell) with one JSON object on stdin
({"action", "pool", "profile", "node_id"}) and reads one JSON object back
({"node_id": ...} at least): the hook for cloud CLIs and provisioners. Its
environment is not the autoscaler's: only PATH, HOME and LANG are passed on, plus
the entry's ``env``. A command still running after ``timeout_s`` is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from shared.natsauth import NODE_ID, Credentials, client_env
from shared.instance import process_start
from shared.natsd import free_port
from shared.settings import Settings

log = logging.getLogger("gpuorch.autoscaler")

SIMULATED = "simulated"
PROVIDER_NAME = r"^[a-z0-9][a-z0-9-]{0,40}$"
PASSED_ENV = ("PATH", "HOME", "LANG")


class ProviderError(Exception):
    pass


class ProvidersFileError(Exception):
    """The providers file cannot be read or is not valid; the message names the file and the field."""


def _argv(argv: list[str]) -> list[str]:
    if not argv:
        raise ValueError("needs at least the executable")
    if any("\0" in a for a in argv):
        raise ValueError("an argument contains a NUL byte")
    if not os.path.isabs(argv[0]):
        raise ValueError(f"the executable must be an absolute path, got {argv[0]!r}")
    return argv


def _env(env: dict[str, str]) -> dict[str, str]:
    for k, v in env.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise ValueError(f"{k!r} is not an environment variable name")
        if "\0" in v:
            raise ValueError(f"the value of {k} contains a NUL byte")
    return env


class CommandProviderConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["command"]
    provision: Annotated[list[str], AfterValidator(_argv)]
    terminate: Annotated[list[str], AfterValidator(_argv)]
    timeout_s: float = Field(600, gt=0, le=86400)
    env: Annotated[dict[str, str], AfterValidator(_env)] = {}


class ProvidersFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    providers: dict[str, CommandProviderConfig] = {}

    @field_validator("providers")
    @classmethod
    def _names(cls, providers: dict[str, CommandProviderConfig]) -> dict[str, CommandProviderConfig]:
        for name in providers:
            if name == SIMULATED:
                raise ValueError(f"{SIMULATED!r} is built in and cannot be configured")
            if not re.match(PROVIDER_NAME, name):
                raise ValueError(f"provider name {name!r}: lowercase letters, digits and '-'")
        return providers


def providers_path(settings: Settings) -> Path | None:
    """The configured file, else ``<data_dir>/providers.yaml`` if there is one; None: only ``simulated``."""
    if settings.providers_file is not None:
        return settings.providers_file
    default = Path(settings.data_dir) / "providers.yaml"
    return default if default.exists() else None


def load_providers(path: Path | None) -> dict[str, CommandProviderConfig]:
    """The admin's providers by name. Raises ProvidersFileError naming the file and the field."""
    if path is None:
        return {}
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ProvidersFileError(f"providers file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ProvidersFileError(f"providers file {path}: not valid YAML: {e}") from None
    try:
        return ProvidersFile.model_validate(doc if doc is not None else {}).providers
    except ValidationError as e:
        why = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'top level'}: {err['msg'].removeprefix('Value error, ')}"
                        + (f", got {err['input']!r}" if err["type"] == "literal_error" else "") for err in e.errors())
        raise ProvidersFileError(f"providers file {path}: {why}") from None


class SimulatedProvider:
    """Each node is a `gpuorch agent --backend simulated` process; its pid file survives an autoscaler restart."""

    def __init__(self, nats_url: str, work_dir: Path, host: str = "127.0.0.1", credentials: Credentials | None = None,
                 replicas: int = 1) -> None:
        """``credentials``: the embedded bus's users; each new node gets its own (and the server learns it);
        ``replicas``: of each agent's consumer, as the event log's."""
        self.nats_url, self.work_dir, self.host, self.credentials = nats_url, Path(work_dir), host, credentials
        self.replicas = replicas

    async def provision(self, pool: str, profile: str, node_id: str) -> str:
        d = self.work_dir / node_id
        d.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUORCH_NATS_")}
        if self.credentials is not None:
            env.update(client_env(await asyncio.to_thread(self.credentials.agent, node_id)))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.cli", "agent", "--backend", "simulated", "--profile", profile,
            "--node-id", node_id, "--nats", self.nats_url, "--port", str(free_port()), "--host", self.host,
            "--work-dir", str(d / "work"), "--pool", pool, "--labels", f"gpuorch.io/pool={pool}", "--kill-tasks-on-exit",
            "--replicas", str(self.replicas),
            stdout=open(d / "agent.log", "ab"), stderr=asyncio.subprocess.STDOUT, start_new_session=True, env=env,
        )
        (d / "pid").write_text(f"{proc.pid} {process_start(proc.pid)}")
        return node_id

    @staticmethod
    def _agent(pid_file: Path) -> int | None:
        """The pid in ``pid_file`` if that process is still the agent started then (same pid and start time: a pid
        is reused once its process is gone, and the one it is given to must never get our signals)."""
        try:
            pid, _, started = pid_file.read_text().partition(" ")
            return int(pid) if started.strip() and process_start(int(pid)) == started.strip() else None
        except (OSError, ValueError):
            return None

    async def terminate(self, pool: str, node_id: str) -> None:
        pid_file = self.work_dir / node_id / "pid"
        pid = self._agent(pid_file)
        if pid is None:  # gone already (or a pid file of an older release, without the start time: left alone)
            pid_file.unlink(missing_ok=True)
            return
        try:
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                await asyncio.sleep(0.1)
                os.kill(pid, 0)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        pid_file.unlink(missing_ok=True)

    def stop_all(self) -> None:
        for pid_file in self.work_dir.glob("*/pid"):
            if (pid := self._agent(pid_file)) is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)


class CommandProvider:
    def __init__(self, provision: list[str], terminate: list[str], timeout_s: float = 600,
                 env: Mapping[str, str] | None = None) -> None:
        self.provision_cmd, self.terminate_cmd, self.timeout_s = list(provision), list(terminate), timeout_s
        self.env = {**{k: os.environ[k] for k in PASSED_ENV if k in os.environ}, **(env or {})}

    @classmethod
    def from_config(cls, conf: CommandProviderConfig) -> "CommandProvider":
        return cls(conf.provision, conf.terminate, conf.timeout_s, conf.env)

    async def _run(self, cmd: list[str], request: dict) -> dict:
        if not cmd:
            raise ProviderError(f"pool has no {request['action']} command")
        proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE, env=self.env, start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(json.dumps(request).encode()), self.timeout_s)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise ProviderError(f"{cmd[0]} did not finish within {self.timeout_s:g}s: killed") from None
        if proc.returncode != 0:
            raise ProviderError(f"{cmd[0]} exited {proc.returncode}: {err.decode(errors='replace')[-500:]}")
        try:
            reply = json.loads(out or b"{}")
        except ValueError:
            raise ProviderError(f"{cmd[0]} did not print JSON: {out[:200]!r}") from None
        if not isinstance(reply, dict):
            raise ProviderError(f"{cmd[0]} printed {type(reply).__name__}, not a JSON object")
        return reply

    async def provision(self, pool: str, profile: str, node_id: str) -> str:
        reply = await self._run(self.provision_cmd, {"action": "provision", "pool": pool, "profile": profile, "node_id": node_id})
        got = str(reply.get("node_id") or node_id)
        if not NODE_ID.match(got):
            raise ProviderError(f"{self.provision_cmd[0]} named node {got[:100]!r}: not a node id (letters, digits, . _ -)")
        return got

    async def terminate(self, pool: str, node_id: str) -> None:
        await self._run(self.terminate_cmd, {"action": "terminate", "pool": pool, "node_id": node_id})

    def stop_all(self) -> None:
        pass
