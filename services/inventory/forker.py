"""The agent's side of its task keeper (``launcher.py --serve``): one request per task, answered with the task's
pid (0: it could not start, and its exit record says why). Started on first use, started again if it died; a
request that still fails falls back to a launcher of its own (a new interpreter) for that task, so a task never
waits on the keeper's health."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("gpuorch.agent")
LAUNCHER = str(Path(__file__).with_name("launcher.py"))
# -I: nothing of the environment or the user's site; -S: no site module at all (the launcher needs only the standard
# library), a third of an interpreter's start
PYTHON = [sys.executable, "-I", "-S", LAUNCHER]
REPLY_TIMEOUT_S = 5.0


class Forker:
    def __init__(self, label: str) -> None:
        self.label = label  # shown in the process list: which agent's forker this is
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.strays: list[subprocess.Popen] = []  # launchers started without the keeper: reaped once ended
        self.keepers: list[subprocess.Popen] = []  # closed keepers whose tasks still run: reaped once ended

    def launch(self, args: list[str], cwd: Path, stdout: int, stderr: int) -> int:
        """Start the task of ``launcher.py ARGS`` in a session of its own, with these descriptors as its output: the
        pid that leads its process group (the task's, or its own launcher's), 0 if it ended before it started (its
        exit record is written). The caller keeps (and closes) its descriptors."""
        for attempt in range(2):
            try:
                return self._request(args, cwd, stdout, stderr)
            except OSError as e:
                log.warning("event=forker_failed label=%s attempt=%d error=%r", self.label, attempt, e)
                self.close()
        proc = subprocess.Popen([*PYTHON, *args], cwd=cwd, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        self.strays = [p for p in self.strays if p.poll() is None] + [proc]
        return proc.pid

    def _request(self, args: list[str], cwd: Path, stdout: int, stderr: int) -> int:
        if self.sock is None or self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.sock is not None
        socket.send_fds(self.sock, [json.dumps({"argv": args, "cwd": str(cwd)}).encode()], [stdout, stderr])
        reply = self.sock.recv(4096).decode(errors="replace")
        kind, _, value = reply.partition(" ")
        if kind == "pid" and value.isdigit():
            return int(value)
        if kind == "error":
            raise OSError(f"the forker could not start the launcher: {value}")
        raise OSError(f"the forker answered {reply[:100]!r}")

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
