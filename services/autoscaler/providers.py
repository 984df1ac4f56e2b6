"""Where nodes come from: simulated agents started as real processes, or an operator's programs.

The `command` provider runs the pool's provision/terminate program with one JSON
object on stdin ({"action", "pool", "profile", "node_id"}) and reads one JSON object
back ({"node_id": ...} at least): the hook for cloud CLIs and provisioners.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from shared.natsd import free_port

log = logging.getLogger("gpuorch.autoscaler")


class ProviderError(Exception):
    pass


class SimulatedProvider:
    """Each node is a `gpuorch agent --backend simulated` process; its pid file survives an autoscaler restart."""

    def __init__(self, nats_url: str, work_dir: Path, host: str = "127.0.0.1") -> None:
        self.nats_url, self.work_dir, self.host = nats_url, Path(work_dir), host

    async def provision(self, pool: str, profile: str, node_id: str) -> str:
        d = self.work_dir / node_id
        d.mkdir(parents=True, exist_ok=True)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.cli", "agent", "--backend", "simulated", "--profile", profile,
            "--node-id", node_id, "--nats", self.nats_url, "--port", str(free_port()), "--host", self.host,
            "--work-dir", str(d / "work"), "--pool", pool, "--labels", f"gpuorch.io/pool={pool}", "--kill-tasks-on-exit",
            stdout=open(d / "agent.log", "ab"), stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )
        (d / "pid").write_text(str(proc.pid))
        return node_id

    async def terminate(self, pool: str, node_id: str) -> None:
        pid_file = self.work_dir / node_id / "pid"
        if not pid_file.exists():
            return
        pid = int(pid_file.read_text())
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
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass


class CommandProvider:
    def __init__(self, provision: list[str], terminate: list[str], timeout_s: float = 600) -> None:
        self.provision_cmd, self.terminate_cmd, self.timeout_s = provision, terminate, timeout_s

    async def _run(self, cmd: list[str], request: dict) -> dict:
        if not cmd:
            raise ProviderError(f"pool has no {request['action']} command")
        proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(json.dumps(request).encode()), self.timeout_s)
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
        return str(reply.get("node_id") or node_id)

    async def terminate(self, pool: str, node_id: str) -> None:
        await self._run(self.terminate_cmd, {"action": "terminate", "pool": pool, "node_id": node_id})

    def stop_all(self) -> None:
        pass
