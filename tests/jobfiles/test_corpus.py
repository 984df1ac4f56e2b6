"""Every file of tests/data/inputs (sbatch scripts and Kubernetes-family manifests written in the styles of HPC
sites and training repos) is read as its format means, or refused naming what to write instead: the expectations
are in tests/data/inputs/expected.yaml."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from services.jobfiles import JobFileError, load_file
from services.scheduler.api import JobRequest
from shared.model import QueueSpec

CORPUS = Path(__file__).resolve().parents[1] / "data" / "inputs"
EXPECTED: dict[str, dict[str, Any]] = yaml.safe_load((CORPUS / "expected.yaml").read_text())
OPTIONAL = ("cpu_milli", "memory_mib", "max_retries", "name")


def mapping(req: JobRequest) -> dict[str, Any]:
    """What a person checks of a translated job: the gang, its GPUs, where, how long, which queue, what priority."""
    if req.topology == "node":
        nodes: int | str = 1
    elif req.tasks_per_node:
        nodes = req.tasks // req.tasks_per_node
    else:
        nodes = "any"
    return {"tasks": req.tasks, "gpus": req.resources.gpus, "nodes": nodes, "models": set(req.gpu.models),
            "mig": req.gpu.mig, "time_limit_s": req.time_limit_s, "queue": req.queue, "priority": req.priority,
            "cpu_milli": req.resources.cpu_milli, "memory_mib": req.resources.memory_mib,
            "max_retries": req.max_retries, "name": req.name,
            "array": [len(req.array.indices), req.array.max_running] if req.array else None,  # elements, at once
            "dependencies": [f"{d.kind}:{d.job}" for d in req.dependencies] + (["singleton"] if req.singleton else [])}


def test_the_corpus_holds_thirty_files_or_more_each_with_its_expectation():
    files = {p.name for p in CORPUS.iterdir() if p.name not in ("expected.yaml", "__pycache__")}  # (compileall)
    assert files == set(EXPECTED), files ^ set(EXPECTED)
    assert len(files) >= 30


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_file_is_read_as_its_format_means_or_refused_saying_what_to_write(name: str):
    want = EXPECTED[name]
    if "refused" in want:
        with pytest.raises(JobFileError) as refusal:
            load_file(CORPUS / name)
        for part in want["refused"]:
            assert part in str(refusal.value), (part, str(refusal.value))
        return
    loaded = load_file(CORPUS / name)
    assert len(loaded.notes) == want.get("notes", 0), loaded.notes
    assert len(loaded.jobs) == len(want.get("jobs", [])), [t.origin for t in loaded.jobs]
    for translated, job in zip(loaded.jobs, want.get("jobs", [])):
        got = mapping(JobRequest.model_validate(translated.job))  # what POST /v1/jobs takes, as it takes it
        expected = {k: v for k, v in job.items() if k not in OPTIONAL}
        expected.setdefault("mig", None)
        expected.setdefault("array", None)  # [elements, at most at once]
        expected.setdefault("dependencies", [])
        expected["models"] = set(expected["models"])
        assert {k: got[k] for k in expected} == expected
        for k in OPTIONAL:
            if k in job:
                assert got[k] == job[k], k
    queues = {q.path: q.spec for q in loaded.queues}
    assert queues == want.get("queues", {})
    for spec in queues.values():
        QueueSpec.model_validate(spec)  # what PUT /v1/queues takes
