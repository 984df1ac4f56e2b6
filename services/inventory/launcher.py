"""Run tasks and record how each ended.

    python -I launcher.py [--cwd DIR] [--env-file FILE] [--uid UID --gid GID [--groups G,...]] RECORD -- CMD...
    python -I launcher.py --serve FD [LABEL]

The second form is the agent's task keeper (``forker.Forker`` starts it, one per agent): it reads requests, each
the first form's arguments, a working directory, the task's environment (in the request: a job's secrets never
touch the disk) and two descriptors (the task's stdout and stderr), on the SOCK_SEQPACKET socket FD; it starts
each task as its own child, or, for a task of another account, has that account's keeper start it (a child of
this keeper that has become the account: see "account keepers" below), and appends the task's exit to its RECORD
(the agent's record of it) when it or the account's keeper reaps it.
One long-lived parent for every task costs a task its own fork and exec and nothing else: a per-task Python
launcher, forked or started afresh, cost 4-6 ms of CPU a task, mostly in page faults (bench.e2e: the largest CPU
cost of a short job). LABEL is not read: it names the agent in the process list. The first form is one task's
launcher, for an agent whose keeper cannot serve: it runs CMD as its child and records its exit.

Either runs in a session of its own, so a task outlives an agent that is killed, and a restarted agent
re-adopts it by its pid and reads its exit from the record. The keeper ends only when the agent is gone and its
last child has ended. If the keeper itself is killed, its tasks run on and the agent, a child subreaper,
inherits them and records their exits (``agent.Agent``). The keeper and the launcher run as the agent (so they
can write RECORD where the task cannot) with the agent's environment; only CMD runs as --uid/--gid with
exactly --groups as its supplementary groups, in --cwd, with the environment read from --env-file (removed once
read: a job's secrets do not stay on disk, and none of its variables, such as LD_PRELOAD, ever reach this root
process). CMD leads its own process group (keeper) or stays in the launcher's: a stop is a SIGTERM, then a
SIGKILL, to the whole group. A task that moves itself to another group or session escapes those signals
(containing it needs a cgroup per task).
Standard library only: it starts in milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback

REASON_MAX = 500  # characters of a refusal's reason kept (a record is read up to taskdir.RECORD_MAX bytes)


def _id(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) >= 2**32 - 1:
        raise argparse.ArgumentTypeError(f"not a uid/gid: {text!r}")
    return int(text)


def _ids(text: str) -> list[int]:
    return [_id(t) for t in text.split(",") if t]


@functools.cache  # the forker's one parser, made once (parse_args keeps no state)
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launcher.py")
    p.add_argument("record")
    p.add_argument("--cwd")
    p.add_argument("--env-file")
    p.add_argument("--uid", type=_id)
    p.add_argument("--gid", type=_id)
    p.add_argument("--groups", type=_ids, default=[])
    return p


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = _parser()
    if "--" not in argv or argv[-1] == "--":
        p.error("the command follows --")
    sep = argv.index("--")
    args = p.parse_args(argv[:sep])
    if (args.uid is None) != (args.gid is None):
        p.error("--uid and --gid go together")
    if args.uid is not None and os.geteuid() != 0:
        p.error(f"switching to uid {args.uid} needs root")
    return args, argv[sep + 1:]


def read_env(path: str) -> dict[str, str]:
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW)) as f:
        env = json.load(f)
    os.unlink(path)
    return checked_env(env, path)


def checked_env(env: object, where: str) -> dict[str, str]:
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError(f"{where}: not a mapping of strings")
    return env


def main(argv: list[str]) -> int:
    return run(*parse(argv))


def run(args: argparse.Namespace, cmd: list[str]) -> int:
    """The standalone launcher: the task as its child, in this process's session; its exit recorded."""
    try:
        env = read_env(args.env_file) if args.env_file else None
        switch = args.uid is not None
        child = subprocess.Popen(cmd, cwd=args.cwd, env=env, user=args.uid, group=args.gid,
                                 extra_groups=args.groups if switch else None)
    except (OSError, ValueError) as e:
        print(f"gpuorch: cannot start {cmd[0]!r}: {_why(e)}", file=sys.stderr)
        result = _refusal(cmd, e)
    else:
        signal.signal(signal.SIGTERM, lambda *_: None)  # the group got it: wait for the task to exit
        result = _result(child.wait())
    _record(args.record, result)
    return 0


