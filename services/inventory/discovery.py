"""What a node agent reports about its GPUs: from NVML, or from a simulated profile.

Every NVML call goes through the module passed in (pynvml, or anything with its
call surface, such as the test fake). A query that fails for one GPU marks that
GPU and discovery carries on: a node with one sick GPU still registers.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pynvml

from shared import profiles
from shared.model import GpuInfo, MigSlice, NodeInfo

Nvml = Any  # the pynvml module, or an object with its call surface
MIB = 1 << 20
log = logging.getLogger("gpuorch.inventory.discovery")


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used at all on this machine (no driver, no library)."""


@dataclass(frozen=True)
class GpuSample:
    uuid: str
    index: int
    gpu_util_pct: int | None = None
    memory_util_pct: int | None = None
    memory_used_mib: int | None = None
    memory_free_mib: int | None = None
    temperature_c: int | None = None
    power_mw: int | None = None
    ecc_corrected: int | None = None  # volatile: since the driver loaded
    ecc_uncorrected: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class XidEvent:
    gpu_uuid: str
    xid: int


# --- discovery ---------------------------------------------------------------------


def discover_nvml(
    nvml: Nvml = pynvml,
    *,
    node_id: str,
    labels: Mapping[str, str] | None = None,
    rack: str = "",
    zone: str = "",
    cpu_milli: int | None = None,
    memory_mib: int | None = None,
    hostname: str | None = None,
) -> NodeInfo:
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as err:
        raise NvmlUnavailable(f"NVML did not start ({err}): is the NVIDIA driver loaded? Without GPUs, use the simulated backend") from err
    try:
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as err:
            raise NvmlUnavailable(f"NVML cannot count GPUs ({err})") from err
        probed = [_probe_gpu(nvml, node_id, i) for i in range(count)]
        gpus = _fold_nvlink(node_id, [g for g, _ in probed], [links for _, links in probed])
        system = _Probe(nvml)
        driver = system.ask(nvml.nvmlSystemGetDriverVersion, default="")
        cuda = system.ask(nvml.nvmlSystemGetCudaDriverVersion)
        for error in system.errors:
            log.warning("nvml_system_query_failed node=%s error=%r", node_id, error)
    finally:
        nvml.nvmlShutdown()
    return NodeInfo(
        node_id=node_id,
        hostname=socket.gethostname() if hostname is None else hostname,
        labels=dict(labels or {}),
        rack=rack,
        zone=zone,
        cpu_milli=host_cpu_milli() if cpu_milli is None else cpu_milli,
        memory_mib=host_memory_mib() if memory_mib is None else memory_mib,
        gpus=tuple(gpus),
        driver_version=driver,
        cuda_version=f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else "",
    )


