"""Run one task and record how it ended.

    python -I launcher.py [--cwd DIR] [--env-file FILE] [--uid UID --gid GID [--groups G,...]] EXIT_FILE -- CMD...
    python -I launcher.py --serve FD [LABEL]

The second form is the agent's long-lived launcher (``forker.Forker`` starts it): it reads requests, each the
first form's arguments, a working directory and two descriptors (the task's stdout and stderr), on the
SOCK_SEQPACKET socket FD, and forks one launcher per request, which then runs exactly as the first form. A fork
of this small process costs well under a millisecond, a new interpreter tens of them (bench.e2e: the largest CPU
cost of a short job). It ends when the agent closes the socket (or dies); the launchers it forked run on. LABEL
is not read: it names the agent in the process list.

The agent starts this wrapper in a new session, so a task outlives an agent that is killed, and a
restarted agent can re-adopt it by its pid and read its exit from the file. The wrapper runs as the
agent (so it can write EXIT_FILE where the task cannot) with the agent's environment; only CMD runs as
--uid/--gid with exactly --groups as its supplementary groups, in --cwd, with the environment read from
--env-file (removed once read: a job's secrets do not stay on disk, and none of its variables, such as
LD_PRELOAD, ever reach this root process). CMD stays in the wrapper's process group: a stop is a SIGTERM,
then a SIGKILL, to the whole group, so it gets both; the wrapper itself waits for it. A task that moves
itself to another group or session escapes those signals (containing it needs a cgroup per task).
Standard library only: it starts in milliseconds.
"""

import argparse
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import traceback


def _id(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) >= 2**32 - 1:
        raise argparse.ArgumentTypeError(f"not a uid/gid: {text!r}")
    return int(text)


def _ids(text: str) -> list[int]:
    return [_id(t) for t in text.split(",") if t]


@functools.cache  # the forker's one parser, made once (parse_args keeps no state)
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launcher.py")
    p.add_argument("exit_file")
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
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError(f"{path}: not a mapping of strings")
    return env


def main(argv: list[str]) -> int:
    return run(*parse(argv))


def run(args: argparse.Namespace, cmd: list[str]) -> int:
    switch = args.uid is not None
    try:
        env = read_env(args.env_file) if args.env_file else None
        child = subprocess.Popen(cmd, cwd=args.cwd, env=env, user=args.uid, group=args.gid,
                                 extra_groups=args.groups if switch else None)
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) else str(e)
        print(f"gpuorch: cannot start {cmd[0]!r}: {why}", file=sys.stderr)
        result = {"code": 127 if isinstance(e, FileNotFoundError) else 126, "reason": f"cannot start {cmd[0]}: {why}"}
    else:
        signal.signal(signal.SIGTERM, lambda *_: None)  # the group got it: wait for the task to exit
        rc = child.wait()
        result = {"code": rc} if rc >= 0 else {"signal": -rc}
    tmp = args.exit_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, args.exit_file)
    return 0


def serve(fd: int) -> int:
    """Fork a launcher per request on the socket ``fd``; answer each with the launcher's pid (``pid N``) once it
    leads its own session, or with ``error WHY``. Launchers are reaped as they end (the agent watches them by pid),
    so that their CPU time counts as this process's children's, as a new interpreter's did as the agent's."""
    signal.signal(signal.SIGCHLD, _reap)
    sock = socket.socket(fileno=fd)
    while True:
        try:
            body, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
        except OSError:
            return 0
        if not body:
            return 0  # the agent is gone: what was started runs on
        try:
            if len(fds) != 2:
                raise ValueError(f"a request carries stdout and stderr, not {len(fds)} descriptors")
            req = json.loads(body)
            # parsed here, not in the fork: argparse's first parse in a fresh fork cost 5 ms of its CPU (lazy
            # imports, regexes, copied pages), most of a short task's launch
            parsed = parse(list(req["argv"]))
            ready_r, ready_w = os.pipe()
            pid = os.fork()
        except SystemExit as e:  # parse() refused the arguments, and said why on stderr
            for f in fds:
                os.close(f)
            sock.send(f"error bad launcher arguments (exit {e.code})".encode())
            continue
        except (OSError, ValueError, KeyError, TypeError) as e:
            for f in fds:
                os.close(f)
            sock.send(f"error {e}".encode())
            continue
        if pid == 0:
            os.close(ready_r)
            _launch_forked(sock, fds, req["cwd"], parsed, ready_w)
        for f in (*fds, ready_w):
            os.close(f)
        os.read(ready_r, 1)  # its session exists (or it died): a stop signalled to its group from now on reaches it
        os.close(ready_r)
        sock.send(f"pid {pid}".encode())


def _reap(*_: object) -> None:
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _launch_forked(sock: socket.socket, fds: list[int], cwd: str, parsed: tuple[argparse.Namespace, list[str]],
                   ready: int) -> None:
    """In the fork: become the task's launcher (its own session, the task's logs as stdout and stderr, its
    directory), as if started by the agent, then exit. The socket is closed first: no task can ask for another."""
    code = 1
    try:
        sock.close()
        os.setsid()
        os.close(ready)
        null = os.open(os.devnull, os.O_RDONLY)
        for target, f in ((0, null), (1, fds[0]), (2, fds[1])):
            os.dup2(f, target)
            os.close(f)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the launcher waits for its task
        os.chdir(cwd)
        code = run(*parsed)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 2
    except BaseException:  # noqa: BLE001 - the fork never returns into the serving loop
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - nothing left to tell
                pass
        os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"] and len(sys.argv) >= 3:
        sys.exit(serve(int(sys.argv[2])))
    sys.exit(main(sys.argv[1:]))
