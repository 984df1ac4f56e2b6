"""What the agent's file-system work costs on a file system: CPU and wall microseconds of each kind of operation
a task's directory takes (``docs/benchmarks/agent.md``).

    python -m bench.fsops [DIR ...] [--after-removal N]   # default: $TMPDIR (or /tmp) and /dev/shm

Each operation runs ``--n`` times in a fresh directory under DIR, which is removed afterwards; the last two rows
are a task's directories and its files as the agent makes them (``taskdir``). ``--after-removal N`` first
creates and removes N files under DIR: ext4 then skips each recently freed inode when it allocates one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from services.inventory.taskdir import append_record, make_task_dir, make_workspace, open_log


def describe_fs(path: str) -> str:
    """The file system that holds ``path``: its type and mount point and, for ext4, whether it has a journal. Without
    one, ext4 skips every inode freed in the last minute (six while its table block is dirty) when it allocates one
    (``find_inode_bit``: ``check_recently_deleted = s_journal == NULL``), which makes creating files after removing
    many 10x dearer; with one (mkfs.ext4's default) it does not."""
    st = os.stat(path)
    best = ("", "?", "")
    with open("/proc/self/mounts") as f:
        for line in f:
            dev, mnt, kind = line.split()[:3]
            mnt = mnt.replace("\\040", " ")
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best[0]):
                best = (mnt, kind, dev)
    mnt, kind, dev = best
    if kind != "ext4":
        return f"{kind} ({mnt})"
    name = os.path.basename(os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"))
    journal = any(n.startswith(f"{name}-") for n in os.listdir("/proc/fs/jbd2")) if os.path.isdir("/proc/fs/jbd2") \
        else None
    return f"ext4 ({mnt}, {dev}, " + {True: "journal)", False: "NO journal: freed inodes are skipped)",
                                        None: "journal unknown)"}[journal]


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def measure(base: str, n: int) -> dict[str, tuple[float, float]]:
    """-> {operation: (CPU us, wall us)} per operation, on ``base``."""
    root = tempfile.mkdtemp(prefix="fsops-", dir=base)
    out: dict[str, tuple[float, float]] = {}

    def run(name: str, op: Callable[[str], object]) -> None:
        c, w = _cpu(), time.perf_counter()
        for i in range(n):
            op(f"{root}/d{i}")
        out[name] = (1e6 * (_cpu() - c) / n, 1e6 * (time.perf_counter() - w) / n)

    def create(path: str) -> None:
        with open(path, "w") as f:
            f.write("123")

    def create_and_rename(d: str) -> None:
        create(f"{d}/exit.json.tmp")
        os.replace(f"{d}/exit.json.tmp", f"{d}/exit.json")

    try:
        run("mkdir", os.mkdir)
        run("create a file", lambda d: create(f"{d}/pid"))
        run("chmod (same mode)", lambda d: os.chmod(d, 0o711))
        run("create + rename", create_and_rename)  # what an exit cost before it was a line of the record
        run("exists (absent)", lambda d: os.path.exists(f"{d}/reported"))
        run("read", lambda d: open(f"{d}/pid").read())
        run("remove the directory", shutil.rmtree)
        work = Path(root) / "work"
        run("a task's 5 directories", lambda d: make_workspace(make_task_dir(work, f"j{os.path.basename(d)}", 1, 0),
                                                                 None))

        def task_files(d: str) -> None:
            task = work / "jobs" / f"j{os.path.basename(d)}" / "1" / "0"
            for stream in ("stdout", "stderr"):
                os.close(open_log(task, stream))
            append_record(task, "started", pid=1, at=0.0)
            append_record(task, "exited", code=0)  # as its keeper appends it: no file of its own
        run("its logs and record", task_files)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="*", default=[tempfile.gettempdir(), "/dev/shm"])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--after-removal", type=int, default=0, metavar="N")
    args = ap.parse_args()
    for d in args.dirs:
        if args.after_removal:
            churn = tempfile.mkdtemp(prefix="fsops-churn-", dir=d)
            for i in range(args.after_removal):
                open(f"{churn}/{i}", "w").close()
            shutil.rmtree(churn)
    for d in args.dirs:
        print(f"{d}: {describe_fs(os.path.realpath(d))}")
    print(f"| operation | {' | '.join(f'{d}: CPU / wall us' for d in args.dirs)} |")
    print(f"|---|{'---|' * len(args.dirs)}")
    results = [measure(d, args.n) for d in args.dirs]
    for op in results[0]:
        print(f"| {op} | " + " | ".join(f"{r[op][0]:.0f} / {r[op][1]:.0f}" for r in results) + " |")


if __name__ == "__main__":
    main()