def serve(fd: int) -> int:
    """Start a task per request on the socket ``fd`` and record how each ends; answer each with the task's pid
    (``pid N``: it leads its own session, so a stop signalled to its group reaches it), with ``pid 0`` when it could
    not start (its record says why), or with ``error WHY``. The tasks are this process's children, or its account
    keepers' (``Accounts``): it reaps them and writes their records, in its main loop (a signal handler's reap
    could race a start). It also reaps whatever a task orphans (a child subreaper). Once the agent closes the
    socket it serves no more, and ends when no child is left."""
    become_subreaper()
    wake_r, wake_w = os.pipe()
    for f in (wake_r, wake_w):
        os.set_blocking(f, False)
    signal.set_wakeup_fd(wake_w)  # SIGCHLD wakes the select below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sock = socket.socket(fileno=fd)
    running: dict[int, tuple[Starter, str]] = {}  # task pid -> (what started it, its record)
    accounts = Accounts(running)
    serving = True
    while serving or _reap(running):
        ready = select.select(([sock] if serving else []) + [wake_r, *accounts.sockets()], [], [],
                              None if serving else 1.0)[0]
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        accounts.hear(ready)
        _reap(running)
        if serving and sock in ready:
            try:
                serving = _serve_one(sock, running, accounts)
            except Exception:  # noqa: BLE001 - one request never takes down the keeper of the running tasks
                traceback.print_exc()
                serving = _reply(sock, "error the keeper failed on this request")
            if not serving:
                accounts.close()  # each ends once it has told what it reaped; its tasks' exits are recorded here
    return 0


def _serve_one(sock: socket.socket, running: dict[int, tuple[Starter, str]], accounts: Accounts | None = None) -> bool:
    """One request: start its task and answer; False once the agent is gone."""
    try:
        body, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
    except InterruptedError:
        return True
    except OSError:
        return False
    if not body:
        return False  # the agent is gone: what was started runs on, and is still recorded here
    try:
        if len(fds) != 2:
            raise ValueError(f"a request carries stdout and stderr, not {len(fds)} descriptors")
        req = json.loads(body)
        args, cmd = parse(list(req["argv"]))
        cwd = args.cwd or str(req["cwd"])
    except SystemExit as e:  # parse() refused the arguments, and said why on stderr
        _close(fds)
        return _reply(sock, f"error bad launcher arguments (exit {e.code})")
    except (ValueError, KeyError, TypeError) as e:
        _close(fds)
        return _reply(sock, f"error {e}")
    try:
        env = checked_env(req["env"], "the request's env") if "env" in req else None
        if env is None and args.env_file:
            env = read_env(args.env_file)
        keeper = accounts.keeper(args) if accounts is not None and args.uid is not None else None
        if keeper is not None:
            pid, refused = keeper.start(cmd, cwd, fds, env)
            if refused is not None:
                return _reply(sock, "pid 0" if _record(args.record, refused) else f"error cannot record {args.record}")
            running[pid] = (keeper, args.record)
            return _reply(sock, f"pid {pid}")
        proc = start(args, cmd, cwd, fds[0], fds[1], env)
    except (OSError, ValueError, TypeError, subprocess.SubprocessError) as e:
        with contextlib.suppress(OSError):
            os.write(fds[1], f"gpuorch: cannot start {cmd[0]!r}: {_why(e)}\n".encode())
        return _reply(sock, "pid 0" if _record(args.record, _refusal(cmd, e)) else
                      f"error cannot record {args.record}")
    finally:
        _close(fds)
    running[proc.pid] = (proc, args.record)
    return _reply(sock, f"pid {proc.pid}")


def _reply(sock: socket.socket, text: str) -> bool:
    """Answer the agent; False if it is gone (it stopped while it waited): serve no more, record on."""
    try:
        sock.send(text.encode())
    except OSError:
        return False
    return True


