"""GPU model names as job files write them (Slurm GRES types, Kubernetes GPU labels) -> the models gpuorch knows."""

from __future__ import annotations

import re
from collections.abc import Iterable

from shared.profiles import GPU_SPECS

# Model names as NVML discovery writes them (services/inventory/discovery.model_name): the ones a
# Slurm GRES type such as "a100" or "v100_32g" may mean, besides those of the simulated profiles.
CATALOGUE: tuple[str, ...] = tuple(GPU_SPECS) + (
    "B200", "GH200-480GB", "H200", "H100-PCIe", "H100-NVL", "H100-SXM5-80GB", "H800",
    "A100-SXM4-80GB", "A100-80GB-PCIe", "A800-SXM4-80GB", "A30", "A40", "A10", "A10G", "A16", "A2",
    "L40", "L40S", "V100-SXM2-16GB", "V100-SXM2-32GB", "V100-PCIE-16GB", "V100-PCIE-32GB", "V100S-PCIE-32GB",
    "P100-PCIE-16GB", "P100-SXM2-16GB", "P40", "K80", "RTX-A6000", "RTX-A5000", "RTX-A4000",
    "RTX-6000-Ada-Generation", "Quadro-RTX-8000", "Quadro-RTX-6000", "GeForce-RTX-4090", "GeForce-RTX-3090",
    "GeForce-RTX-2080-Ti", "GeForce-GTX-1080-Ti", "TITAN-RTX", "TITAN-V",
)

_VENDOR = {"nvidia", "tesla", "geforce", "quadro"}
_MIG = re.compile(r"(?:^|[_:\-])([1-7]g\.[0-9]+gb)$", re.IGNORECASE)
# GPU feature discovery's nvidia.com/gpu.family label -> the compute capability that family starts at
FAMILY_CC = {"kepler": "3.0", "maxwell": "5.0", "pascal": "6.0", "volta": "7.0", "turing": "7.5", "ampere": "8.0",
             "ada-lovelace": "8.9", "lovelace": "8.9", "hopper": "9.0", "blackwell": "10.0"}


def _tokens(name: str) -> list[str]:
    out = []
    for t in re.split(r"[^a-z0-9]+", name.lower()):
        if not t or t in _VENDOR:
            continue
        if re.fullmatch(r"[0-9]+g", t):  # a100_80g: 80 GB
            t += "b"
        out.append(t)
    return out


def _runs(tokens: list[str]) -> set[str]:
    """Every token and every concatenation of consecutive tokens: "rtx8000" matches Quadro-RTX-8000."""
    return {"".join(tokens[i:j]) for i in range(len(tokens)) for j in range(i + 1, len(tokens) + 1)}


def mig_profile(gres_type: str) -> str | None:
    """A MIG GRES type ("1g.10gb", "a100_3g.40gb") -> its profile, else None."""
    m = _MIG.search(gres_type)
    return m.group(1).lower() if m else None


def models_for(gres_type: str, known: Iterable[str] = ()) -> tuple[str, ...]:
    """The known models a GPU type names: every word of it must be a word of the model ("a100" is every A100,
    "a100_80g" the 80 GB ones, "a10" is no A100). Empty when none matches."""
    want = _tokens(gres_type)
    if not want:
        return ()
    found = []
    for model in dict.fromkeys((*CATALOGUE, *known)):
        have = _runs(_tokens(model))
        if all(t in have for t in want):
            found.append(model)
    return tuple(found)


def product_model(label: str) -> tuple[str, str | None]:
    """GPU feature discovery's nvidia.com/gpu.product value -> (model as NVML discovery names it, MIG profile).

    "NVIDIA-H100-80GB-HBM3" -> ("H100-80GB", None); "Tesla-T4" -> ("T4", None);
    "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb" -> ("A100-SXM4-40GB", "1g.5gb").
    """
    name, _, mig = label.partition("-MIG-")
    parts = name.split("-")
    while parts and parts[0].lower() in ("nvidia", "tesla"):
        parts = parts[1:]
    model = "-".join(p for p in parts if p and not p.upper().startswith(("HBM", "GDDR")))
    return model, (mig.lower() or None)
