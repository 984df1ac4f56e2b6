"""Named simulated nodes: the inventory a real box of that shape reports.

`build("dgx-h100", "n-1")` returns the NodeInfo that NVML discovery on such a
box produces, so the whole system runs on a laptop. GPU UUIDs are derived from
the node id and index, so a restarted simulated agent reports the same GPUs.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.model import GpuInfo, MigSlice, NodeInfo

MIG_COMPUTE_SLICES = 7
_UUID_NAMESPACE = uuid.NAMESPACE_URL


@dataclass(frozen=True)
class MigProfile:
    name: str  # "1g.10gb"
    nvml_profile: int  # the NVML_GPU_INSTANCE_PROFILE_* index it is listed under
    nvml_id: int  # the profile id NVML reports for its GPU instances
    slices: int
    memory_mib: int


@dataclass(frozen=True)
class GpuSpec:
    model: str
    nvml_name: str  # what nvmlDeviceGetName reports
    memory_mib: int
    compute_capability: str
    nvlinks: int = 0
    mig_profiles: tuple[MigProfile, ...] = ()

    def mig_profile(self, name: str) -> MigProfile:
        for profile in self.mig_profiles:
            if profile.name == name:
                return profile
        known = ", ".join(p.name for p in self.mig_profiles) or "none: this GPU has no MIG"
        raise ValueError(f"{self.model} has no MIG profile {name!r} (known: {known})")


@dataclass(frozen=True)
class NodeProfile:
    name: str
    gpu: GpuSpec
    bus_ids: tuple[str, ...]
    nvlink_groups: tuple[tuple[int, ...], ...]  # GPU indices sharing one NVLink/NVSwitch domain
    cpu_milli: int
    memory_mib: int
    driver_version: str = "550.90.07"
    cuda_version: str = "12.4"
    numa_nodes: int = 2


_A100_40GB_MIG = (
    MigProfile("1g.5gb", 0, 19, 1, 4864),
    MigProfile("1g.10gb", 9, 15, 1, 9856),
    MigProfile("2g.10gb", 1, 14, 2, 9856),
    MigProfile("3g.20gb", 2, 9, 3, 19968),
    MigProfile("4g.20gb", 3, 5, 4, 19968),
    MigProfile("7g.40gb", 4, 0, 7, 40192),
)
_H100_80GB_MIG = (
    MigProfile("1g.10gb", 0, 19, 1, 9856),
    MigProfile("1g.20gb", 9, 15, 1, 19968),
    MigProfile("2g.20gb", 1, 14, 2, 19968),
    MigProfile("3g.40gb", 2, 9, 3, 40192),
    MigProfile("4g.40gb", 3, 5, 4, 40192),
    MigProfile("7g.80gb", 4, 0, 7, 80384),
)

GPU_SPECS: dict[str, GpuSpec] = {
    spec.model: spec
    for spec in (
        GpuSpec("H100-80GB", "NVIDIA H100 80GB HBM3", 81559, "9.0", nvlinks=18, mig_profiles=_H100_80GB_MIG),
        GpuSpec("A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", 40960, "8.0", nvlinks=12, mig_profiles=_A100_40GB_MIG),
        GpuSpec("A100-PCIE-40GB", "NVIDIA A100-PCIE-40GB", 40960, "8.0", nvlinks=12, mig_profiles=_A100_40GB_MIG),
        GpuSpec("L4", "NVIDIA L4", 23034, "8.9"),
        GpuSpec("T4", "Tesla T4", 15360, "7.5"),
    )
}

PROFILES: dict[str, NodeProfile] = {
    p.name: p
    for p in (
        NodeProfile(
            "dgx-h100",
            GPU_SPECS["H100-80GB"],
            ("1B", "43", "52", "61", "9D", "C3", "D1", "DF"),
            nvlink_groups=(tuple(range(8)),),
            cpu_milli=224_000,
            memory_mib=2 * 1024 * 1024,
        ),
        NodeProfile(
            "hgx-a100-40gb",
            GPU_SPECS["A100-SXM4-40GB"],
            ("07", "0F", "47", "4E", "87", "90", "B7", "BD"),
            nvlink_groups=(tuple(range(8)),),
            cpu_milli=256_000,
            memory_mib=1024 * 1024,
        ),
        NodeProfile(
            "a100-pcie-2x2",
            GPU_SPECS["A100-PCIE-40GB"],
            ("17", "31", "B1", "CA"),
            nvlink_groups=((0, 1), (2, 3)),
            cpu_milli=128_000,
            memory_mib=512 * 1024,
        ),
        NodeProfile(
            "l4-8x",
            GPU_SPECS["L4"],
            ("16", "2A", "3D", "4F", "96", "AA", "BD", "CF"),
            nvlink_groups=(),
            cpu_milli=96_000,
            memory_mib=512 * 1024,
        ),
        NodeProfile(
            "t4-4x",
            GPU_SPECS["T4"],
            ("18", "3B", "86", "AF"),
            nvlink_groups=(),
            cpu_milli=64_000,
            memory_mib=256 * 1024,
            driver_version="535.183.01",
            cuda_version="12.2",
        ),
    )
}


class UnknownProfile(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"no node profile {name!r}; known profiles: {', '.join(PROFILES)}")


def gpu_uuid(node_id: str, index: int) -> str:
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'gpuorch://{node_id}/gpu/{index}')}"


def mig_uuid(node_id: str, index: int, slot: int) -> str:
    return f"MIG-{uuid.uuid5(_UUID_NAMESPACE, f'gpuorch://{node_id}/gpu/{index}/mig/{slot}')}"


def nvlink_domain_id(node_id: str, ordinal: int) -> str:
    """Domains are numbered on each node in order of their lowest GPU index."""
    return f"{node_id}:nvl{ordinal}"


def build(
    profile: str,
    node_id: str,
    labels: Mapping[str, str] | None = None,
    rack: str = "",
    zone: str = "",
    mig: Mapping[int, Sequence[str]] | None = None,
) -> NodeInfo:
    """The NodeInfo of a simulated `profile` node; `mig` turns MIG on for the GPUs it names."""
    spec = PROFILES.get(profile)
    if spec is None:
        raise UnknownProfile(profile)
    count = len(spec.bus_ids)
    mig = dict(mig or {})
    if mig and not spec.gpu.mig_profiles:
        raise ValueError(f"{profile} has {spec.gpu.model} GPUs, which have no MIG")
    if bad := sorted(set(mig) - set(range(count))):
        raise ValueError(f"{profile} has GPUs 0..{count - 1}; no GPU {bad[0]} to enable MIG on")
    domain_of = {i: nvlink_domain_id(node_id, n) for n, group in enumerate(spec.nvlink_groups) for i in group}
    gpus = []
    for i, bus in enumerate(spec.bus_ids):
        group = next((g for g in spec.nvlink_groups if i in g), ())
        gpus.append(
            GpuInfo(
                uuid=gpu_uuid(node_id, i),
                index=i,
                model=spec.gpu.model,
                memory_mib=spec.gpu.memory_mib,
                compute_capability=spec.gpu.compute_capability,
                nvlink_domain=domain_of.get(i),
                nvlink_peers=tuple(gpu_uuid(node_id, j) for j in group if j != i),
                pci_bus_id=f"00000000:{bus}:00.0",
                numa_node=i * spec.numa_nodes // count,
                ecc_enabled=True,
                mig_enabled=i in mig,
                mig_slices=_mig_slices(spec.gpu, node_id, i, mig.get(i, ())),
            )
        )
    return NodeInfo(
        node_id=node_id,
        hostname=node_id,
        labels=dict(labels or {}),
        rack=rack,
        zone=zone,
        cpu_milli=spec.cpu_milli,
        memory_mib=spec.memory_mib,
        gpus=tuple(gpus),
        driver_version=spec.driver_version,
        cuda_version=spec.cuda_version,
    )


MIG_SUFFIX = "+mig"  # `gpuorch up --nodes dgx-h100+mig:1`: the profile with its last GPU as seven smallest slices


def parse_mig(items: Sequence[str]) -> dict[int, list[str]]:
    """``["7=1g.10gb*7", "0=3g.40gb,2g.20gb"]`` -> {GPU index: [MIG profile, ...]} (``build`` checks the names);
    ValueError saying what is wrong."""
    out: dict[int, list[str]] = {}
    for item in items:
        gpu, sep, layout = item.partition("=")
        names = []
        for part in filter(None, (p.strip() for p in layout.split(","))):
            name, star, n = part.partition("*")
            if star and not (n.isdigit() and 0 < int(n) <= MIG_COMPUTE_SLICES):
                raise ValueError(f"--mig {item!r}: {part!r} repeats a profile 1 to {MIG_COMPUTE_SLICES} times (*N)")
            names += [name.strip()] * (int(n) if star else 1)
        if not sep or not gpu.strip().isdigit() or not names:
            raise ValueError(f"--mig takes GPU=PROFILE[*N][,PROFILE...], e.g. 7=1g.10gb*7; got {item!r}")
        out[int(gpu)] = names
    return out


def default_mig(profile: str) -> dict[int, list[str]]:
    """The ``+mig`` layout of a profile: its last GPU split into seven of its smallest MIG slices."""
    spec = PROFILES[profile]
    if not spec.gpu.mig_profiles:
        raise ValueError(f"{profile} has {spec.gpu.model} GPUs, which have no MIG")
    return {len(spec.bus_ids) - 1: [spec.gpu.mig_profiles[0].name] * MIG_COMPUTE_SLICES}


def _mig_slices(gpu: GpuSpec, node_id: str, index: int, names: Sequence[str]) -> tuple[MigSlice, ...]:
    profiles = [gpu.mig_profile(name) for name in names]
    if sum(p.slices for p in profiles) > MIG_COMPUTE_SLICES:
        raise ValueError(f"GPU {index}: {', '.join(names)} need more than the {MIG_COMPUTE_SLICES} compute slices of a {gpu.model}")
    return tuple(
        MigSlice(uuid=mig_uuid(node_id, index, slot), profile=p.name, memory_mib=p.memory_mib) for slot, p in enumerate(profiles)
    )
