"""The task keeper alone: CPU a task of the keeper, its account keepers and the tasks (`true`), driven as an agent
drives it (one request at a time, a 31-variable environment, the task's stdout and stderr as descriptors).

    python -m bench.keeper [--tasks 1000] [--runs 3] [--uid 65534]    # --uid needs root; --uid -1: no switch

Figures: docs/benchmarks/agent.md (issue 15's thirteenth round: a keeper per account).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import tempfile
import time
from pathlib import Path

from services.inventory import launcher


def run(tasks: int, uid: int, work: Path) -> dict[str, float]:
    """Start ``tasks`` `true`s through a keeper in a child process; its CPU and its descendants', per task."""
    os.chmod(work, 0o755)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ours.close()
            code = launcher.serve(theirs.fileno())
        finally:
            os._exit(code)
    theirs.close()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "USER": "u", "LOGNAME": "u",
           "LANG": "C.UTF-8", **{f"GPUORCH_VAR_{i}": str(i) for i in range(25)}}
    switch = ["--uid", str(uid), "--gid", str(uid), "--groups", ""] if uid >= 0 else []
    out = os.open(os.devnull, os.O_WRONLY)
    t0 = time.perf_counter()
    try:
        for i in range(tasks):
            args = ["--cwd", str(work), *switch, str(work / f"record-{i}"), "--", "true"]
            socket.send_fds(ours, [json.dumps({"argv": args, "cwd": str(work), "env": env}).encode()], [out, out])
            answer = ours.recv(100)
            if not answer.startswith(b"pid ") or answer == b"pid 0":
                raise RuntimeError(f"task {i} did not start: {answer!r}")
        while sum(1 for f in work.glob("record-*") if b"exited" in f.read_bytes()) < tasks:
            time.sleep(0.05)
        wall = time.perf_counter() - t0
    finally:
        os.close(out)
        ours.close()  # the keeper ends once its children have
        os.waitpid(pid, 0)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"cpu_ms_per_task": 1000 * cpu / tasks, "wall_ms_per_task": 1000 * wall / tasks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--uid", type=int, default=65534 if os.geteuid() == 0 else -1,
                    help="the account (uid = gid) the tasks run as; -1: the keeper's own (default when not root)")
    args = ap.parse_args()
    results = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            r = run(args.tasks, args.uid, Path(tmp))
        results.append(r)
        print(f"run: {r['cpu_ms_per_task']:.2f} ms of CPU a task (keeper, account keepers, tasks), "
              f"{r['wall_ms_per_task']:.2f} ms wall", flush=True)
    print(f"median of {args.runs}, {args.tasks} tasks as uid {args.uid}: "
          f"{statistics.median(r['cpu_ms_per_task'] for r in results):.2f} ms of CPU a task, "
          f"{statistics.median(r['wall_ms_per_task'] for r in results):.2f} ms wall")


if __name__ == "__main__":
    main()
