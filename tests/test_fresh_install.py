"""README's first command on a fresh virtual environment: `gpuorch up` answers /healthz within 15 s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_fresh_install_answers_healthz_within_15_seconds(tmp_path: Path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(ROOT)], check=True, timeout=600,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from shared.natsd import free_port

    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen([str(venv / "bin" / "gpuorch"), "up", "--port", str(port), "--data-dir", str(tmp_path / "d")],
                            cwd=tmp_path, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        answered = None
        while time.monotonic() - started < 15 and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    answered = time.monotonic() - started
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert answered is not None, "no /healthz answer within 15 s"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            stack = tmp_path / "d" / "stack.json"
            info = json.loads(stack.read_text()) if stack.exists() else {}
            for pid in [info.get("nats_pid"), *info.get("agent_pids", [])]:  # each runs in its own session
                if pid and Path(f"/proc/{pid}").exists():
                    os.kill(pid, signal.SIGKILL)
