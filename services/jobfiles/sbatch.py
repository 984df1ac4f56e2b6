"""An sbatch script -> the job POST /v1/jobs takes, meaning what Slurm means (README: "Coming from Slurm").

Slurm tasks are gpuorch tasks: every task runs the script. Per-node amounts (--gres, --gpus-per-node, --mem)
are split across that node's tasks, per-job ones (--gpus) across all tasks, and --nodes=N puts the same number
of tasks on each of N distinct nodes (JobSpec.tasks_per_node). What gpuorch cannot do as Slurm would, and
that changes what runs, is refused naming the directive and what to write instead; the rest is a warning.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass
from typing import Any

from services.jobfiles import gpus
from services.jobfiles.common import (
    Context, JobFileError, Notes, Translated, job_name, priority_of, queue_path, whole_gpus,
)
from services.jobfiles.sbatch_options import (
    Directive, count, parse, parse_array, parse_dependency, slurm_mem_mib, slurm_time,
)

SHELLS = {"sh", "bash", "zsh", "ksh", "dash", "mksh", "ash", "fish"}
MAX_REQUEUE = 5  # Slurm's MaxBatchRequeue default: how often a --requeue job may be requeued

REFUSED = {  # directive -> why, and what to write instead
    "nodelist": "gpuorch places jobs on nodes by what they offer, not by name: drop it, or ask for the GPU model "
                "with --constraint or --gres=gpu:TYPE:N",
    "nodefile": "gpuorch places jobs on nodes by what they offer, not by name: drop it",
    "exclude": "gpuorch does not yet leave out nodes by name (sick nodes are drained for you): drop it",
    "uid": "tasks run as the submitting user: drop it",
    "gid": "tasks run as the submitting user's groups: drop it",
    "container": "gpuorch runs tasks in the node's own environment, not in OCI bundles: drop it and start the "
                 "container in the script",
    "wrap": "a script has its commands in its body: drop --wrap",
    "input": "write the redirection in the script (python train.py < FILE)",
    "gpus-per-socket": "write the GPUs per node with --gpus-per-node or --gres=gpu:N",
    "ntasks-per-gpu": "write the tasks with --ntasks-per-node and the GPUs per task with --gpus-per-task",
    "export-file": "set the variables in the script, or with gpuorch submit -e NAME=VALUE",
}
IGNORED = {  # directive -> what gpuorch does instead (a warning)
    "exclusive": "gpuorch gives each task its own GPUs; the rest of the node may hold other jobs",
    "begin": "the job may start at once",
    "deadline": "the job is not removed at a deadline",
    "signal": "at preemption a task gets SIGTERM, then SIGKILL after the grace period",
    "nice": "use --qos for priority",
    "priority": "use --qos for priority",
    "reservation": "gpuorch has no reservations: the job may run on any node that fits",
    "licenses": "gpuorch does not count licenses",
    "time-min": "the job gets its --time",
    "mincpus": "ask for CPUs per task with --cpus-per-task",
    "get-user-env": "tasks start with the job's environment only",
    "test-only": "use gpuorch submit --dry-run",
    "clusters": "the job runs on this cluster",
    "prefer": "a preference is not a requirement here",
    "tmp": "gpuorch does not reserve local disk",
    "bb": "burst buffers are not staged", "bbf": "burst buffers are not staged",
}
SILENT = {"comment", "wckey", "mail-type", "mail-user", "job-name", "parsable", "quiet", "verbose", "open-mode",
          "acctg-freq", "profile", "ignore-pbs", "kill-on-invalid-dep", "no-kill", "propagate", "mcs-label",
          "help", "usage", "version", "batch"}  # no effect on what runs or where (mail: gpuorch sends none)


@dataclass
class _Gpus:
    count: int
    kind: str  # "node", "task" or "job"
    type: str | None
    written: str


def _gpu_count(d: Directive, value: str, kind: str) -> _Gpus:
    """[type:]count, as --gpus, --gpus-per-node and --gpus-per-task take it."""
    if "," in value:
        raise JobFileError(f"#SBATCH {d.written}: one GPU type per job here: ask for one type")
    type_, _, n = value.rpartition(":")
    return _Gpus(count(n, d.written), kind, type_ or None, d.written)


def _gres(d: Directive, notes: Notes) -> _Gpus | None:
    """--gres=gpu[:type][:count][,other...]: the GPUs per node; other generic resources are warned about."""
    found = None
    for item in (d.value or "").split(","):
        name, *rest = item.split(":")
        name = name.removeprefix("gres/")
        if name in ("none", ""):
            continue
        if name in ("shard", "mps"):
            raise JobFileError(f"#SBATCH {d.written}: GPU sharing by {name} is written here as a fraction of a GPU "
                               "per task: write --gpus-per-task=1 and submit with gpuorch submit -g 0.5")
        if name != "gpu":
            notes.add(f"#SBATCH {d.written}: generic resource {name!r} is not counted here: ignored")
            continue
        if found is not None:
            raise JobFileError(f"#SBATCH {d.written}: one GPU type per job here: ask for one type")
        n = "1"
        if rest and re.fullmatch(r"\d+", rest[-1]):
            n = rest.pop()
        found = _Gpus(count(n, d.written), "node", ":".join(rest) or None, d.written)
    return found


def _constraint(d: Directive, known: tuple[str, ...], notes: Notes) -> tuple[tuple[str, ...], str | None]:
    """--constraint: GPU models (a100|h100, v100&32gb), a GPU family (volta: a minimum compute capability);
    other node features are warned about."""
    value = d.value or ""
    terms = [t for t in re.split(r"[|&,\[\]()]", re.sub(r"\*\d+", "", value)) if t.strip()]
    models: list[set[str]] = []
    cc = None
    for term in terms:
        t = term.strip()
        found = set(gpus.models_for(t, known))
        if found:
            models.append(found)
        elif t.lower() in gpus.FAMILY_CC:
            cc = gpus.FAMILY_CC[t.lower()]
        else:
            notes.add(f"#SBATCH {d.written}: node feature {t!r} is no GPU model: ignored (gpuorch matches node "
                      "labels with node_selector in a job YAML)")
    if not models:
        return (), cc
    if "&" in value and "|" not in value:
        chosen = set.intersection(*models)
        if not chosen:
            raise JobFileError(f"#SBATCH {d.written}: no GPU model is all of {value!r}: write one, e.g. "
                               f"--constraint={terms[0].strip()}")
    else:
        chosen = set.union(*models)
    return tuple(m for m in dict.fromkeys((*gpus.CATALOGUE, *known)) if m in chosen), cc


def _command(text: str, shebang: str | None, filename: str, notes: Notes) -> list[str]:
    """The script itself, run by the interpreter its #! line names (sbatch runs it as a file the same way)."""
    argv = shlex.split(shebang) if shebang else []
    if not argv:
        notes.add("the script has no #! line (sbatch refuses such a script): it runs with bash")
        argv = ["bash"]
    prog = argv[0]
    if posixpath.basename(prog) == "env":
        rest = [a for a in argv[1:] if not a.startswith("-")]
        prog = rest[0] if rest else prog
    base = posixpath.basename(prog)
    if base in SHELLS:
        return [*argv, "-c", text, filename]
    if base.startswith("python"):
        return [*argv, "-c", text]
    if base in ("perl", "ruby"):
        return [*argv, "-e", text]
    raise JobFileError(f"#!{shebang}: gpuorch runs sbatch scripts with a shell (sh, bash, ...), python, perl or "
                       "ruby: start the script with #!/bin/bash")


