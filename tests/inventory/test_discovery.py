"""GPU discovery: the NVML backend, run on the pynvml fake, reports what the profiles say."""

from __future__ import annotations

import inspect
import os
import re

import pynvml
import pytest

from shared import profiles
from services.inventory.discovery import (
    GpuSample,
    NvmlUnavailable,
    XidEvent,
    discover_nvml,
    model_name,
    poll_xid_events,
    register_xid_events,
    sample_telemetry,
)
from services.inventory.nvml_fake import FakeNvml
from shared.model import NodeInfo

MIG_LAYOUTS = {
    "hgx-a100-40gb+mig": ("hgx-a100-40gb", {0: ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"], 5: ["7g.40gb"], 6: []}),
    "dgx-h100+mig": ("dgx-h100", {7: ["1g.10gb"] * 7}),
    "a100-pcie-2x2+mig": ("a100-pcie-2x2", {3: ["4g.20gb", "1g.10gb"]}),
}


def node(profile: str, node_id: str = "n-1", **kwargs) -> NodeInfo:
    return profiles.build(profile, node_id, labels={"pool": "train"}, rack="r1", zone="z1", **kwargs)


def discover(fake: FakeNvml) -> NodeInfo:
    n = fake.node
    return discover_nvml(
        fake,
        node_id=n.node_id,
        labels=n.labels,
        rack=n.rack,
        zone=n.zone,
        cpu_milli=n.cpu_milli,
        memory_mib=n.memory_mib,
        hostname=n.hostname,
    )


def domains(info: NodeInfo) -> list[list[int]]:
    by_domain: dict[str, list[int]] = {}
    for g in info.gpus:
        if g.nvlink_domain:
            by_domain.setdefault(g.nvlink_domain, []).append(g.index)
    return sorted(by_domain.values())


# --- the NVML backend agrees with the profiles ---------------------------------------


@pytest.mark.parametrize("profile", sorted(profiles.PROFILES))
def test_nvml_discovery_reports_exactly_the_profile(profile):
    expected = node(profile)
    assert discover(FakeNvml(expected)) == expected


@pytest.mark.parametrize("layout", sorted(MIG_LAYOUTS))
def test_nvml_discovery_reports_exactly_the_profile_with_mig(layout):
    profile, mig = MIG_LAYOUTS[layout]
    expected = node(profile, mig=mig)
    assert discover(FakeNvml(expected)) == expected


# Written out by hand from NVIDIA's published figures (what nvidia-smi shows on such a box), not from the profiles:
# the name NVML gives, the memory it reports in MiB, the compute capability.
BY_HAND = {
    "dgx-h100": (8, "NVIDIA H100 80GB HBM3", "H100-80GB", 81559, "9.0", ["1B", "43", "52", "61", "9D", "C3", "D1", "DF"]),
    "t4-4x": (4, "Tesla T4", "T4", 15360, "7.5", ["18", "3B", "86", "AF"]),
}


@pytest.mark.parametrize("profile", sorted(BY_HAND))
def test_nvml_discovery_names_memory_and_bus_ids_as_nvidia_smi_shows_them(profile):
    count, nvml_name, model, memory_mib, cc, buses = BY_HAND[profile]
    fake = FakeNvml(node(profile))
    fake.nvmlInit()
    assert fake.nvmlDeviceGetName(fake.nvmlDeviceGetHandleByIndex(0)) == nvml_name
    fake.nvmlShutdown()
    info = discover(fake)
    assert [g.index for g in info.gpus] == list(range(count))
    assert {(g.model, g.memory_mib, g.compute_capability) for g in info.gpus} == {(model, memory_mib, cc)}
    assert [g.pci_bus_id for g in info.gpus] == [f"00000000:{b}:00.0" for b in buses]
    assert len({g.uuid for g in info.gpus}) == count and all(g.uuid.startswith("GPU-") for g in info.gpus)


# --- NVLink topology -----------------------------------------------------------------


@pytest.mark.parametrize("profile", ["dgx-h100", "hgx-a100-40gb"])
def test_an_nvswitch_box_is_one_nvlink_domain(profile):
    info = discover(FakeNvml(node(profile)))
    assert domains(info) == [list(range(8))]
    for g in info.gpus:
        assert set(g.nvlink_peers) == {o.uuid for o in info.gpus} - {g.uuid}


def test_two_nvlink_pairs_are_two_domains():
    info = discover(FakeNvml(node("a100-pcie-2x2")))
    assert domains(info) == [[0, 1], [2, 3]]
    g = info.gpus
    assert (g[0].nvlink_peers, g[1].nvlink_peers, g[2].nvlink_peers) == ((g[1].uuid,), (g[0].uuid,), (g[3].uuid,))


@pytest.mark.parametrize("profile", ["l4-8x", "t4-4x"])
def test_a_pcie_box_has_no_nvlink_domain(profile):
    info = discover(FakeNvml(node(profile)))
    assert all(g.nvlink_domain is None and g.nvlink_peers == () for g in info.gpus)
    assert all(g.error is None for g in info.gpus)


def test_nvlink_domains_are_named_per_node():
    a, b = discover(FakeNvml(node("dgx-h100", "n-a"))), discover(FakeNvml(node("dgx-h100", "n-b")))
    assert {g.nvlink_domain for g in a.gpus}.isdisjoint({g.nvlink_domain for g in b.gpus})


# --- a failing query marks one GPU, the node still registers ------------------------


def test_a_failing_query_marks_that_gpu_and_discovery_carries_on():
    fake = FakeNvml(node("dgx-h100"))
    fake.fail("nvmlDeviceGetPciInfo", 3, pynvml.NVML_ERROR_GPU_IS_LOST)
    info = discover(fake)
    assert len(info.gpus) == 8
    sick = info.gpus[3]
    assert sick.error == "nvmlDeviceGetPciInfo: GPU is lost"
    assert sick.pci_bus_id == "" and sick.healthy and sick.uuid == fake.node.gpus[3].uuid
    assert [g.error for g in info.gpus if g.index != 3] == [None] * 7
    assert domains(info) == [list(range(8))]


def test_a_gpu_whose_identity_is_unknown_is_unhealthy():
    fake = FakeNvml(node("l4-8x"))
    fake.fail("nvmlDeviceGetUUID", 2)
    info = discover(fake)
    sick = info.gpus[2]
    assert not sick.healthy and sick.error == "nvmlDeviceGetUUID: Unknown Error"
    assert sick.uuid == "unknown:n-1:2" and sick.model == "L4"
    assert all(g.healthy for g in info.gpus if g.index != 2)


def test_a_gpu_without_a_handle_is_listed_unhealthy():
    fake = FakeNvml(node("t4-4x"))
    fake.fail("nvmlDeviceGetHandleByIndex", 1, pynvml.NVML_ERROR_GPU_IS_LOST)
    info = discover(fake)
    assert [g.index for g in info.gpus] == [0, 1, 2, 3]
    assert not info.gpus[1].healthy and "GPU is lost" in info.gpus[1].error


def test_a_failing_nvlink_query_is_reported_not_mistaken_for_pcie():
    fake = FakeNvml(node("a100-pcie-2x2"))
    fake.fail("nvmlDeviceGetNvLinkState", 0)
    info = discover(fake)
    assert info.gpus[0].error == "nvmlDeviceGetNvLinkState: Unknown Error"
    assert domains(info) == [[0, 1], [2, 3]]
    assert (info.gpus[0].nvlink_peers, info.gpus[1].nvlink_peers) == ((info.gpus[1].uuid,), (info.gpus[0].uuid,))


def test_a_gpu_whose_bus_is_unknown_keeps_its_nvlink_pair():
    fake = FakeNvml(node("a100-pcie-2x2"))
    fake.fail("nvmlDeviceGetPciInfo", 0)
    info = discover(fake)
    assert domains(info) == [[0, 1], [2, 3]]
    assert info.gpus[1].nvlink_peers == (info.gpus[0].uuid,)


def test_no_driver_is_a_clear_error():
    fake = FakeNvml(node("t4-4x"))
    fake.fail("nvmlInit", code=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        discover(fake)


def test_discovery_releases_nvml():
    fake = FakeNvml(node("t4-4x"))
    discover(fake)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()


def test_host_cpu_and_memory_are_read_when_not_given():
    info = discover_nvml(FakeNvml(node("t4-4x")), node_id="n-1")
    assert info.cpu_milli == (os.cpu_count() or 0) * 1000
    assert info.memory_mib > 0


# --- MIG -----------------------------------------------------------------------------


def test_mig_slices_are_discovered_with_their_profiles():
    info = discover(FakeNvml(node("hgx-a100-40gb", mig=MIG_LAYOUTS["hgx-a100-40gb+mig"][1])))
    gpu0 = info.gpus[0]
    assert gpu0.mig_enabled
    assert [(s.profile, s.memory_mib) for s in gpu0.mig_slices] == [
        ("3g.20gb", 19968),
        ("2g.10gb", 9856),
        ("1g.5gb", 4864),
        ("1g.5gb", 4864),
    ]
    assert all(re.fullmatch(r"MIG-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", s.uuid) for s in gpu0.mig_slices)
    assert info.gpus[6].mig_enabled and info.gpus[6].mig_slices == ()
    assert not info.gpus[1].mig_enabled


@pytest.mark.parametrize(
    "profile, mig, message",
    [
        ("l4-8x", {0: ["1g.10gb"]}, "no MIG"),
        ("hgx-a100-40gb", {0: ["1g.20gb"]}, "no MIG profile '1g.20gb'"),
        ("hgx-a100-40gb", {0: ["4g.20gb", "4g.20gb"]}, "compute slices"),
        ("a100-pcie-2x2", {4: ["1g.5gb"]}, "no GPU 4"),
    ],
    ids=["gpu-without-mig", "profile-of-another-gpu", "too-many-slices", "no-such-gpu"],
)
def test_a_profile_refuses_an_impossible_mig_layout(profile, mig, message):
    with pytest.raises(ValueError, match=message):
        profiles.build(profile, "n-1", mig=mig)


# --- profiles ------------------------------------------------------------------------


def test_gpu_uuids_are_stable_per_node_and_distinct_across_nodes():
    a, again, b = node("dgx-h100", "n-a"), node("dgx-h100", "n-a"), node("dgx-h100", "n-b")
    assert [g.uuid for g in a.gpus] == [g.uuid for g in again.gpus]
    assert {g.uuid for g in a.gpus}.isdisjoint(g.uuid for g in b.gpus)
    assert len({g.uuid for g in a.gpus}) == 8
    assert all(re.fullmatch(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", g.uuid) for g in a.gpus)


def test_the_dgx_h100_profile():
    info = node("dgx-h100")
    assert {(g.model, g.memory_mib, g.compute_capability) for g in info.gpus} == {("H100-80GB", 81559, "9.0")}
    assert (info.cpu_milli, info.memory_mib) == (224_000, 2 * 1024 * 1024)
    assert sorted({g.numa_node for g in info.gpus}) == [0, 1]


def test_an_unknown_profile_names_the_known_ones():
    with pytest.raises(profiles.UnknownProfile, match="dgx-h100"):
        profiles.build("dgx-h200", "n-1")


@pytest.mark.parametrize(
    "nvml_name, model",
    [
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-PCIE-40GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB-PCIe"),
        ("NVIDIA L4", "L4"),
        ("Tesla T4", "T4"),
        ("NVIDIA Tesla V100-SXM2-16GB", "V100-SXM2-16GB"),
    ],
)
def test_model_names_drop_vendor_and_memory_kind(nvml_name, model):
    assert model_name(nvml_name) == model


# --- telemetry and XID ---------------------------------------------------------------


def test_telemetry_samples_what_each_gpu_reports():
    fake = FakeNvml(node("l4-8x"))
    fake.set_telemetry(2, gpu_util=93, memory_util=41, memory_used_mib=20_000, temperature_c=71, power_mw=68_500, ecc_corrected=3)
    fake.nvmlInit()
    samples = sample_telemetry(fake, fake.node)
    assert len(samples) == 8
    assert samples[2] == GpuSample(
        uuid=fake.node.gpus[2].uuid,
        index=2,
        gpu_util_pct=93,
        memory_util_pct=41,
        memory_used_mib=20_000,
        memory_free_mib=fake.node.gpus[2].memory_mib - 20_000,
        temperature_c=71,
        power_mw=68_500,
        ecc_corrected=3,
        ecc_uncorrected=0,
    )


def test_telemetry_marks_a_gpu_whose_query_fails():
    fake = FakeNvml(node("t4-4x"))
    fake.fail("nvmlDeviceGetPowerUsage", 1, pynvml.NVML_ERROR_GPU_IS_LOST)
    fake.nvmlInit()
    samples = sample_telemetry(fake, fake.node)
    assert samples[1].power_mw is None and samples[1].error == "nvmlDeviceGetPowerUsage: GPU is lost"
    assert samples[1].temperature_c is not None
    assert [s.error for s in samples if s.index != 1] == [None] * 3


def test_telemetry_of_a_mig_gpu_has_no_utilization():
    fake = FakeNvml(node("hgx-a100-40gb", mig={0: ["7g.40gb"]}))
    fake.nvmlInit()
    sample = sample_telemetry(fake, fake.node)[0]
    assert sample.gpu_util_pct is None and sample.error is None


def test_an_injected_xid_reaches_the_watcher_once():
    fake = FakeNvml(node("dgx-h100"))
    fake.nvmlInit()
    watch = register_xid_events(fake, fake.node)
    fake.inject_xid(3, 79)
    fake.inject_xid(5, 48)
    uuids = [g.uuid for g in fake.node.gpus]
    assert poll_xid_events(fake, watch, timeout_ms=100) == [XidEvent(uuids[3], 79), XidEvent(uuids[5], 48)]
    assert poll_xid_events(fake, watch, timeout_ms=100) == []


def test_an_xid_on_an_unwatched_gpu_is_not_seen():
    fake = FakeNvml(node("t4-4x"))
    fake.nvmlInit()
    watch = fake.nvmlEventSetCreate()
    fake.nvmlDeviceRegisterEvents(fake.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlEventTypeXidCriticalError, watch)
    fake.inject_xid(1, 31)
    assert poll_xid_events(fake, watch, timeout_ms=0) == []


# --- the fake stays honest -----------------------------------------------------------


def test_the_fake_has_pynvml_signatures():
    fake = FakeNvml(node("t4-4x"))
    calls = [name for name in dir(FakeNvml) if name.startswith("nvml")]
    assert len(calls) >= 30
    for name in calls:
        real = inspect.signature(getattr(pynvml, name))
        assert inspect.signature(getattr(fake, name)).parameters.keys() == real.parameters.keys(), name


def test_the_fake_uses_pynvml_constants_and_refuses_what_it_does_not_implement():
    fake = FakeNvml(node("t4-4x"))
    assert fake.NVML_ERROR_NOT_SUPPORTED == pynvml.NVML_ERROR_NOT_SUPPORTED and fake.NVMLError is pynvml.NVMLError
    with pytest.raises(AttributeError):
        fake.nvmlDeviceGetClockInfo
    with pytest.raises(ValueError):
        fake.fail("nvmlDeviceGetClockInfo", 0)
