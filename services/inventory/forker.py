"""The agent's side of its task keeper (``launcher.py --serve``): one request per task, answered with the task's
pid (0: it could not start, and its exit record says why). Started on first use, started again if it died; a
request that still fails falls back to a launcher of its own (a new interpreter) for that task, so a task never
waits on the keeper's health."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
from pathlib import Path

from services.inventory.taskdir import write_env

log = logging.getLogger("gpuorch.agent")
LAUNCHER = str(Path(__file__).with_name("launcher.py"))
# -I: nothing of the environment or the user's site; -S: no site module at all (the launcher needs only the standard
# library), a third of an interpreter's start
PYTHON = [sys.executable, "-I", "-S", LAUNCHER]
REPLY_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 64 * 1024  # a request above this sends its task's environment by file (the keeper removes it)


def _answer(reply_bytes: bytes) -> int:
    reply = reply_bytes.decode(errors="replace")
    kind, _, value = reply.partition(" ")
    if kind == "pid" and value.isdigit():
        return int(value)
    if kind == "error":
        raise OSError(f"the keeper could not start the task: {value}")
    raise OSError(f"the keeper answered {reply[:100]!r}")


class Forker:
    def __init__(self, label: str) -> None:
        self.label = label  # shown in the process list: which agent's forker this is
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.strays: list[subprocess.Popen] = []  # launchers started without the keeper: reaped once ended
        self.keepers: list[subprocess.Popen] = []  # closed keepers whose tasks still run: reaped once ended
        self._one = asyncio.Lock()  # one request on the socket at a time: answers come in order

    async def launch_async(self, args: list[str], cwd: Path, stdout: int, stderr: int,
                           env: dict[str, str] | None = None) -> int:
        """Start the task of ``launcher.py ARGS`` in a session of its own, with these descriptors as its output and
        ``env`` as its environment (else --env-file's, else the keeper's): the pid that leads its process group (the
        task's, or its own launcher's), 0 if it ended before it started (its exit record is written). The caller
        keeps (and closes) its descriptors. The keeper's answer is awaited, not blocked on (a fork and exec on a busy
        machine: tens of milliseconds in which the agent reports other tasks); one request at a time."""
        async with self._one:
            for attempt in range(2):
                try:
                    self._send(args, cwd, stdout, stderr, env)
                    return _answer(await self._recv())
                except OSError as e:
                    self._failed(attempt, e)
                except asyncio.CancelledError:
                    self.close()  # its answer, still to come, would reach the next request
                    raise
            return self._stray(args, cwd, stdout, stderr, env)

    def ready(self) -> None:
        """Start the keeper now if it is not running (an agent starts it before its first task needs it)."""
        try:
            if self.sock is None or self.proc is None or self.proc.poll() is not None:
                self._start()
        except OSError as e:
            self._failed(0, e)

    def _send(self, args: list[str], cwd: Path, stdout: int, stderr: int, env: dict[str, str] | None = None) -> None:
        self.ready()
        if self.sock is None:
            raise OSError("no keeper")
        body = json.dumps({"argv": args, "cwd": str(cwd), **({"env": env} if env is not None else {})}).encode()
        if len(body) > MAX_REQUEST_BYTES and env is not None:  # a datagram that large may not fit the socket's buffer
            body = json.dumps({"argv": ["--env-file", str(write_env(cwd, env)), *args], "cwd": str(cwd)}).encode()
        socket.send_fds(self.sock, [body], [stdout, stderr])

    async def _recv(self) -> bytes:
        assert self.sock is not None
        sock, loop = self.sock, asyncio.get_running_loop()
        answered = loop.create_future()
        loop.add_reader(sock.fileno(), lambda: answered.done() or answered.set_result(None))
        try:
            await asyncio.wait_for(answered, REPLY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise OSError(f"no answer from the keeper in {REPLY_TIMEOUT_S:.0f} s") from None
        finally:
            loop.remove_reader(sock.fileno())
        return sock.recv(4096)

    def _failed(self, attempt: int, e: OSError) -> None:
        log.warning("event=forker_failed label=%s attempt=%d error=%r", self.label, attempt, e)
        self.close()

    def _stray(self, args: list[str], cwd: Path, stdout: int, stderr: int, env: dict[str, str] | None) -> int:
        if env is not None:  # its own launcher reads it from the task's directory, and removes it
            args = ["--env-file", str(write_env(cwd, env)), *args]
        proc = subprocess.Popen([*PYTHON, *args], cwd=cwd, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        self.strays = [p for p in self.strays if p.poll() is None] + [proc]
        return proc.pid

    def _start(self) -> None:
        self.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # its own session: a terminal's Ctrl-C reaches the agent, which closes the socket, and not the keeper
            self.proc = subprocess.Popen([*PYTHON, "--serve", str(theirs.fileno()), self.label], pass_fds=[theirs.fileno()],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        ours.settimeout(REPLY_TIMEOUT_S)
        self.sock = ours

    def close(self) -> None:
        """Close the keeper: it serves no more and ends once the tasks it started have ended (they run on)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            self.keepers = [p for p in self.keepers if p.poll() is None] + [self.proc]  # reaped once they end
            self.proc = None
