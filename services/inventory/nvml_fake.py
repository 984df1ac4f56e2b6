"""A stand-in for the pynvml module, built from a NodeInfo, for machines without a GPU.

It implements only the pynvml calls that discovery, telemetry and the XID
watcher make, with pynvml's names, parameters, result structs, constants and
NVMLError codes, so the same code runs against it and against a real driver.
Test hooks: `fail(function, gpu_index)`, `inject_xid(gpu_index, xid)`,
`set_telemetry(gpu_index, ...)`.

Wiring it infers from the NodeInfo: a GPU with no NVLink domain has no NVLink;
a domain of two GPUs is a bridged pair whose links all reach the peer; a larger
domain is an NVSwitch fabric whose links all reach switches.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

from shared import profiles
from shared.model import GpuInfo, MigSlice, NodeInfo

MIB = 1 << 20
_NVSWITCHES = 4
_MAX_MIG_DEVICES = 7


@dataclass(frozen=True)
class Handle:
    index: int
    mig: int | None = None  # the MIG device index under GPU `index`


@dataclass(frozen=True)
class GpuInstance:
    index: int
    gpu_instance_id: int


@dataclass(frozen=True)
class EventData:
    device: Handle
    eventType: int
    eventData: int
    gpuInstanceId: int = 0
    computeInstanceId: int = 0


@dataclass
class EventSet:
    masks: dict[int, int] = field(default_factory=dict)
    pending: deque[EventData] = field(default_factory=deque)


@dataclass(frozen=True)
class Telemetry:
    gpu_util: int = 0
    memory_util: int = 0
    memory_used_mib: int = 0
    temperature_c: int = 34
    power_mw: int = 70_000
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def _device_call(method: Callable[..., Any]) -> Callable[..., Any]:
    """Checks init, the handle and any injected failure before the call answers."""

    @functools.wraps(method)
    def call(self: FakeNvml, handle: Any, *args: Any, **kwargs: Any) -> Any:
        index = handle if isinstance(handle, int) else getattr(handle, "index", -1)
        self._enter(method.__name__, index)
        return method(self, handle, *args, **kwargs)

    return call


class FakeNvml:
    def __init__(self, node: NodeInfo) -> None:
        self.node = node
        self._gpus = node.gpus
        self._specs = [profiles.GPU_SPECS.get(g.model) for g in node.gpus]
        self._links = {g.index: self._wire(g) for g in node.gpus if g.nvlink_domain}
        self._telemetry = [Telemetry() for _ in node.gpus]
        self._failures: dict[tuple[str, int | None], int] = {}
        self._event_sets: list[EventSet] = []
        self._inits = 0

    @classmethod
    def from_profile(cls, profile: str, node_id: str = "fake-node", **kwargs: Any) -> FakeNvml:
        return cls(profiles.build(profile, node_id, **kwargs))

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("NVML_", "NVMLError", "nvmlEventType")):
            return getattr(pynvml, name)
        raise AttributeError(f"FakeNvml does not implement {name}")

    # --- test hooks ---------------------------------------------------------------

    def fail(self, function_name: str, gpu_index: int | None = None, code: int = pynvml.NVML_ERROR_UNKNOWN) -> None:
        """Make `function_name` raise NVMLError(code) for one GPU (None: for every call)."""
        if not callable(getattr(type(self), function_name, None)):
            raise ValueError(f"FakeNvml has no {function_name} to fail")
        self._failures[(function_name, gpu_index)] = code

    def inject_xid(self, gpu_index: int, xid: int) -> None:
        for event_set in self._event_sets:
            if event_set.masks.get(gpu_index, 0) & pynvml.nvmlEventTypeXidCriticalError:
                event_set.pending.append(EventData(Handle(gpu_index), pynvml.nvmlEventTypeXidCriticalError, xid))

    def set_telemetry(self, gpu_index: int, **values: int) -> None:
        self._telemetry[gpu_index] = dataclasses.replace(self._telemetry[gpu_index], **values)

    # --- lifecycle and system -----------------------------------------------------

    def nvmlInit(self) -> None:
        self._enter("nvmlInit", None, initialized=False)
        self._inits += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown", None)
        self._inits -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion", None)
        return self.node.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion", None)
        major, minor = (int(x) for x in self.node.cuda_version.split("."))
        return major * 1000 + minor * 10

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount", None)
        return len(self._gpus)

    @_device_call
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:
        return Handle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Handle:
        index = next((g.index for g in self._gpus if g.uuid == uuid), None)
        if index is None:
            self._enter("nvmlDeviceGetHandleByUUID", None)
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        self._enter("nvmlDeviceGetHandleByUUID", index)
        return Handle(index)

    # --- identity and capabilities ------------------------------------------------

    @_device_call
    def nvmlDeviceGetUUID(self, handle: Handle) -> str:
        return self._slice(handle).uuid if handle.mig is not None else self._gpus[handle.index].uuid

    @_device_call
    def nvmlDeviceGetName(self, handle: Handle) -> str:
        name = self._spec(handle.index).nvml_name
        return f"{name} MIG {self._slice(handle).profile}" if handle.mig is not None else name

    @_device_call
    def nvmlDeviceGetMemoryInfo(self, handle: Handle, version: int | None = None) -> pynvml.c_nvmlMemory_t:
        if handle.mig is not None:
            total, used = self._slice(handle).memory_mib * MIB, 0
        else:
            total = self._gpus[handle.index].memory_mib * MIB
            used = min(total, self._telemetry[handle.index].memory_used_mib * MIB)
        return pynvml.c_nvmlMemory_t(total=total, free=total - used, used=used)

    @_device_call
    def nvmlDeviceGetCudaComputeCapability(self, handle: Handle) -> tuple[int, int]:
        major, minor = self._gpus[handle.index].compute_capability.split(".")
        return int(major), int(minor)

    @_device_call
    def nvmlDeviceGetPciInfo(self, handle: Handle) -> pynvml.nvmlPciInfo_t:
        return _pci_info(self._gpus[handle.index].pci_bus_id)

    @_device_call
    def nvmlDeviceGetNumaNodeId(self, handle: Handle) -> int:
        numa = self._gpus[handle.index].numa_node
        if numa is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return numa

    @_device_call
    def nvmlDeviceGetEccMode(self, handle: Handle) -> list[int]:
        ecc = self._gpus[handle.index].ecc_enabled
        if ecc is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        state = pynvml.NVML_FEATURE_ENABLED if ecc else pynvml.NVML_FEATURE_DISABLED
        return [state, state]

    # --- MIG ----------------------------------------------------------------------

    @_device_call
    def nvmlDeviceGetMigMode(self, device: Handle) -> list[int]:
        gpu = self._gpus[device.index]
        if not (gpu.mig_enabled or self._spec(device.index).mig_profiles):
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if gpu.mig_enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    @_device_call
    def nvmlDeviceGetMaxMigDeviceCount(self, device: Handle) -> int:
        return _MAX_MIG_DEVICES if self._gpus[device.index].mig_enabled else 0

    @_device_call
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Handle, index: int) -> Handle:
        if not 0 <= index < len(self._gpus[device.index].mig_slices):
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return Handle(device.index, index)

    @_device_call
    def nvmlDeviceGetGpuInstanceId(self, device: Handle) -> int:
        if device.mig is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return device.mig + 1

    @_device_call
    def nvmlDeviceGetGpuInstanceById(self, device: Handle, gpuInstanceId: int) -> GpuInstance:
        if not 1 <= gpuInstanceId <= len(self._gpus[device.index].mig_slices):
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return GpuInstance(device.index, gpuInstanceId)

    @_device_call
    def nvmlGpuInstanceGetInfo(self, gpuInstance: GpuInstance) -> pynvml.c_nvmlGpuInstanceInfo_t:
        mig = self._gpus[gpuInstance.index].mig_slices[gpuInstance.gpu_instance_id - 1]
        profile = self._spec(gpuInstance.index).mig_profile(mig.profile)
        return pynvml.c_nvmlGpuInstanceInfo_t(id=gpuInstance.gpu_instance_id, profileId=profile.nvml_id)

    @_device_call
    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: Handle, profile: int, version: int = 2) -> Any:
        found = next((p for p in self._spec(device.index).mig_profiles if p.nvml_profile == profile), None)
        if found is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
        info.id, info.sliceCount, info.memorySizeMB = found.nvml_id, found.slices, found.memory_mib
        info.name = f"MIG {found.name}".encode()
        return info

    # --- NVLink -------------------------------------------------------------------

    @_device_call
    def nvmlDeviceGetNvLinkState(self, device: Handle, link: int) -> int:
        self._remote_bus(device, link)
        return pynvml.NVML_FEATURE_ENABLED

    @_device_call
    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: Handle, link: int) -> pynvml.nvmlPciInfo_t:
        return _pci_info(self._remote_bus(device, link))

    # --- telemetry ----------------------------------------------------------------

    @_device_call
    def nvmlDeviceGetUtilizationRates(self, handle: Handle) -> pynvml.c_nvmlUtilization_t:
        if self._gpus[handle.index].mig_enabled:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        t = self._telemetry[handle.index]
        return pynvml.c_nvmlUtilization_t(gpu=t.gpu_util, memory=t.memory_util)

    @_device_call
    def nvmlDeviceGetTemperature(self, handle: Handle, sensor: int) -> int:
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._telemetry[handle.index].temperature_c

    @_device_call
    def nvmlDeviceGetPowerUsage(self, handle: Handle) -> int:
        return self._telemetry[handle.index].power_mw

    @_device_call
    def nvmlDeviceGetTotalEccErrors(self, handle: Handle, errorType: int, counterType: int) -> int:
        if not self._gpus[handle.index].ecc_enabled:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        t = self._telemetry[handle.index]
        return t.ecc_corrected if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else t.ecc_uncorrected

    # --- events -------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> EventSet:
        self._enter("nvmlEventSetCreate", None)
        event_set = EventSet()
        self._event_sets.append(event_set)
        return event_set

    @_device_call
    def nvmlDeviceRegisterEvents(self, handle: Handle, eventTypes: int, eventSet: EventSet) -> None:
        eventSet.masks[handle.index] = eventSet.masks.get(handle.index, 0) | eventTypes

    def nvmlEventSetWait(self, eventSet: EventSet, timeoutms: int) -> EventData:
        """Never sleeps: with nothing pending it times out at once."""
        self._enter("nvmlEventSetWait", None)
        if not eventSet.pending:
            raise _error(pynvml.NVML_ERROR_TIMEOUT)
        return eventSet.pending.popleft()

    def nvmlEventSetFree(self, eventSet: EventSet) -> None:
        self._enter("nvmlEventSetFree", None)
        self._event_sets.remove(eventSet)

    # --- internals ----------------------------------------------------------------

    def _enter(self, name: str, index: int | None, initialized: bool = True) -> None:
        if initialized and self._inits <= 0:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        if index is not None and not 0 <= index < len(self._gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        code = self._failures.get((name, index), self._failures.get((name, None)))
        if code is not None:
            raise _error(code)

    def _spec(self, index: int) -> profiles.GpuSpec:
        gpu = self._gpus[index]
        return self._specs[index] or profiles.GpuSpec(gpu.model, gpu.model, gpu.memory_mib, gpu.compute_capability, nvlinks=12)

    def _slice(self, handle: Handle) -> MigSlice:
        return self._gpus[handle.index].mig_slices[handle.mig or 0]

    def _wire(self, gpu: GpuInfo) -> tuple[str, ...]:
        peers = [g for g in self._gpus if g.nvlink_domain == gpu.nvlink_domain and g.index != gpu.index]
        links = self._spec(gpu.index).nvlinks
        if len(peers) == 1:
            return (peers[0].pci_bus_id,) * links
        return tuple(f"00000001:{link % _NVSWITCHES:02X}:00.0" for link in range(links))

    def _remote_bus(self, device: Handle, link: int) -> str:
        links = self._links.get(device.index)
        if links is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(links):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return links[link]


def _pci_info(bus_id: str) -> pynvml.nvmlPciInfo_t:
    if not bus_id:
        return pynvml.nvmlPciInfo_t()
    domain, bus, rest = bus_id.split(":")
    return pynvml.nvmlPciInfo_t(busId=bus_id.encode(), domain=int(domain, 16), bus=int(bus, 16), device=int(rest.split(".")[0], 16))
