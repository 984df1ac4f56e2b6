"""Task directories on disk, made and read so that a task cannot steer the agent's reads or writes.

    <work_dir>/jobs/<job>/<attempt>/      0711, the agent's: traversable, not listable
      <task>/                            0711, the agent's
        stdout.log  stderr.log           0600, opened here and handed to the task's keeper as its stdout/stderr
        env.json                         0600, only for a task started without the keeper (its environment goes in
                                         the keeper's request): its own launcher reads and removes it
        record                           0600, the agent's: one JSON line per step, appended (``TaskRecord``);
                                         its keeper (or launcher) appends the last, how the task ended
        interrupted                      the agent's: its node stopped under the task (the reason)
        work/                            0700, the task's owner's: its cwd and HOME
          tmp/                           0700, its TMPDIR

The agent's steps, and the exit its keeper records, go in one file, appended to, not one file each: every new
file is an inode allocated, and on an ext4 without a journal, after many files were removed (within 60 s, 6 min
while their inode block is dirty), each allocation skips the freed inodes one buffer lookup at a time, 0.1-0.7 ms
of CPU a file. A task takes 8 inodes (5 directories, 2 logs, its record) where it took 9 (its exit was a file of
its own, written under a temporary name and renamed) and, before that, 12. A directory that an older agent or
keeper wrote (``pid``, ``started``, ... and ``exit.json``) reads the same.

A root agent runs each task as its owner, so a task can write under ``work/`` only: it can neither
replace its logs nor forge the agent's records. An agent that is not root runs tasks as itself, and
then a task can (nothing to switch to). Every read here opens each path component without following
links and reads regular files only, so a planted link, FIFO or device is refused, never followed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

JOB_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,80}$")
STREAMS = ("stdout", "stderr")
RECORD = "record"
AGENT_DIR_MODE = 0o711
TASK_DIR_MODE = 0o700
STATE_MAX = 4096
RECORD_MAX = 16384  # a record: four short steps and an exit whose reason is cut to 500 characters
READ_MAX = 16 << 20
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class LogNotFound(Exception):
    """No readable log there: absent, or not a plain file reached without links (the message says which)."""


class StateUnreadable(Exception):
    """A task record that is there but cannot be trusted: a link, not a regular file, too big, or garbled."""


@dataclass(frozen=True)
class ExitRecord:
    code: int | None
    signal: int | None
    reason: str = ""


def valid_job_id(job_id: str) -> bool:
    return bool(JOB_ID.match(job_id))


def _descend(fd: int, name: str, mode: int | None = None, owner: tuple[int, int] | None = None) -> int:
    """Open (after making it, when ``mode`` is given) directory ``name`` under ``fd``, which is closed."""
    try:
        if mode is not None:
            try:
                os.mkdir(name, mode, dir_fd=fd)
            except FileExistsError:
                pass
        sub = os.open(name, _DIR, dir_fd=fd)
    finally:
        os.close(fd)
    try:  # changed only where it differs: on ext4 each change is a journal write (six chmods a task before)
        st = os.fstat(sub)
        if owner is not None and (st.st_uid, st.st_gid) != owner:
            os.fchown(sub, *owner)
        if mode is not None and stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(sub, mode)
    except OSError:
        os.close(sub)
        raise
    return sub


def _walk(work_dir: Path, names: tuple[str, ...], mode: int | None = None) -> int:
    """A descriptor of ``work_dir/names...``, reached without following a link below ``work_dir``."""
    fd = os.open(work_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    for name in names:
        fd = _descend(fd, name, mode)
    return fd


def make_task_dir(work_dir: Path, job_id: str, attempt: int, task: int) -> Path:
    """Create ``jobs/<job>/<attempt>/<task>`` under ``work_dir``, the agent's, without following links.

    Raises ValueError for a job id that is not one (it never reaches the file system)."""
    if not valid_job_id(job_id) or attempt < 0 or task < 0:
        raise ValueError(f"not a task: job {job_id!r} attempt {attempt} task {task}")
    names = ("jobs", job_id, str(attempt), str(task))
    work_dir.mkdir(parents=True, exist_ok=True)
    os.close(_walk(work_dir, names, AGENT_DIR_MODE))
    return work_dir.joinpath(*names)


def make_workspace(task_dir: Path, owner: tuple[int, int] | None) -> Path:
    """The task's ``work/`` (and ``work/tmp``), owned by ``owner`` (uid, gid) or, if None, by the agent."""
    fd = _descend(os.open(task_dir, _DIR), "work", TASK_DIR_MODE, owner)
    os.close(_descend(fd, "tmp", TASK_DIR_MODE, owner))
    return task_dir / "work"


