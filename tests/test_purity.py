"""Pure modules stay pure: the decisions, projections and plain data import nothing of the bus, the HTTP edge or
SQL, not even through another module, and read no clock (``now`` is passed in, event time is the envelope's)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = frozenset({"nats", "fastapi", "starlette", "uvicorn", "httpx", "sqlmodel", "sqlalchemy"})
ADAPTERS = {"api", "jobinput", "service", "__main__", "__init__"}  # a service's edge (jobinput: the API's body reader);
# everything else of the scheduler is its core


def modules(folder: str, names: set[str] | None = None) -> list[str]:
    """The modules of ``folder`` (those in ``names``, or all but the adapters), as dotted names."""
    found = sorted(p.stem for p in (ROOT / folder).glob("*.py"))
    return [f"{folder.replace('/', '.')}.{m}" for m in found if (m in names if names else m not in ADAPTERS)]


DECISIONS = [
    *modules("services/scheduler"),  # the cycle: core, decide, placement, gang, preemption, fragmentation, ...
    *modules("services/health", {"rules", "decisions", "projection"}),
    *modules("services/autoscaler", {"scaling", "projection"}),
    *modules("services/quota", {"projection"}),
    *modules("services/inventory", {"projection"}),
    "shared.cluster", "shared.projection", "shared.fairshare", "shared.model", "shared.timespec", "shared.profiles",
]
PURE = [
    *DECISIONS,
    "shared.events",  # plain data; it stamps a new envelope with the time it is made, so it is no decision module
    *modules("services/simulation"),  # virtual time through the same cores; it times its own run for the report
]


def loaded_by(*names: str) -> set[str]:
    """The forbidden top-level packages a fresh interpreter holds after importing ``names``."""
    code = ("import importlib, json, sys\n"
            "for name in sys.argv[1:]:\n"
            "    importlib.import_module(name)\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout)) & FORBIDDEN


def import_chain(name: str, package: str) -> list[str]:
    """How importing ``name`` reaches ``package``: the nesting of ``python -X importtime`` down to it."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {name}"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stderr
    # each line "import time: self | cumulative | <indent>module"; a module is printed after all it imported
    rows = [line.split("|")[2] for line in out.splitlines() if line.startswith("import time:") and "|" in line[12:]]
    rows = [(len(r) - len(r.lstrip()), r.strip()) for r in rows[1:]]
    for i, (depth, module) in enumerate(rows):
        if module.split(".")[0] == package:
            chain, want = [module], depth
            for d, m in rows[i + 1:]:
                if d < want:
                    chain.append(m)
                    want = d
            chain.reverse()
            return chain[:next(i for i, m in enumerate(chain) if m.split(".")[0] == package) + 1]
    return []


def test_the_pure_module_list_names_modules_that_exist_and_covers_each_services_core() -> None:
    assert "services.scheduler.core" in PURE and "services.scheduler.decide" in PURE
    assert "services.health.decisions" in PURE and "services.autoscaler.scaling" in PURE
    assert not {"services.scheduler.service", "services.scheduler.api"} & set(PURE)
    for name in PURE:
        assert (ROOT / (name.replace(".", "/") + ".py")).is_file(), name


def test_pure_modules_import_nothing_of_the_bus_the_http_edge_or_sql() -> None:
    if not loaded_by(*PURE):  # one interpreter for all: none of them pulls a forbidden package in
        return
    found = {name: sorted(bad) for name in PURE if (bad := loaded_by(name))}
    why = [f"{name} imports {', '.join(bad)}: {' -> '.join(import_chain(name, bad[0]))}" for name, bad in found.items()]
    pytest.fail("pure modules with I/O dependencies:\n" + "\n".join(why))


CLOCKS = {("time", "time"), ("time", "monotonic"), ("time", "perf_counter"), ("time", "time_ns"),
          ("time", "monotonic_ns"), ("datetime", "now"), ("datetime", "utcnow"), ("datetime", "today"),
          ("date", "today")}


def clock_reads(path: Path) -> list[str]:
    """Where the module reads a clock: ``time.time()``, ``datetime.now()``, ``from time import monotonic``..."""
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and (n.value.id, n.attr) in CLOCKS:
            out.append((n.lineno, f"{n.value.id}.{n.attr}"))
        elif isinstance(n, ast.ImportFrom) and n.module in ("time", "datetime"):
            out += [(n.lineno, f"from {n.module} import {a.name}") for a in n.names if (n.module, a.name) in CLOCKS]
    return [f"{path.name}:{line} {what}" for line, what in sorted(out)]


@pytest.mark.parametrize("name", DECISIONS)
def test_decision_modules_read_no_clock(name: str) -> None:
    assert clock_reads(ROOT / (name.replace(".", "/") + ".py")) == []


def test_the_clock_check_finds_a_clock_read(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("import time\nfrom time import monotonic\nt = time.time()\n")
    assert clock_reads(tmp_path / "m.py") == ["m.py:2 from time import monotonic", "m.py:3 time.time"]
