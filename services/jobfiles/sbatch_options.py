"""#SBATCH directives read as sbatch reads them: which lines, how they split, which options take a value.

sbatch (src/sbatch/opt.c) reads lines that begin with "#SBATCH" until the first line that is neither blank
nor a comment; splits each on whitespace, honouring quotes and backslashes, an unquoted '#' ending the
line; joins every line into one argv and parses it with getopt_long, so short options take their value
attached (-N2) or as the next word (-N 2), long ones after '=' or as the next word, and a long option may be
abbreviated to any unambiguous prefix.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from services.jobfiles.common import JobFileError

REQUIRED, NONE, OPTIONAL = "required", "none", "optional"

# long name -> (short letter, argument); every sbatch option of Slurm 24.11 and the aliases it still takes
OPTIONS: dict[str, tuple[str, str]] = {
    "account": ("A", REQUIRED), "acctg-freq": ("", REQUIRED), "array": ("a", REQUIRED), "batch": ("", REQUIRED),
    "bb": ("", REQUIRED), "bbf": ("", REQUIRED), "begin": ("b", REQUIRED), "chdir": ("D", REQUIRED),
    "workdir": ("", REQUIRED), "cluster-constraint": ("", REQUIRED), "clusters": ("M", REQUIRED),
    "cluster": ("", REQUIRED), "comment": ("", REQUIRED), "constraint": ("C", REQUIRED), "container": ("", REQUIRED),
    "container-id": ("", REQUIRED), "contiguous": ("", NONE), "core-spec": ("S", REQUIRED),
    "cores-per-socket": ("", REQUIRED), "cpu-freq": ("", REQUIRED), "cpus-per-gpu": ("", REQUIRED),
    "cpus-per-task": ("c", REQUIRED), "deadline": ("", REQUIRED), "delay-boot": ("", REQUIRED),
    "dependency": ("d", REQUIRED), "distribution": ("m", REQUIRED), "error": ("e", REQUIRED),
    "exclude": ("x", REQUIRED), "exclusive": ("", OPTIONAL), "export": ("", REQUIRED), "export-file": ("", REQUIRED),
    "extra": ("", REQUIRED), "extra-node-info": ("B", REQUIRED), "get-user-env": ("", OPTIONAL),
    "gid": ("", REQUIRED), "gpu-bind": ("", REQUIRED), "gpu-freq": ("", REQUIRED), "gpus": ("G", REQUIRED),
    "gpus-per-node": ("", REQUIRED), "gpus-per-socket": ("", REQUIRED), "gpus-per-task": ("", REQUIRED),
    "gres": ("", REQUIRED), "gres-flags": ("", REQUIRED), "help": ("h", NONE), "hint": ("", REQUIRED),
    "hold": ("H", NONE), "ignore-pbs": ("", NONE), "immediate": ("I", NONE), "input": ("i", REQUIRED),
    "job-name": ("J", REQUIRED), "kill-on-invalid-dep": ("", REQUIRED), "licenses": ("L", REQUIRED),
    "mail-type": ("", REQUIRED), "mail-user": ("", REQUIRED), "mcs-label": ("", REQUIRED), "mem": ("", REQUIRED),
    "mem-bind": ("", REQUIRED), "mem_bind": ("", REQUIRED), "mem-per-cpu": ("", REQUIRED),
    "mem-per-gpu": ("", REQUIRED), "mincpus": ("", REQUIRED), "network": ("", REQUIRED), "nice": ("", OPTIONAL),
    "no-kill": ("k", OPTIONAL), "no-requeue": ("", NONE), "nodefile": ("F", REQUIRED), "nodelist": ("w", REQUIRED),
    "nodes": ("N", REQUIRED), "ntasks": ("n", REQUIRED), "tasks": ("", REQUIRED), "ntasks-per-core": ("", REQUIRED),
    "ntasks-per-gpu": ("", REQUIRED), "ntasks-per-node": ("", REQUIRED), "tasks-per-node": ("", REQUIRED),
    "ntasks-per-socket": ("", REQUIRED), "open-mode": ("", REQUIRED), "output": ("o", REQUIRED),
    "overcommit": ("O", NONE), "oversubscribe": ("s", NONE), "share": ("", NONE), "parsable": ("", OPTIONAL),
    "partition": ("p", REQUIRED), "power": ("", REQUIRED), "prefer": ("", REQUIRED), "priority": ("", REQUIRED),
    "profile": ("", REQUIRED), "propagate": ("", OPTIONAL), "qos": ("q", REQUIRED), "quiet": ("Q", NONE),
    "reboot": ("", NONE), "requeue": ("", NONE), "reservation": ("", REQUIRED), "resv-ports": ("", OPTIONAL),
    "segment": ("", REQUIRED), "signal": ("", REQUIRED), "sockets-per-node": ("", REQUIRED),
    "spread-job": ("", NONE), "switches": ("", REQUIRED), "test-only": ("", NONE), "thread-spec": ("", REQUIRED),
    "threads-per-core": ("", REQUIRED), "time": ("t", REQUIRED), "time-min": ("", REQUIRED), "tmp": ("", REQUIRED),
    "tres-bind": ("", REQUIRED), "tres-per-task": ("", REQUIRED), "uid": ("", REQUIRED), "usage": ("u", NONE),
    "use-min-nodes": ("", NONE), "verbose": ("v", NONE), "version": ("V", NONE), "wait": ("W", NONE),
    "wait-all-nodes": ("", REQUIRED), "wckey": ("", REQUIRED), "wrap": ("", REQUIRED), "x11": ("", OPTIONAL),
}
ALIASES = {"workdir": "chdir", "cluster": "clusters", "tasks": "ntasks", "tasks-per-node": "ntasks-per-node",
           "mem_bind": "mem-bind", "share": "oversubscribe"}
SHORT = {short: long for long, (short, _) in OPTIONS.items() if short}


@dataclass(frozen=True)
class Directive:
    """One option as sbatch read it: its canonical long name, its value (None for a flag), how it was written."""

    name: str
    value: str | None
    written: str  # "-p admin", "--time=4320": what a message quotes
    line: int
    known: bool = True


@dataclass(frozen=True)
class Script:
    directives: tuple[Directive, ...]
    ignored: tuple[int, ...]  # lines of #SBATCH after the first command: sbatch ignores them
    shebang: str | None


def _lines(text: str) -> tuple[list[tuple[int, str]], list[int]]:
    """The text after "#SBATCH" of each directive line sbatch reads, and the directive lines it ignores (after
    the first command). "##SBATCH" and " #SBATCH" are comments."""
    read: list[tuple[int, str]] = []
    ignored: list[int] = []
    done = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("#SBATCH"):
            if done:
                ignored.append(n)
            else:
                read.append((n, line[len("#SBATCH"):]))
        elif (stripped := line.strip()) and not stripped.startswith("#"):
            done = True
    return read, ignored


def _split(n: int, rest: str) -> list[str]:
    lexer = shlex.shlex(rest, posix=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    try:
        return list(lexer)
    except ValueError as e:  # sbatch: "Unmatched ` in [...]"
        raise JobFileError(f"#SBATCH line {n}: {e} in {rest.strip()!r}: close the quote") from None


def _long(name: str) -> str | None:
    """getopt_long: an exact name, or the only option that starts with it."""
    if name in OPTIONS:
        return ALIASES.get(name, name)
    hits = {ALIASES.get(o, o) for o in OPTIONS if o.startswith(name)}
    if len(hits) > 1:
        raise JobFileError(f"#SBATCH --{name} is ambiguous ({', '.join('--' + h for h in sorted(hits))}): "
                           "write the option in full")
    return hits.pop() if hits else None


def parse(text: str) -> Script:
    read, ignored = _lines(text)
    words = [(n, w) for n, rest in read for w in _split(n, rest)]
    out: list[Directive] = []
    i = 0
    while i < len(words):
        n, word = words[i]
        i += 1
        if word.startswith("--") and len(word) > 2:
            key, eq, value = word[2:].partition("=")
            name = _long(key)
            if name is None:  # a site's plugin option (SPANK) or a typo: its value may be the next word
                written = word
                if not eq and i < len(words) and words[i][0] == n and not words[i][1].startswith("-"):
                    value, eq = words[i][1], "="
                    written = f"{word} {value}"
                    i += 1
                out.append(Directive(key, value if eq else None, written, n, known=False))
                continue
            arg = OPTIONS[name][1]
            if eq and arg == NONE:
                raise JobFileError(f"#SBATCH {word}: --{name} takes no value: write --{name}")
            if not eq and arg == REQUIRED:
                if i >= len(words):
                    raise JobFileError(f"#SBATCH {word} needs a value: write --{name}=VALUE")
                value = words[i][1]
                i += 1
                out.append(Directive(name, value, f"{word} {value}", n))
                continue
            out.append(Directive(name, value if eq else None, word, n))
        elif word.startswith("-") and len(word) > 1:
            j = 1
            while j < len(word):
                letter = word[j]
                name = SHORT.get(letter)
                if name is None:
                    raise JobFileError(f"#SBATCH line {n}: -{letter} is no sbatch option (in {word!r})")
                name = ALIASES.get(name, name)
                if OPTIONS[name][1] == REQUIRED:
                    value = word[j + 1:]
                    if not value:
                        if i >= len(words):
                            raise JobFileError(f"#SBATCH {word} needs a value: write -{letter} VALUE")
                        value = words[i][1]
                        i += 1
                        out.append(Directive(name, value, f"-{letter} {value}", n))
                    else:
                        out.append(Directive(name, value, f"-{letter}{value}", n))
                    break
                out.append(Directive(name, None, f"-{letter}", n))
                j += 1
        else:
            raise JobFileError(f"#SBATCH line {n}: {word!r} is no option (a value with spaces needs quotes, "
                               "e.g. --job-name=\"my job\"; a comment starts with #)")
    first = text.splitlines()[0] if text else ""
    return Script(tuple(out), tuple(ignored), first[2:].strip() if first.startswith("#!") else None)


# --- values ----------------------------------------------------------------------------------


def slurm_time(value: str, written: str) -> int | None:
    """--time in seconds: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS; UNLIMITED, INFINITE or 0: None."""
    v = value.strip()
    if v.upper() in ("UNLIMITED", "INFINITE", "-1"):
        return None
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", v)
    if not m:
        raise JobFileError(f"#SBATCH {written}: write the time as minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, "
                           "D-HH:MM:SS or UNLIMITED")
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:
        seconds = a * 3600 + b * 60 + c
    elif b is not None:
        seconds = a * 60 + b
    else:
        seconds = a * 60
    return seconds or None  # Slurm: a limit of 0 means none


def slurm_mem_mib(value: str, written: str) -> int:
    """--mem and friends: a number with K, M (default), G or T; 0 is "all of the node's memory"."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KkMmGgTt]?)(?:[iI]?[bB])?\s*", value)
    if not m:
        raise JobFileError(f"#SBATCH {written}: write a size like 64G, 512M or 4000 (MB)")
    scale = {"k": 1 / 1024, "": 1, "m": 1, "g": 1024, "t": 1024 * 1024}[m.group(2).lower()]
    return int(-(-float(m.group(1)) * scale // 1))


def count(value: str, written: str, low: int = 0) -> int:
    try:
        n = int(value)
    except ValueError:
        raise JobFileError(f"#SBATCH {written}: {value!r} is not a whole number") from None
    if n < low:
        raise JobFileError(f"#SBATCH {written}: at least {low}")
    return n


@dataclass(frozen=True)
class ArraySpec:
    """--array=0-15:4%2: the indices and how many may run at once (None: no limit)."""

    indices: tuple[int, ...]
    max_running: int | None = None


MAX_ARRAY = 10_000  # elements of one array, as POST /v1/jobs takes it


def parse_array(value: str, written: str) -> ArraySpec:
    """Slurm's index list: ranges, steps and a %N limit; at most MAX_ARRAY distinct indices (counted before they
    are listed: 0-999999999 is refused, not built)."""
    spec, _, limit = value.partition("%")
    indices: list[int] = []
    try:
        for part in spec.split(","):
            rng, _, step = part.partition(":")
            lo, _, hi = rng.partition("-")
            r = range(int(lo), int(hi or lo) + 1, int(step or 1))
            if len(indices) + len(r) > MAX_ARRAY:
                raise JobFileError(f"#SBATCH {written}: more than {MAX_ARRAY} jobs in one array: split it")
            indices += r
        running = int(limit) if limit else None
    except JobFileError:
        raise
    except ValueError:
        raise JobFileError(f"#SBATCH {written}: write indices like 0-15, 1,3,5-7, 0-15:4 or 1-100%10") from None
    if not indices or (running is not None and running < 1):
        raise JobFileError(f"#SBATCH {written}: at least one index, and at least 1 running at a time (%N)")
    return ArraySpec(tuple(sorted(set(indices))), running)


@dataclass(frozen=True)
class Dependency:
    """One condition of --dependency: afterok:123:456 -> ("afterok", ("123", "456"))."""

    kind: str
    jobs: tuple[str, ...] = ()


def parse_dependency(value: str, written: str) -> tuple[tuple[Dependency, ...], bool]:
    """The conditions, and whether any one suffices ('?') rather than all (',')."""
    any_of = "?" in value
    out = []
    for part in re.split(r"[,?]", value):
        kind, *jobs = part.split(":")
        if kind not in ("after", "afterany", "afterburstbuffer", "aftercorr", "afternotok", "afterok", "singleton",
                        "expand"):
            raise JobFileError(f"#SBATCH {written}: {kind!r} is no dependency type (afterok:JOBID, afterany:JOBID, ...)")
        out.append(Dependency(kind, tuple(jobs)))
    return tuple(out), any_of