def open_log(task_dir: Path, stream: str) -> int:
    """The task's log for ``stream``, opened for appending (a file descriptor the caller closes)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(task_dir / f"{stream}.log", flags, 0o600)


def write_env(task_dir: Path, env: dict[str, str]) -> Path:
    path = task_dir / "env.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(json.dumps(env).encode())  # dumps, not dump: the C encoder (dump's chunks cost 8 % of an agent's CPU)
    return path


@dataclass(frozen=True)
class TaskRecord:
    """What the agent recorded of a task: started (with its pid, 0 if it never ran), its start report
    acknowledged, its exit report acknowledged (how it ended: ``read_exit``)."""
    started: bool = False
    pid: int = 0
    start_reported: bool = False
    reported: bool = False


def append_record(task_dir: Path, step: str, **fields: object) -> None:
    """Append one step to the task's record: one write of one line, begun with a newline so that a line cut
    short (a full disk, a power loss) ends there and is skipped. No link is followed, no FIFO waited on."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(task_dir / RECORD, flags, 0o600)
    try:
        os.write(fd, b"\n" + json.dumps({"step": step, **fields}).encode())
    finally:
        os.close(fd)


def has_record(task_dir: Path) -> bool:
    """The agent has started (or refused) this task: never start it again."""
    return (task_dir / RECORD).exists() or (task_dir / "started").exists()


def read_record(task_dir: Path) -> TaskRecord:
    """The task's record; a line that is not a step is skipped. A directory an agent before the record made
    (files ``pid``, ``started``, ``start_reported``, ``reported``) reads the same. Raises StateUnreadable."""
    steps = _steps(task_dir)
    if "started" not in steps:  # started by an older agent: its files, and the steps appended since
        old = _legacy_record(task_dir)
        return TaskRecord(old.started, old.pid, old.start_reported or "start_reported" in steps,
                          old.reported or "reported" in steps)
    pid = steps["started"].get("pid")
    return TaskRecord(True, pid if type(pid) is int and pid > 0 else 0, "start_reported" in steps, "reported" in steps)


def _steps(task_dir: Path) -> dict[str, dict]:
    """The first line of each step in the task's record."""
    steps: dict[str, dict] = {}
    for line in (read_state(task_dir, RECORD, RECORD_MAX) or "").splitlines():
        with contextlib.suppress(ValueError):
            step = json.loads(line)
            if isinstance(step, dict) and isinstance(step.get("step"), str):
                steps.setdefault(step["step"], step)
    return steps


def _legacy_record(task_dir: Path) -> TaskRecord:
    try:
        text = (read_state(task_dir, "pid") or "").strip()
    except StateUnreadable:
        text = ""
    return TaskRecord((task_dir / "started").exists(), int(text) if text.isascii() and text.isdigit() else 0,
                      (task_dir / "start_reported").exists(), (task_dir / "reported").exists())


def _read_regular(fd: int, limit: int, offset: int = 0) -> bytes | None:
    """At most ``limit`` bytes from ``offset``; None if ``fd`` is no regular file (a FIFO, a device)."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        return None
    return os.pread(fd, limit, offset)


def _whole_chars(data: bytes) -> bytes:
    """``data`` less a UTF-8 character cut at its end, which the next read then starts with (not two U+FFFD)."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b < 0x80:
            return data
        if b >= 0xC0:  # the lead byte of the last character: it needs this many bytes
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return data if back >= need else data[:-back] or data  # (a read shorter than one character: as is)
    return data  # not UTF-8 there: as it is


def read_state(task_dir: Path, name: str, limit: int = STATE_MAX) -> str | None:
    """A small file in a task directory (``record``, an older keeper's ``exit.json``); None when there is none.

    Raises StateUnreadable for a link, anything but a regular file, more than ``limit`` bytes or no UTF-8."""
    try:
        fd = os.open(task_dir / name, _FILE)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StateUnreadable(f"{name}: {e.strerror}") from None
    try:
        data = _read_regular(fd, limit + 1)
    finally:
        os.close(fd)
    if data is None:
        raise StateUnreadable(f"{name} is not a regular file")
    if len(data) > limit:
        raise StateUnreadable(f"{name} is over {limit} bytes")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise StateUnreadable(f"{name} is not UTF-8 text") from None