def model_name(nvml_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100-80GB', 'Tesla T4' -> 'T4': the names job constraints use."""
    name = nvml_name.strip()
    for vendor in ("NVIDIA ", "Tesla "):
        name = name.removeprefix(vendor)
    return "-".join(t for t in name.split() if not t.upper().startswith(("HBM", "GDDR")))


def canonical_bus_id(bus_id: str) -> str:
    """NVML's form, 'DDDDDDDD:BB:DD.F' in upper case, also from the legacy 4-digit domain."""
    domain, _, rest = bus_id.strip().partition(":")
    return f"{int(domain, 16):08X}:{rest.upper()}" if rest else bus_id.upper()


def host_cpu_milli() -> int:
    return (os.cpu_count() or 0) * 1000


def host_memory_mib(meminfo: str = "/proc/meminfo") -> int:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


class _Probe:
    """Asks NVML one question at a time, keeping each failure as a message instead of raising."""

    def __init__(self, nvml: Nvml) -> None:
        self.nvml = nvml
        self.errors: list[str] = []
        self.unsupported = (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def ask(self, fn: Callable[..., Any], *args: Any, default: Any = None, absent: Sequence[int] = ()) -> Any:
        """`absent` lists the codes that mean "this GPU has no such thing", which is no error."""
        try:
            return fn(*args)
        except self.nvml.NVMLError as err:
            message = f"{fn.__name__}: {err}"
            if err.value not in absent and message not in self.errors:
                self.errors.append(message)
            return default

    @property
    def error(self) -> str | None:
        return "; ".join(self.errors) or None


def _probe_gpu(nvml: Nvml, node_id: str, index: int) -> tuple[GpuInfo, tuple[str, ...]]:
    """One GPU's facts, and the remote PCI bus of each of its active NVLinks."""
    p = _Probe(nvml)
    unknown = f"unknown:{node_id}:{index}"
    handle = p.ask(nvml.nvmlDeviceGetHandleByIndex, index)
    if handle is None:
        return GpuInfo(uuid=unknown, index=index, model="", memory_mib=0, healthy=False, error=p.error), ()
    uuid = p.ask(nvml.nvmlDeviceGetUUID, handle)
    name = p.ask(nvml.nvmlDeviceGetName, handle)
    memory = p.ask(nvml.nvmlDeviceGetMemoryInfo, handle)
    identity_known = not p.errors
    cc = p.ask(nvml.nvmlDeviceGetCudaComputeCapability, handle)
    pci = p.ask(nvml.nvmlDeviceGetPciInfo, handle)
    numa = p.ask(nvml.nvmlDeviceGetNumaNodeId, handle, absent=p.unsupported)
    ecc = p.ask(nvml.nvmlDeviceGetEccMode, handle, absent=p.unsupported)
    mig_mode = p.ask(nvml.nvmlDeviceGetMigMode, handle, absent=p.unsupported)
    mig_enabled = mig_mode is not None and mig_mode[0] == nvml.NVML_DEVICE_MIG_ENABLE
    mig_slices = _mig_slices(nvml, p, handle) if mig_enabled else ()
    links = _nvlink_remotes(nvml, p, handle)
    gpu = GpuInfo(
        uuid=uuid or unknown,
        index=index,
        model=model_name(name) if name else "",
        memory_mib=memory.total // MIB if memory is not None else 0,
        compute_capability=f"{cc[0]}.{cc[1]}" if cc is not None else "",
        pci_bus_id=canonical_bus_id(pci.busId) if pci is not None and pci.busId else "",
        numa_node=numa if numa is not None and numa >= 0 else None,
        ecc_enabled=None if ecc is None else ecc[0] == nvml.NVML_FEATURE_ENABLED,
        mig_enabled=mig_enabled,
        mig_slices=mig_slices,
        healthy=identity_known,
        error=p.error,
    )
    return gpu, links


def _mig_slices(nvml: Nvml, p: _Probe, parent: Any) -> tuple[MigSlice, ...]:
    """MIG devices by index, each named by its GPU instance's profile, as go-nvlib does."""
    names = {}
    for profile in range(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        info = p.ask(nvml.nvmlDeviceGetGpuInstanceProfileInfo, parent, profile, absent=(*p.unsupported, nvml.NVML_ERROR_INVALID_ARGUMENT))
        if info is not None:
            names[info.id] = info.name.removeprefix("MIG ")
    slices = []
    for i in range(p.ask(nvml.nvmlDeviceGetMaxMigDeviceCount, parent, default=0)):
        mig = p.ask(nvml.nvmlDeviceGetMigDeviceHandleByIndex, parent, i, absent=(nvml.NVML_ERROR_NOT_FOUND,))
        if mig is None:
            continue
        uuid = p.ask(nvml.nvmlDeviceGetUUID, mig)
        memory = p.ask(nvml.nvmlDeviceGetMemoryInfo, mig)
        gi_id = p.ask(nvml.nvmlDeviceGetGpuInstanceId, mig)
        gi = None if gi_id is None else p.ask(nvml.nvmlDeviceGetGpuInstanceById, parent, gi_id)
        gi_info = None if gi is None else p.ask(nvml.nvmlGpuInstanceGetInfo, gi)
        if uuid:
            profile_name = names.get(gi_info.profileId, "") if gi_info is not None else ""
            slices.append(MigSlice(uuid=uuid, profile=profile_name, memory_mib=memory.total // MIB if memory is not None else 0))
    return tuple(slices)


def _nvlink_remotes(nvml: Nvml, p: _Probe, handle: Any) -> tuple[str, ...]:
    # Links past a GPU's own count answer INVALID_ARGUMENT; PCIe-only GPUs NOT_SUPPORTED.
    no_link = (*p.unsupported, nvml.NVML_ERROR_INVALID_ARGUMENT, nvml.NVML_ERROR_NOT_FOUND)
    remotes = []
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        if p.ask(nvml.nvmlDeviceGetNvLinkState, handle, link, absent=no_link) != nvml.NVML_FEATURE_ENABLED:
            continue
        pci = p.ask(nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link, absent=no_link)
        if pci is not None:
            remotes.append(canonical_bus_id(pci.busId))
    return tuple(remotes)


def _fold_nvlink(node_id: str, gpus: list[GpuInfo], remotes: list[tuple[str, ...]]) -> list[GpuInfo]:
    """Union-find over NVLink peers.

    1. A link whose remote bus is a GPU of this node joins the two GPUs (both
       ways: a GPU whose own link queries failed is still its peer's peer).
    2. Any other remote is an NVSwitch: every GPU wired to one joins the single
       switch fabric (slot `fabric`), since NVSwitches connect all their GPUs.
    3. Domains are numbered by their lowest GPU index; peers are the GPUs a GPU
       links to directly, plus the whole fabric if it is on it.
    """
    gpu_at_bus = {g.pci_bus_id: g.index for g in gpus if g.pci_bus_id}
    fabric = len(gpus)
    root = list(range(len(gpus) + 1))

    def find(x: int) -> int:
        while root[x] != x:
            root[x] = root[root[x]]
            x = root[x]
        return x

    direct: dict[int, set[int]] = {g.index: set() for g in gpus}
    on_fabric: set[int] = set()
    for gpu, buses in zip(gpus, remotes):
        for bus in buses:
            peer = gpu_at_bus.get(bus)
            if peer is None:
                on_fabric.add(gpu.index)
                root[find(gpu.index)] = find(fabric)
            elif peer != gpu.index:
                direct[gpu.index].add(peer)
                direct[peer].add(gpu.index)
                root[find(gpu.index)] = find(peer)

    domains: dict[int, str] = {}
    folded = []
    for gpu in gpus:
        peers = direct[gpu.index] | (on_fabric - {gpu.index} if gpu.index in on_fabric else set())
        linked = bool(direct[gpu.index]) or gpu.index in on_fabric
        domain = None
        if linked:
            domain = domains.get(find(gpu.index)) or profiles.nvlink_domain_id(node_id, len(domains))
            domains[find(gpu.index)] = domain
        folded.append(
            gpu.model_copy(update={"nvlink_domain": domain, "nvlink_peers": tuple(gpus[i].uuid for i in sorted(peers))})
        )
    return folded


# --- telemetry and XID events ------------------------------------------------------
# These expect NVML initialised by the caller (nvmlInit is slow; the agent holds it).


def sample_telemetry(nvml: Nvml, node: NodeInfo) -> list[GpuSample]:
    return [_sample(nvml, gpu) for gpu in node.gpus]


def _sample(nvml: Nvml, gpu: GpuInfo) -> GpuSample:
    p = _Probe(nvml)
    handle = p.ask(nvml.nvmlDeviceGetHandleByUUID, gpu.uuid)
    if handle is None:
        return GpuSample(uuid=gpu.uuid, index=gpu.index, error=p.error)
    util = p.ask(nvml.nvmlDeviceGetUtilizationRates, handle, absent=p.unsupported)
    memory = p.ask(nvml.nvmlDeviceGetMemoryInfo, handle)
    ecc = [
        p.ask(nvml.nvmlDeviceGetTotalEccErrors, handle, kind, nvml.NVML_VOLATILE_ECC, absent=p.unsupported)
        for kind in (nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
    ]
    return GpuSample(
        uuid=gpu.uuid,
        index=gpu.index,
        gpu_util_pct=util.gpu if util is not None else None,
        memory_util_pct=util.memory if util is not None else None,
        memory_used_mib=memory.used // MIB if memory is not None else None,
        memory_free_mib=memory.free // MIB if memory is not None else None,
        temperature_c=p.ask(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU, absent=p.unsupported),
        power_mw=p.ask(nvml.nvmlDeviceGetPowerUsage, handle, absent=p.unsupported),
        ecc_corrected=ecc[0],
        ecc_uncorrected=ecc[1],
        error=p.error,
    )


def register_xid_events(nvml: Nvml, node: NodeInfo) -> Any:
    """An NVML event set watching every GPU of `node` for XID errors; GPUs that refuse are logged."""
    event_set = nvml.nvmlEventSetCreate()
    for gpu in node.gpus:
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, event_set)
        except nvml.NVMLError as err:
            log.warning("xid_watch_skipped node=%s gpu=%s error=%r", node.node_id, gpu.uuid, str(err))
    return event_set


def poll_xid_events(nvml: Nvml, event_set: Any, timeout_ms: int) -> list[XidEvent]:
    """Waits up to `timeout_ms` for XID events, then drains what else is pending.

    nvmlEventSetWait blocks its thread: call this from a worker thread
    (asyncio.to_thread), never on the event loop.
    """
    events: list[XidEvent] = []
    wait = timeout_ms
    while True:
        try:
            data = nvml.nvmlEventSetWait(event_set, wait)
        except nvml.NVMLError as err:
            if err.value == nvml.NVML_ERROR_TIMEOUT:
                return events
            raise
        wait = 0
        if data.eventType == nvml.nvmlEventTypeXidCriticalError:
            events.append(XidEvent(gpu_uuid=_uuid_of(nvml, data.device), xid=int(data.eventData)))


def _uuid_of(nvml: Nvml, handle: Any) -> str:
    try:
        return nvml.nvmlDeviceGetUUID(handle)
    except nvml.NVMLError:
        return ""