DEPENDS = ("afterok", "afternotok", "afterany")
JOB_REF = re.compile(r"^[a-z0-9][a-z0-9-]{0,80}$")  # shared.model.JOB_ID


def array_request(value: str, written: str) -> dict[str, Any]:
    """--array=0-9%2 as the request's ``array`` (also gpuorch submit --array)."""
    a = parse_array(value, written)
    return {"indices": list(a.indices), "max_running": a.max_running}


def dependency_request(value: str, written: str) -> dict[str, Any]:
    """--dependency as the request's ``dependencies`` and ``singleton`` (also gpuorch submit --dependency). The ids
    are gpuorch job or array ids (an array element, Slurm's 123_4, is 123-4 here); the API refuses one that names
    no job here."""
    deps, any_of = parse_dependency(value, written)
    if any_of and len(deps) > 1:
        raise JobFileError(f"#SBATCH {written}: gpuorch waits for all dependencies, not any one ('?'): "
                           "write them with ',' or submit one job per alternative")
    out: dict[str, Any] = {"dependencies": []}
    for dep in deps:
        if dep.kind == "singleton":
            out["singleton"] = True
            continue
        kind = dep.kind
        if kind not in DEPENDS:
            raise JobFileError(f"#SBATCH {written}: {kind} is not supported; gpuorch waits for afterok, afternotok, "
                               "afterany or singleton")
        if not dep.jobs:
            raise JobFileError(f"#SBATCH {written}: {kind} names no job: write {kind}:JOBID")
        for ref in dep.jobs:
            job_id = ref.replace("_", "-")
            if not JOB_REF.match(job_id):
                raise JobFileError(f"#SBATCH {written}: {ref!r} is no gpuorch job id (e.g. j-0190...; an element "
                                   "of an array: ARRAYID-INDEX)")
            out["dependencies"].append({"kind": kind, "job": job_id})
    return out