def read_exit(task_dir: Path) -> ExitRecord | None:
    """How the task ended, as its keeper (or launcher) recorded it: the ``exited`` step of its record, or the
    ``exit.json`` an older keeper wrote; None if it recorded nothing. Raises StateUnreadable."""
    steps = _steps(task_dir)
    if "exited" in steps:
        return _exit(steps["exited"], "record: exited")
    text = read_state(task_dir, "exit.json")
    if text is None:
        return None
    try:
        d = json.loads(text)
    except ValueError:
        raise StateUnreadable("exit.json is not JSON") from None
    return _exit(d, "exit.json")


def _exit(d: object, where: str) -> ExitRecord:
    if not isinstance(d, dict):
        raise StateUnreadable(f"{where} is not an object")
    code, sig, reason = d.get("code"), d.get("signal"), d.get("reason", "")
    if not all(v is None or type(v) is int for v in (code, sig)) or not isinstance(reason, str):
        raise StateUnreadable(f"{where}: code and signal must be integers, reason a string")
    return ExitRecord(code, sig, reason[:1000])


def read_task_log(work_dir: Path, job_id: str, attempt: int | None, task: int, stream: str, offset: int,
                  limit: int, tail: bool = False) -> dict:
    """Up to ``limit`` bytes of a task's ``stream`` ("stdout" or "stderr") from ``offset``, or its last ``limit``
    bytes (``tail``). A full read ends on a whole UTF-8 character: ``next_offset`` is where the next one starts.

    ``attempt`` None means the latest attempt that ran here. Every directory under ``work_dir`` is opened
    without following links, and the log must be a regular file: a planted link, FIFO or device, or a job id
    that is not one, raises LogNotFound (never reads elsewhere, never blocks). Returns
    {task, attempt, stream, offset, next_offset, data}, data decoded as UTF-8 with replacement characters.
    """
    if not valid_job_id(job_id):
        raise LogNotFound(f"no job {job_id[:100]!r}: not a job id")
    if stream not in STREAMS or task < 0 or offset < 0 or limit < 1 or (attempt is not None and attempt < 0):
        raise LogNotFound(f"no {stream!r} log of task {task} of job {job_id} (attempt {attempt}) at offset {offset}")
    if attempt is None:
        try:
            fd = _walk(work_dir, ("jobs", job_id))
        except OSError:
            raise LogNotFound(f"no task of job {job_id} ran") from None
        try:
            attempts = [int(n) for n in os.listdir(fd) if n.isascii() and n.isdigit()]
        finally:
            os.close(fd)
        if not attempts:
            raise LogNotFound(f"no task of job {job_id} ran")
        attempt = max(attempts)
    what = f"{stream} for task {task} of job {job_id} (attempt {attempt})"
    try:
        fd = _walk(work_dir, ("jobs", job_id, str(attempt), str(task)))
        try:
            log_fd = os.open(f"{stream}.log", _FILE, dir_fd=fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise LogNotFound(f"no {what}" + ("" if isinstance(e, FileNotFoundError) else f": {e.strerror}")) from None
    limit = min(limit, READ_MAX)
    try:
        if tail and stat.S_ISREG((st := os.fstat(log_fd)).st_mode):
            offset = max(0, st.st_size - limit)
        data = _read_regular(log_fd, limit, offset)
    finally:
        os.close(log_fd)
    if data is None:
        raise LogNotFound(f"no {what}: not a regular file")
    if len(data) == limit:
        data = _whole_chars(data)
    return {"task": task, "attempt": attempt, "stream": stream, "offset": offset, "next_offset": offset + len(data),
            "data": data.decode(errors="replace")}


def untraversable(path: Path) -> Path | None:
    """The first directory from / to ``path`` that other users cannot enter (tasks then cannot reach HOME by path)."""
    for p in (*reversed(path.resolve().parents), path.resolve()):
        try:
            if not os.stat(p).st_mode & stat.S_IXOTH:
                return p
        except OSError:
            return p
    return None
