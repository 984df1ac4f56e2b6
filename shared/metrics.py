"""Several processes' Prometheus expositions as one: what the split gateway serves on /metrics.

Each family keeps its first HELP and TYPE lines and gathers its samples from every body, so a family two
processes both export (``gpuorch_events_applied_total``, one series per service) is declared once, as the text
format requires. Samples are kept as they are: the processes label their own series apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Family:
    help: str = ""
    type: str = ""
    samples: list[str] = field(default_factory=list)


def _family_of(sample: str) -> str:
    return sample.split("{", 1)[0].split(" ", 1)[0]


def merge_expositions(bodies: list[str]) -> str:
    """Prometheus text-format bodies (0.0.4) merged family by family, in the order families first appear."""
    families: dict[str, _Family] = {}
    for body in bodies:
        current: _Family | None = None
        for line in body.splitlines():
            if not line.strip():
                continue
            if line.startswith(("# HELP ", "# TYPE ")):
                parts = line.split(" ", 3)
                current = families.setdefault(parts[2], _Family())
                if line.startswith("# HELP ") and not current.help:
                    current.help = line
                elif line.startswith("# TYPE ") and not current.type:
                    current.type = line
            elif line.startswith("#"):
                continue
            else:
                if current is None:  # a sample with no family declared before it: a family of its own name
                    current = families.setdefault(_family_of(line), _Family())
                current.samples.append(line)
    out: list[str] = []
    for fam in families.values():
        out += [line for line in (fam.help, fam.type) if line] + fam.samples
    return "\n".join(out) + "\n" if out else ""
