"""Node agents as real processes for health's stack tests (the pattern of tests/test_agent.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shared.natsd import free_port


class AgentProc:
    def __init__(self, nats_url: str, node_id: str, work: Path, profile: str = "t4-4x"):
        self.nats_url, self.node_id, self.work, self.profile = nats_url, node_id, work, profile
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "AgentProc":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "agent", "--backend", "simulated", "--profile", self.profile,
             "--node-id", self.node_id, "--nats", self.nats_url, "--port", str(self.port), "--work-dir", str(self.work),
             "--rack", "r1"],
            start_new_session=True, stdout=open(self.work.parent / f"{self.node_id}.log", "ab"), stderr=subprocess.STDOUT)
        return self

    def signal(self, sig: int) -> None:
        """The agent process alone: its tasks run in their own sessions."""
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def task_pids(self) -> list[int]:
        return [int(p.read_text()) for p in self.work.glob("jobs/*/*/*/pid") if p.read_text().strip()]

    def stop_everything(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in self.task_pids():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.fixture
def agents(tmp_path: Path, nats_url: str):
    made: list[AgentProc] = []

    def make(*node_ids: str, profile: str = "t4-4x") -> list[AgentProc]:
        for node_id in node_ids:
            work = tmp_path / "agents" / node_id
            work.mkdir(parents=True)
            made.append(AgentProc(nats_url, node_id, work, profile).start())
        return made[-len(node_ids):]

    yield make
    for a in made:
        a.stop_everything()
