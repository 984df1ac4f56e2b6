"""Run one task and record how it ended.

    python -I launcher.py [--cwd DIR] [--env-file FILE] [--uid UID --gid GID [--groups G,...]] EXIT_FILE -- CMD...

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
import json
import os
import signal
import subprocess
import sys


def _id(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) >= 2**32 - 1:
        raise argparse.ArgumentTypeError(f"not a uid/gid: {text!r}")
    return int(text)


def _ids(text: str) -> list[int]:
    return [_id(t) for t in text.split(",") if t]


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="launcher.py")
    p.add_argument("exit_file")
    p.add_argument("--cwd")
    p.add_argument("--env-file")
    p.add_argument("--uid", type=_id)
    p.add_argument("--gid", type=_id)
    p.add_argument("--groups", type=_ids, default=[])
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


def main() -> int:
    args, cmd = parse(sys.argv[1:])
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


if __name__ == "__main__":
    sys.exit(main())