def start(args: argparse.Namespace, cmd: list[str], cwd: str, stdout: int, stderr: int,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """The task, in a session of its own, as --uid/--gid with exactly --groups, with ``env`` (the request's: it never
    touches the disk, or --env-file's)."""
    switch = args.uid is not None
    return subprocess.Popen(cmd, cwd=cwd, env=env, user=args.uid, group=args.gid,
                            extra_groups=args.groups if switch else None, stdin=subprocess.DEVNULL, stdout=stdout,
                            stderr=stderr, start_new_session=True)


# --- account keepers -------------------------------------------------------------------------------------------
#
# A task that runs as another account costs the keeper a fork: CPython starts a child with vfork only when it
# switches no ids, and a fork of this interpreter, then its copy-on-write faults, cost 2.3 ms of CPU a task
# against 1.1 with vfork (python -I -S, 500 `true`s). So the tasks of one account are started by a keeper of that
# account: a child of this one, forked once, that has switched to the account's uid, gid and groups, and starts
# each task with vfork. It holds nothing a process of that account could not reach already (the tasks it starts
# run as the same account), and it is not dumpable (no ptrace, no /proc/<pid>/mem or fd/ for that account). It
# tells this keeper each task's pid, or why it could not start it, and each exit it reaps; this keeper writes
# every record (the account cannot write them). If a task of the account kills or stops its keeper, the task
# being started is refused with the reason, the keeper is replaced, and the tasks it leaves are this keeper's
# (a subreaper's) to reap and record, as before; an exit it had reaped but not yet told is lost, and the agent
# reports that task lost (its own tasks only: a keeper serves one account).
ACCOUNT_KEEPERS_MAX = 8  # beyond this many accounts, an idle one's keeper ends, or the task is forked from here
ACCOUNT_REPLY_S = 3.0  # an account keeper that has not answered a request in this long is killed (the agent waits 5)
PR_SET_DUMPABLE = 4


class AccountKeeper:
    def __init__(self, pid: int, sock: socket.socket, running: dict[int, tuple[Starter, str]]) -> None:
        self.pid, self.sock, self.running = pid, sock, running
        self.pidfd = os.pidfd_open(pid)  # signalled through this: its pid may be reaped and reused meanwhile
        self.tasks: set[int] = set()  # the pids it started that have not ended
        self.used = time.monotonic()

    def start(self, cmd: list[str], cwd: str, fds: list[int], env: dict[str, str] | None) -> tuple[int, dict | None]:
        """Have it start the task: (its pid, None), or (0, the exit record of a task that could not start)."""
        self.used = time.monotonic()
        try:
            # it starts each task where it stands: it may not reach the directory by its path (the root agent's
            # work dir need not be open to the account), as the task started from here (chdir, then setuid) did not
            where = os.open(cwd, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                socket.send_fds(self.sock, [json.dumps({"argv": cmd, "env": env}).encode()], [*fds, where])
            finally:
                os.close(where)
            deadline, why = time.monotonic() + ACCOUNT_REPLY_S, "did not answer"
            while (left := deadline - time.monotonic()) > 0 and select.select([self.sock], [], [], left)[0]:
                said = self.hear()
                if said is None:
                    break  # it is gone
                if "pid" in said:
                    if _parent(said["pid"]) not in (self.pid, None):  # the agent would signal that group as the task's
                        why = f"told pid {said['pid']}, which it did not start"
                        break
                    self.tasks.add(said["pid"])
                    return said["pid"], None
                if "refused" in said:
                    return 0, said["refused"]
        except OSError:
            why = "did not answer"
        self.kill()
        return 0, {"code": 126, "reason": f"cannot start {cmd[0]}: the keeper of its account {why}"}

    def hear(self) -> dict | None:
        """Read one message; an exit it reaped is recorded here. None once it is gone (it is then killed)."""
        try:
            body = self.sock.recv(4096)
            said = _account_word(json.loads(body)) if body else None
        except (OSError, ValueError):
            said = None
        if said is None:  # gone, or said what it may not: never trusted again
            self.kill()
            return None
        if "exit" in said:
            pid, code = said["exit"]
            if pid in self.tasks and self.running.get(pid, (None,))[0] is self:  # its own tasks only
                self.tasks.discard(pid)
                _record(self.running.pop(pid)[1], _result(code))
        return said

    def close(self) -> None:
        """No more requests: it ends once it has told the exits it reaped (read on until it closes its end)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def kill(self) -> None:
        if self.pidfd >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            os.close(self.pidfd)
            self.pidfd = -1
        self.sock.close()


def _parent(pid: int) -> int | None:
    """The parent of process ``pid``; None once it is gone (its keeper may have reaped it already)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return parent_in_stat(f.read())
    except OSError:
        return None


def parent_in_stat(stat: bytes) -> int | None:
    """The parent in a ``/proc/PID/stat``; None for a process being released after it was reaped (state X): the
    kernel shows its parent as 0 then, for the instant before its pid goes. A ``true`` reaped by its keeper as the
    keeper's keeper read it was refused as a task the keeper "did not start" (1-4 jobs in 500 failed, bench.e2e)."""
    try:
        state, ppid = stat.rsplit(b") ", 1)[1].split()[:2]
        return None if state == b"X" else int(ppid)
    except (IndexError, ValueError):
        return None


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _account_word(said: object) -> dict | None:
    """An account keeper's message if it is one of its three, well formed: ``{"pid": N}`` (N > 1), ``{"exit": [N,
    CODE]}``, ``{"refused": {"code": C, "reason": R}}``; else None."""
    if not isinstance(said, dict) or len(said) != 1:
        return None
    (kind, value), = said.items()
    if kind == "pid":
        ok = _is_int(value) and value > 1
    elif kind == "exit":
        ok = isinstance(value, list) and len(value) == 2 and all(_is_int(v) for v in value)
    elif kind == "refused":
        ok = isinstance(value, dict) and set(value) == {"code", "reason"} and _is_int(value["code"]) and \
            isinstance(value["reason"], str)
    else:
        ok = False
    return said if ok else None


Starter = subprocess.Popen | AccountKeeper  # a task started here, or by an account's keeper


class Accounts:
    """This keeper's account keepers, by (uid, gid, groups)."""

    def __init__(self, running: dict[int, tuple[Starter, str]]) -> None:
        self.running = running
        self.keepers: dict[tuple, AccountKeeper] = {}
        self.ending: list[AccountKeeper] = []  # closed: read until each ends

    def sockets(self) -> list[socket.socket]:
        return [k.sock for k in [*self.keepers.values(), *self.ending] if k.pidfd >= 0]

    def hear(self, ready: list) -> None:
        for k in [*self.keepers.values(), *self.ending]:
            if k.pidfd >= 0 and k.sock in ready:
                k.hear()
        self.keepers = {key: k for key, k in self.keepers.items() if k.pidfd >= 0}
        self.ending = [k for k in self.ending if k.pidfd >= 0]

    def keeper(self, args: argparse.Namespace) -> AccountKeeper | None:
        """The keeper of the request's account, started now if need be; None: start the task from here."""
        key = (args.uid, args.gid, tuple(args.groups))
        if (k := self.keepers.get(key)) is not None and k.pidfd >= 0:
            return k
        self.keepers.pop(key, None)
        if len(self.keepers) >= ACCOUNT_KEEPERS_MAX:
            idle = [(k.used, kk) for kk, k in self.keepers.items() if not k.tasks]
            if not idle:
                return None
            self.close(self.keepers.pop(min(idle)[1]))
        try:
            k = self.keepers[key] = self._fork(*key)
        except OSError:
            traceback.print_exc()
            return None
        return k

    def _fork(self, uid: int, gid: int, groups: tuple[int, ...]) -> AccountKeeper:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            raise
        if pid == 0:  # the account's keeper: nothing of this one's but its own socket
            code = 1
            try:
                signal.set_wakeup_fd(-1)
                keep = theirs.fileno()  # and stdin, stdout, stderr: not the agent's socket, the other keepers', a
                os.closerange(3, keep)  # task's logs (their objects, still referenced, are never closed again here)
                os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
                code = serve_account(theirs, uid, gid, groups)
            except BaseException:  # noqa: BLE001 - never back into this keeper's loop
                traceback.print_exc()
            os._exit(code)
        theirs.close()
        try:
            return AccountKeeper(pid, ours, self.running)
        except OSError:
            ours.close()  # it reads the end of its socket and ends
            raise

    def close(self, k: AccountKeeper | None = None) -> None:
        for each in [k] if k is not None else list(self.keepers.values()):
            each.close()
            self.ending.append(each)
        if k is None:
            self.keepers.clear()


def serve_account(sock: socket.socket, uid: int, gid: int, groups: tuple[int, ...]) -> int:
    """An account's keeper: become the account, for good, then start each requested task (with vfork) and tell
    the pid; tell each exit reaped. Ends when its keeper closes the socket (its tasks are then the keeper's)."""
    os.setgroups(list(groups))
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or not _prctl(PR_SET_DUMPABLE, 0):
        return 1
    wake_r, wake_w = os.pipe()
    for f in (wake_r, wake_w):
        os.set_blocking(f, False)
    signal.set_wakeup_fd(wake_w)
    running: dict[int, subprocess.Popen] = {}
    while True:
        ready = select.select([sock, wake_r], [], [])[0]
        with contextlib.suppress(BlockingIOError):
            os.read(wake_r, 4096)
        for pid, code in _reaped(running):
            sock.send(json.dumps({"exit": [pid, code]}).encode())
        if sock not in ready:
            continue
        body, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        if not body:
            return 0
        req = json.loads(body)
        cmd = req["argv"]
        try:
            os.fchdir(fds[2])
            proc = subprocess.Popen(cmd, env=req["env"], stdin=subprocess.DEVNULL, stdout=fds[0], stderr=fds[1],
                                    start_new_session=True)
        except (OSError, ValueError, TypeError, subprocess.SubprocessError) as e:
            with contextlib.suppress(OSError):
                os.write(fds[1], f"gpuorch: cannot start {cmd[0]!r}: {_why(e)}\n".encode())
            sock.send(json.dumps({"refused": _refusal(cmd, e)}).encode())
        else:
            running[proc.pid] = proc
            sock.send(json.dumps({"pid": proc.pid}).encode())
        finally:
            _close(fds)


def _reap_ended(ended: list[tuple[int, int]]) -> bool:
    """Reap every child that has ended, (pid, return code) of each appended to ``ended``; whether any child is left."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        ended.append((pid, os.waitstatus_to_exitcode(status)))


def _reaped(running: dict[int, subprocess.Popen]) -> list[tuple[int, int]]:
    """Reap every child of an account's keeper that ended: (pid, return code) of each of its tasks."""
    ended: list[tuple[int, int]] = []
    _reap_ended(ended)
    out = []
    for pid, code in ended:
        if (proc := running.pop(pid, None)) is not None:
            proc.returncode = code  # reaped here: the Popen must not wait for it again
            out.append((pid, code))
    return out


def _reap(running: dict[int, tuple[Starter, str]]) -> bool:
    """Reap every child that ended and record the tasks among them; whether any child is left."""
    ended: list[tuple[int, int]] = []
    left = _reap_ended(ended)
    for pid, code in ended:
        if pid not in running:
            continue  # an orphan of some task, an account's keeper, or a start that failed after its fork
        proc, record = running.pop(pid)
        if isinstance(proc, subprocess.Popen):
            proc.returncode = code  # reaped here: the Popen must not wait for it again
        _record(record, _result(code))  # this keeper's task, or one an account's keeper left when it ended
    return left


def record_orphan(pid: int, record: str) -> dict | None:
    """For a subreaper that inherited the task ``pid`` from a keeper that died: reap it if it ended and record its
    exit; the record, or None (still running, or not this process's child)."""
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    if got == 0:
        return None
    result = _result(os.waitstatus_to_exitcode(status))
    _record(record, result)
    return result


def _result(returncode: int) -> dict:
    """An exit record: the exit code, or the signal that ended it (a negative return code)."""
    return {"code": returncode} if returncode >= 0 else {"signal": -returncode}


def _record(record: str, result: dict) -> bool:
    """Append the task's exit to its RECORD as the agent appends its own steps (``taskdir.append_record``): one
    write of one line under O_APPEND, begun with a newline, no link followed. No file of its own: each new file
    is an inode allocated, and a temporary file renamed was two names a task."""
    result = {**result, "reason": result["reason"][:REASON_MAX]} if "reason" in result else result
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(record, flags, 0o600)
        try:
            os.write(fd, b"\n" + json.dumps({"step": "exited", **result}).encode())
        finally:
            os.close(fd)
    except OSError:
        traceback.print_exc()
        return False
    return True


def _why(e: Exception) -> str:
    return (e.strerror or str(e)) if isinstance(e, OSError) else str(e)


def _refusal(cmd: list[str], e: Exception) -> dict:
    return {"code": 127 if isinstance(e, FileNotFoundError) else 126, "reason": f"cannot start {cmd[0]}: {_why(e)}"}


def _close(fds: list[int]) -> None:
    for f in fds:
        with contextlib.suppress(OSError):
            os.close(f)


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux's PR_SET_CHILD_SUBREAPER); False elsewhere."""
    return _prctl(36, 1)


def _prctl(option: int, value: int) -> bool:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"] and len(sys.argv) >= 3:
        sys.exit(serve(int(sys.argv[2])))
    sys.exit(main(sys.argv[1:]))