def _last(ds: list[Directive]) -> dict[str, Directive]:
    """sbatch's getopt: a later directive overrides an earlier one of the same option."""
    out: dict[str, Directive] = {}
    for d in ds:
        out[d.name] = d
    return out


def from_sbatch(text: str, filename: str = "sbatch", ctx: Context = Context()) -> Translated:
    script = parse(text)
    notes = Notes()
    for line in script.ignored:
        notes.add(f"line {line}: #SBATCH after the first command is ignored, as sbatch ignores it")
    known = tuple(d for d in script.directives if d.known)
    for d in script.directives:
        if not d.known:
            if d.name.startswith("container"):  # pyxis: --container-image and friends
                raise JobFileError(f"#SBATCH {d.written}: gpuorch runs tasks in the node's own environment, no "
                                   "container images yet: drop it and run the container in the script")
            notes.add(f"#SBATCH {d.written}: not an sbatch option (a site plugin's?): ignored")
    opt = _last(list(known))

    # 1. what gpuorch will not run as written
    for name, why in REFUSED.items():
        if name in opt:
            raise JobFileError(f"#SBATCH {opt[name].written}: {why}")
    ignored_plain = []
    for name, d in opt.items():
        if name in IGNORED:
            notes.add(f"#SBATCH {d.written}: ignored ({IGNORED[name]})")
        elif name not in HANDLED and name not in SILENT:
            ignored_plain.append(d.written)
    if ignored_plain:
        notes.add(f"#SBATCH {', '.join(ignored_plain)}: no effect here, ignored")

    job: dict[str, Any] = {}
    if "array" in opt:
        job["array"] = array_request(opt["array"].value or "", opt["array"].written)
    if "dependency" in opt:
        job.update(dependency_request(opt["dependency"].value or "", opt["dependency"].written))
    if "hold" in opt:
        job["hold"] = True  # as sbatch -H: submitted held, until gpuorch release (scontrol release)

    # 2. name, queue, priority, time, retries
    raw_name = opt["job-name"].value if "job-name" in opt else filename
    job["name"], note = job_name(raw_name or filename, "sbatch")
    notes.add(note if "job-name" in opt else None)
    models_from: list[tuple[tuple[str, ...], str]] = []
    queue = None
    if "partition" in opt:
        d = opt["partition"]
        names = [p for p in (d.value or "").split(",") if p]
        if len(names) > 1:
            notes.add(f"#SBATCH {d.written}: several partitions; the first one, {names[0]}, decides")
        mapped = ctx.site.partitions.get(names[0]) if names else None
        if mapped is not None:
            if mapped.models:
                models_from.append((tuple(mapped.models), d.written))
            queue = (mapped.queue, d.written) if mapped.queue else None
        elif names and "account" not in opt:
            queue = (names[0], d.written)
        elif names:
            notes.add(f"#SBATCH {d.written}: the queue comes from --account; the partition is not mapped here "
                      "(GPUORCH_JOBFILE_MAP): ignored")
    if "account" in opt:
        queue = (opt["account"].value or "", opt["account"].written)
    if queue is not None:
        try:
            job["queue"], note = queue_path(queue[0], ctx, f"#SBATCH {queue[1]}")
            notes.add(note)
        except JobFileError as e:
            notes.add(f"{e}; ignored: the job goes to the default queue (gpuorch submit -q QUEUE)")
    if "qos" in opt:
        job["priority"], note = priority_of(opt["qos"].value or "", ctx.site.qos, f"#SBATCH {opt['qos'].written}: QOS")
        notes.add(note)
    if "time" in opt:
        limit = slurm_time(opt["time"].value or "", opt["time"].written)
        if limit is not None:
            job["time_limit_s"] = limit
    if "requeue" in opt and "no-requeue" not in opt:
        job["max_retries"] = MAX_REQUEUE
        notes.add(f"#SBATCH --requeue: requeued up to {MAX_REQUEUE} times when its node is lost (Slurm's "
                  "MaxBatchRequeue); a task that fails is not rerun")
    elif "no-requeue" in opt:
        job["max_retries"] = 0

    # 3. tasks, nodes, GPUs per task
    shape = _shape(opt, notes)
    job["tasks"] = shape.tasks
    if shape.nodes == 1:
        job["topology"] = "node"
    elif shape.nodes:
        job["tasks_per_node"] = shape.per_node
    resources: dict[str, Any] = {"gpus": shape.gpus}
    gpu: dict[str, Any] = {}
    if shape.type:
        mig = gpus.mig_profile(shape.type)
        if mig:
            if shape.gpus != 1:
                raise JobFileError(f"#SBATCH {shape.written}: a MIG slice per task here ({mig}): ask for 1 per task")
            gpu["mig"] = mig
        else:
            found = gpus.models_for(shape.type, ctx.models)
            if not found:
                found = (shape.type.upper(),)
                notes.add(f"#SBATCH {shape.written}: GPU type {shape.type!r} is no GPU model known here: asked as "
                          f"model {found[0]}")
            models_from.append((found, shape.written))
    if "constraint" in opt:
        found, cc = _constraint(opt["constraint"], ctx.models, notes)
        if found:
            models_from.append((found, opt["constraint"].written))
        if cc:
            gpu["min_compute_capability"] = cc
    if models_from:
        allowed = set(models_from[0][0]).intersection(*(set(m) for m, _ in models_from[1:]))
        if not allowed:
            said = " and ".join(f"#SBATCH {w}" for _, w in models_from)
            raise JobFileError(f"{said} allow no GPU model together: keep one of them")
        gpu["models"] = [m for m in models_from[0][0] if m in allowed]
    if (gpu.get("models") or gpu.get("min_compute_capability")) and not shape.gpus:
        notes.add("a GPU model is asked for but no GPU: the job runs on CPUs, the model is ignored")
        gpu = {}
    if gpu:
        job["gpu"] = gpu

    # 4. CPU and memory per task
    cpus = None
    if "cpus-per-task" in opt and "cpus-per-gpu" in opt:
        raise JobFileError("#SBATCH --cpus-per-task and --cpus-per-gpu: Slurm takes one of them: keep one")
    if "cpus-per-task" in opt:
        cpus = count(opt["cpus-per-task"].value or "", opt["cpus-per-task"].written, 1)
    elif "cpus-per-gpu" in opt:
        per_gpu = count(opt["cpus-per-gpu"].value or "", opt["cpus-per-gpu"].written, 1)
        cpus = per_gpu * max(1, int(shape.gpus))
    if "tres-per-task" in opt:
        for item in (opt["tres-per-task"].value or "").split(","):
            if item.startswith("cpu"):
                cpus = count(item.split(":")[-1].split("=")[-1], opt["tres-per-task"].written, 1)
    if cpus:
        resources["cpu_milli"] = cpus * 1000
    mems = [n for n in ("mem", "mem-per-cpu", "mem-per-gpu") if n in opt]
    if len(mems) > 1:
        raise JobFileError(f"#SBATCH {', '.join('--' + m for m in mems)}: Slurm takes one of them: keep one")
    if mems:
        d = opt[mems[0]]
        mib = slurm_mem_mib(d.value or "", d.written)
        if mems[0] == "mem":
            if mib == 0:
                notes.add(f"#SBATCH {d.written}: all of the node's memory is not reserved here; ask for a size")
            else:
                per_node = shape.per_node or shape.tasks
                resources["memory_mib"] = -(-mib // per_node)
                if per_node > 1:
                    notes.add(f"#SBATCH {d.written} is per node: {resources['memory_mib']} MiB for each of its "
                              f"{per_node} tasks")
        elif mems[0] == "mem-per-cpu":
            resources["memory_mib"] = mib * (cpus or 1)
        else:
            resources["memory_mib"] = mib * max(1, int(shape.gpus))
    job["resources"] = resources

    # 5. what runs: the script, where
    command = _command(text, script.shebang, filename, notes)
    if "chdir" in opt:
        where = opt["chdir"].value or ""
        if not where.startswith("/"):
            raise JobFileError(f"#SBATCH {opt['chdir'].written}: a relative directory is relative to where sbatch "
                               "ran, which gpuorch does not know: write an absolute path")
        command = ["/bin/sh", "-c", 'cd "$1" || exit 1; shift; exec "$@"', "chdir", where, *command]
    else:
        notes.add("sbatch runs the script in the directory it was submitted from; here it runs in the task's own "
                  "directory: add #SBATCH --chdir=/absolute/path, or cd in the script")
    job["command"] = command
    env = _export(opt.get("export"), ctx, notes)
    if env:
        job["env"] = env
    if shape.tasks > 1:
        notes.add(f"every one of the {shape.tasks} tasks runs the script (sbatch runs it once, and srun starts the "
                  "tasks): RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR tell them apart")
    if re.search(r"^\s*srun\b", text, re.MULTILINE):
        notes.add("the script's srun lines run their program once in each task, where the task is (gpuorch's srun: "
                  "its options were the job's shape, which is placed already)")
    if re.search(r"^\s*(mpirun|mpiexec)\b", text, re.MULTILINE):
        notes.add("the script starts tasks with mpirun, which gpuorch does not provide: run the program directly, "
                  "as each task runs the script")
    logs = {k: opt[k].value or "" for k in ("output", "error") if k in opt}
    if logs:
        notes.add(f"#SBATCH {', '.join(opt[k].written for k in logs)}: recorded, not written: read the output "
                  "with gpuorch logs JOB [-t TASK] [--stderr]")
    return Translated(job, tuple(notes), f"sbatch script {filename}", logs)


HANDLED = {"account", "array", "dependency", "hold", "chdir", "constraint", "cpus-per-gpu", "cpus-per-task", "error",
           "export", "gpus", "gpus-per-node", "gpus-per-task", "gres", "job-name", "mem", "mem-per-cpu",
           "mem-per-gpu", "nodes", "ntasks", "ntasks-per-node", "output", "partition", "qos", "requeue",
           "no-requeue", "time", "tres-per-task"}


@dataclass(frozen=True)
class Shape:
    tasks: int
    nodes: int | None  # None: wherever they fit
    per_node: int | None
    gpus: float  # per task
    type: str | None
    written: str  # the GPU directive


def _shape(opt: dict[str, Directive], notes: Notes) -> Shape:
    """Tasks, nodes and GPUs per task, as Slurm would allocate them.

    1. Nodes and tasks per node: --nodes with --ntasks-per-node, or --ntasks split evenly over --nodes; one
       task per node by default. Without --nodes, per-node GPUs put the tasks on one node (as Slurm does when
       they fit there); per-task or per-job GPUs let them go wherever they fit.
    2. GPUs per task: --gpus-per-task; or the node's GPUs split over its tasks; or the job's over all tasks.
       A share that is not a whole number of GPUs is refused: Slurm would let the tasks share the GPUs.
    """
    nodes = None
    if "nodes" in opt:
        d = opt["nodes"]
        lo, _, hi = (d.value or "").partition("-")
        nodes = count(lo, d.written, 1)
        if hi and hi != lo:
            notes.add(f"#SBATCH {d.written}: a range of nodes; gpuorch takes {nodes}")
    ntasks = count(opt["ntasks"].value or "", opt["ntasks"].written, 1) if "ntasks" in opt else None
    per_node = (count(opt["ntasks-per-node"].value or "", opt["ntasks-per-node"].written, 1)
                if "ntasks-per-node" in opt else None)
    given: dict[str, _Gpus] = {}  # kind -> GPUs asked that way
    for name, kind in (("gpus-per-task", "task"), ("gpus-per-node", "node"), ("gpus", "job")):
        if name in opt:
            given[kind] = _gpu_count(opt[name], opt[name].value or "", kind)
    if "gres" in opt and (gres := _gres(opt["gres"], notes)) is not None:
        if "node" in given and (given["node"].count, given["node"].type) != (gres.count, gres.type):
            raise JobFileError(f"#SBATCH {given['node'].written} and {gres.written}: both are GPUs per node and "
                               "disagree: keep one")
        given["node"] = gres
    if "tres-per-task" in opt and "task" not in given:
        m = re.search(r"gres[/:]gpu(?::([^:,=]+))?[:=](\d+)", opt["tres-per-task"].value or "")
        if m:
            given["task"] = _Gpus(int(m.group(2)), "task", m.group(1), opt["tres-per-task"].written)
    types = {x.type for x in given.values() if x.type}
    if len(types) > 1:
        raise JobFileError(f"#SBATCH {' and '.join(x.written for x in given.values())}: GPU types "
                           f"{' and '.join(sorted(types))} disagree: one GPU type per job here")
    g = given.get("task") or given.get("node") or given.get("job")
    if g is not None and types:
        g = _Gpus(g.count, g.kind, types.pop(), g.written)

    # 1. nodes and tasks per node
    if nodes is not None:
        if per_node is not None and ntasks is not None and ntasks != nodes * per_node:
            if ntasks % nodes or ntasks // nodes > per_node:
                raise JobFileError(f"#SBATCH --ntasks={ntasks} with --nodes={nodes} --ntasks-per-node={per_node}: "
                                   "gpuorch puts as many tasks on every node: write "
                                   f"--ntasks={nodes * per_node}, or leave --ntasks out")
            notes.add(f"#SBATCH --ntasks={ntasks} over --nodes={nodes}: {ntasks // nodes} per node")
            per_node = ntasks // nodes
        elif per_node is None and ntasks is not None:
            if ntasks % nodes:
                raise JobFileError(f"#SBATCH --ntasks={ntasks} over --nodes={nodes} does not split evenly: gpuorch "
                                   "puts as many tasks on every node: write --ntasks-per-node")
            per_node = ntasks // nodes
        per_node = per_node or 1
    elif per_node is not None:
        nodes = 1 if ntasks is None else None
        if ntasks is not None:
            if ntasks % per_node:
                raise JobFileError(f"#SBATCH --ntasks={ntasks} with --ntasks-per-node={per_node} does not fill "
                                   f"whole nodes: write --nodes={-(-ntasks // per_node)} and "
                                   f"--ntasks={-(-ntasks // per_node) * per_node}")
            nodes = ntasks // per_node
    elif ntasks is None:
        nodes, per_node = 1, 1
    elif g is not None and g.kind == "node":
        nodes, per_node = 1, ntasks
        if ntasks > 1:
            notes.add(f"#SBATCH {g.written} is per node and --nodes is not given: the {ntasks} tasks share one "
                      "node, as Slurm places them when they fit (write --nodes=N to spread them)")
    tasks = ntasks if nodes is None else nodes * (per_node or 1)
    assert tasks is not None

    # 2. GPUs per task
    if g is None:
        return Shape(tasks, nodes, per_node, 0, None, "")
    on_node = per_node or tasks
    if g.kind == "task":
        share = float(g.count)
    elif g.kind == "node":
        if g.count % on_node:
            raise JobFileError(
                f"#SBATCH {g.written} is per node, split over that node's {on_node} tasks: {g.count} GPUs do not "
                f"split into whole GPUs per task, and gpuorch gives each task its own GPUs: write "
                f"--ntasks-per-node={g.count} (1 GPU each), or --ntasks-per-node=1 --cpus-per-task={on_node} for "
                f"one process that uses all {g.count}")
        share = g.count / on_node
    else:
        if g.count % tasks:
            raise JobFileError(f"#SBATCH {g.written} is for the whole job: {g.count} GPUs do not split into whole "
                               f"GPUs over its {tasks} tasks: write --gpus-per-task=N, or --ntasks={g.count}")
        share = g.count / tasks
    for other, total in (("node", share * on_node), ("job", share * tasks)):
        if other in given and given[other] is not g and given[other].count != total:
            raise JobFileError(f"#SBATCH {g.written} and {given[other].written} disagree: {share:g} GPUs per task "
                               f"is {total:g} per {other}: keep one of them")
    return Shape(tasks, nodes, per_node, whole_gpus(share, f"#SBATCH {g.written}"), g.type, g.written)


def _export(d: Directive | None, ctx: Context, notes: Notes) -> dict[str, str]:
    """--export: ALL (the default) and NONE name the submitting environment; VAR=value sets one; VAR copies it."""
    if d is None:
        notes.add("sbatch passes the submitting shell's environment (--export=ALL); gpuorch tasks start with the "
                  "job's own: set what the script needs in it, or with gpuorch submit -e NAME=VALUE")
        return {}
    env: dict[str, str] = {}
    for item in (d.value or "").split(","):
        name, eq, value = item.partition("=")
        if not eq and name.upper() in ("ALL", "NONE", "NIL"):
            if name.upper() == "ALL":
                notes.add(f"#SBATCH {d.written}: gpuorch tasks start with the job's own environment, not the "
                          "submitting shell's: set what the script needs in it")
            continue
        if eq:
            env[name] = value
        elif name in ctx.environ:
            env[name] = ctx.environ[name]
        elif name:
            notes.add(f"#SBATCH {d.written}: {name} is not set where this was submitted: not passed")
    return env
