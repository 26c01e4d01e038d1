"""The NVML GPU inventory collector, against an NVML-shaped fake of an 8 x H100 node.

The fake follows pynvml's real API (nvidia-ml-py): the same function names and argument order,
opaque ctypes handles, the real ctypes structures as return values, strings as ``str`` (or
``bytes``, as bindings before 11.515 returned them), the C-style out-parameters of
``nvmlDeviceGetGpuInstances``, and pynvml's own NVMLError with the real error codes.
"""

from __future__ import annotations

import ctypes
import json
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pynvml
import pytest
from typer.testing import CliRunner

from proofplane.attest import Expected, Policy, verify
from proofplane.attest.simulate import SimulatedAttester, demo_boot_log
from proofplane.cli import agent as agent_cli
from proofplane.cli.main import app
from proofplane.hardware import nvml
from proofplane.hardware.skus import get_sku, layout_errors
from proofplane.model import MigInstance

MIB = 1024 * 1024
VBIOS = "96.00.99.00.01"
DRIVER = "550.54.15"


def nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


@dataclass
class FakeGpu:
    uuid: str
    serial: str = "1654922012345"
    name: str = "NVIDIA H100 80GB HBM3"
    memory_total: int = 81559 * MIB
    vbios: str = VBIOS
    bus_id: str = "00000000:18:00.0"
    ecc: tuple[int, int] = (1, 1)
    mig: tuple[int, int] = (0, 0)
    #: (gpu instance id, profile id, placement start, placement size)
    instances: list[tuple[int, int, int, int]] = field(default_factory=list)
    #: function names this GPU answers with NVML_ERROR_NOT_SUPPORTED
    not_supported: set[str] = field(default_factory=set)
    #: function name -> NVML error code it fails with
    fails: dict[str, int] = field(default_factory=dict)


# H100 GPU instance profiles by profile index (NVML_GPU_INSTANCE_PROFILE_*), as
# `nvidia-smi mig -lgip` lists them: (profile id, instance count, memory MiB, name)
H100_PROFILES = {
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: (19, 7, 9984, "MIG 1g.10gb"),
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE: (14, 3, 20096, "MIG 2g.20gb"),
    pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE: (9, 2, 40320, "MIG 3g.40gb"),
    pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE: (5, 1, 40320, "MIG 4g.40gb"),
    pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE: (0, 1, 80896, "MIG 7g.80gb"),
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: (20, 1, 9984, "MIG 1g.10gb+me"),
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1: (15, 4, 20096, "MIG 1g.20gb"),
}


class FakeNvml:
    """A stand-in for the ``pynvml`` module over a recorded node."""

    NVMLError = pynvml.NVMLError
    c_nvmlGpuInstance_t = pynvml.c_nvmlGpuInstance_t

    def __init__(self, gpus: list[FakeGpu], *, legacy_bytes: bool = False,
                 init_error: int | None = None, profiles: dict | None = None,
                 old_driver: bool = False) -> None:  # fmt: skip
        for name in dir(pynvml):
            if name.startswith(("NVML_ERROR_", "NVML_FEATURE_", "NVML_DEVICE_MIG_",
                                "NVML_GPU_INSTANCE_PROFILE_", "NVML_SUCCESS")):  # fmt: skip
                setattr(self, name, getattr(pynvml, name))
        self.gpus = gpus
        self.legacy_bytes = legacy_bytes
        self.old_driver = old_driver
        self.init_error = init_error
        self.profiles = H100_PROFILES if profiles is None else profiles
        self.initialized = 0
        self.shutdowns = 0
        self._gi_handles: dict[int, tuple[int, int, int, int, int]] = {}

    # --- helpers -------------------------------------------------------------------------------
    def _s(self, value: str) -> str | bytes:
        return value.encode() if self.legacy_bytes else value

    def _live(self) -> None:
        if not self.initialized:
            raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle: Any, fn: str) -> FakeGpu:
        self._live()
        addr = ctypes.cast(handle, ctypes.c_void_p).value or 0
        gpu = self.gpus[addr // 0x1000 - 1]
        if fn in gpu.not_supported:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if fn in gpu.fails:
            raise nvml_error(gpu.fails[fn])
        return gpu

    # --- the pynvml API ------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise nvml_error(self.init_error)
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self._live()
        self.initialized -= 1
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        self._live()
        return self._s(DRIVER)

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._live()
        return 12040

    def nvmlSystemGetNVMLVersion(self) -> str | bytes:
        self._live()
        return self._s(f"12.{DRIVER}")

    def nvmlDeviceGetCount(self) -> int:
        self._live()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._live()
        if not 0 <= index < len(self.gpus):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ctypes.cast(ctypes.c_void_p(0x1000 * (index + 1)), pynvml.c_nvmlDevice_t)

    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes:
        return self._s(self._gpu(handle, "nvmlDeviceGetUUID").uuid)

    def nvmlDeviceGetSerial(self, handle: Any) -> str | bytes:
        return self._s(self._gpu(handle, "nvmlDeviceGetSerial").serial)

    def nvmlDeviceGetName(self, handle: Any) -> str | bytes:
        return self._s(self._gpu(handle, "nvmlDeviceGetName").name)

    def nvmlDeviceGetVbiosVersion(self, handle: Any) -> str | bytes:
        return self._s(self._gpu(handle, "nvmlDeviceGetVbiosVersion").vbios)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        mem = pynvml.c_nvmlMemory_t()
        mem.total, mem.used = gpu.memory_total, 512 * MIB
        mem.free = mem.total - mem.used
        return mem

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetPciInfo")
        info = pynvml.nvmlPciInfo_t()
        info.busId = gpu.bus_id.encode()
        return info

    def nvmlDeviceGetEccMode(self, handle: Any) -> list[int]:
        return list(self._gpu(handle, "nvmlDeviceGetEccMode").ecc)

    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        return list(self._gpu(device, "nvmlDeviceGetMigMode").mig)

    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: Any, profile: int,
                                            version: int = 2) -> Any:  # fmt: skip
        gpu = self._gpu(device, "nvmlDeviceGetGpuInstanceProfileInfo")
        if gpu.mig[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if profile not in self.profiles:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        pid, count, mem, name = self.profiles[profile]
        if version == 2 and self.old_driver:  # no nvmlDeviceGetGpuInstanceProfileInfoV
            raise nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if version == 1:
            info = pynvml.c_nvmlGpuInstanceProfileInfo_t()
        else:
            info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
            info.name = name.encode()
        info.id, info.instanceCount, info.memorySizeMB = pid, count, mem
        return info

    def nvmlDeviceGetGpuInstances(self, device: Any, profileId: int, gpuInstancesRef: Any,
                                  countRef: Any) -> int:  # fmt: skip
        gpu = self._gpu(device, "nvmlDeviceGetGpuInstances")
        if profileId not in {p[0] for p in self.profiles.values()}:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        # countRef: byref(c_uint) or pointer(c_uint), as C callers pass either
        count = countRef._obj if hasattr(countRef, "_obj") else countRef.contents
        found = [i for i in gpu.instances if i[1] == profileId]
        if len(found) > len(gpuInstancesRef):
            raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        dev = ctypes.cast(device, ctypes.c_void_p).value or 0
        for k, (gi_id, pid, start, size) in enumerate(found):
            addr = 0x100000 + dev + gi_id
            self._gi_handles[addr] = (dev, gi_id, pid, start, size)
            gpuInstancesRef[k] = ctypes.cast(ctypes.c_void_p(addr), pynvml.c_nvmlGpuInstance_t)
        count.value = len(found)
        return pynvml.NVML_SUCCESS

    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> Any:
        self._live()
        addr = ctypes.cast(gpuInstance, ctypes.c_void_p).value
        if addr not in self._gi_handles:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        dev, gi_id, pid, start, size = self._gi_handles[addr]
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.device = ctypes.cast(ctypes.c_void_p(dev), pynvml.c_nvmlDevice_t)
        info.id, info.profileId = gi_id, pid
        info.placement.start, info.placement.size = start, size
        return info


def h100_node() -> list[FakeGpu]:
    """8 x H100: MIG on GPUs 2 and 5, ECC disabled on GPU 3, MIG pending on GPU 7, and the
    serial number NOT_SUPPORTED on GPU 6."""
    gpus = [FakeGpu(uuid=f"GPU-4f6c2d1a-0000-0000-0000-00000000000{i}",
                    serial=f"165492201234{i}", bus_id=f"00000000:{0x18 + i:02X}:00.0")
            for i in range(8)]  # fmt: skip
    gpus[2].mig = (1, 1)
    gpus[2].instances = [(1, 9, 0, 4), (7, 19, 4, 1), (8, 19, 5, 1)]  # 3g.40gb@0, 1g.10gb@4,5
    gpus[5].mig = (1, 1)
    gpus[5].instances = [(3, 14, 0, 2), (9, 15, 4, 2), (13, 20, 6, 1)]  # 2g@0 1g.20gb@4 +me@6
    gpus[3].ecc = (0, 0)
    gpus[6].not_supported = {"nvmlDeviceGetSerial"}
    gpus[7].mig = (0, 1)
    return gpus


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml(h100_node())


def test_collects_every_field(fake: FakeNvml):
    inv = nvml.collect(fake)
    assert fake.initialized == 0 and fake.shutdowns == 1  # NVML shut down again
    assert inv["source"] == "nvml"
    assert inv["driver_version"] == DRIVER
    assert inv["cuda_driver_version"] == "12.4"
    assert inv["nvml_version"] == f"12.{DRIVER}"
    assert inv["unsupported"] == []
    assert [g["index"] for g in inv["gpus"]] == list(range(8))
    assert inv["gpus"][0] == {
        "index": 0,
        "uuid": "GPU-4f6c2d1a-0000-0000-0000-000000000000",
        "serial": "1654922012340",
        "name": "NVIDIA H100 80GB HBM3",
        "model": "H100-80GB",
        "memory_mb": 81559,
        "pci_bus_id": "00000000:18:00.0",
        "vbios_version": VBIOS,
        "driver_version": DRIVER,
        "ecc_enabled": True,
        "ecc_pending": True,
        "mig_enabled": False,
        "mig_pending": False,
        "mig_instances": [],
        "unsupported": [],
    }
    assert inv["gpus"][3]["ecc_enabled"] is False and inv["gpus"][3]["ecc_pending"] is False
    assert inv["gpus"][7]["mig_enabled"] is False and inv["gpus"][7]["mig_pending"] is True
    json.dumps(inv)  # plain JSON, no ctypes values left


def test_mig_instances_and_placements_are_mapped_to_our_profiles(fake: FakeNvml):
    gpus = nvml.collect(fake)["gpus"]
    assert gpus[2]["mig_enabled"] is True
    assert gpus[2]["mig_instances"] == [
        {"profile": "3g.40gb", "profile_id": 9, "start": 0, "size": 4, "gpu_instance_id": 1},
        {"profile": "1g.10gb", "profile_id": 19, "start": 4, "size": 1, "gpu_instance_id": 7},
        {"profile": "1g.10gb", "profile_id": 19, "start": 5, "size": 1, "gpu_instance_id": 8},
    ]
    assert [(i["profile"], i["start"]) for i in gpus[5]["mig_instances"]] == [
        ("2g.20gb", 0), ("1g.20gb", 4), ("1g.10gb+me", 6),
    ]  # fmt: skip
    # what NVML reports is a layout our own MIG geometry accepts, by the same names
    sku = get_sku(gpus[2]["model"])
    for g in (gpus[2], gpus[5]):
        insts = [MigInstance(i["profile"], i["start"]) for i in g["mig_instances"]]
        assert layout_errors(sku, insts) == []
        for i in g["mig_instances"]:
            assert sku.profile(i["profile"]).mem_slices == i["size"]


def test_not_supported_is_null_not_a_crash(fake: FakeNvml):
    fake.gpus[4].not_supported = {"nvmlDeviceGetEccMode", "nvmlDeviceGetVbiosVersion"}
    gpus = nvml.collect(fake)["gpus"]
    assert gpus[6]["serial"] is None and gpus[6]["unsupported"] == ["serial"]
    assert gpus[6]["uuid"].startswith("GPU-") and gpus[6]["vbios_version"] == VBIOS
    assert gpus[4]["vbios_version"] is None and gpus[4]["ecc_enabled"] is None
    assert sorted(gpus[4]["unsupported"]) == ["ecc_enabled", "ecc_pending", "vbios_version"]


def test_a_gpu_without_mig_or_ecc_support():
    l40s = FakeGpu(uuid="GPU-l40s", name="NVIDIA L40S", memory_total=46068 * MIB,
                   not_supported={"nvmlDeviceGetMigMode"})  # fmt: skip
    (gpu,) = nvml.collect(FakeNvml([l40s]))["gpus"]
    assert gpu["model"] is None  # not in our SKU table
    assert gpu["mig_enabled"] is None and gpu["mig_instances"] == []
    assert sorted(gpu["unsupported"]) == ["mig_enabled", "mig_pending"]


def test_unknown_sku_profiles_keep_the_nvml_name():
    gh = FakeGpu(uuid="GPU-gh200", name="NVIDIA GH200 480GB", memory_total=97871 * MIB,
                 mig=(1, 1), instances=[(2, 19, 0, 1)])  # fmt: skip
    profiles = {pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: (19, 7, 11776, "MIG 1g.12gb")}
    (gpu,) = nvml.collect(FakeNvml([gh], profiles=profiles))["gpus"]
    assert gpu["model"] is None  # GH200 is not an H200
    assert gpu["mig_instances"] == [
        {"profile": "1g.12gb", "profile_id": 19, "start": 0, "size": 1, "gpu_instance_id": 2}
    ]


def test_bytes_from_older_bindings_read_the_same(fake: FakeNvml):
    old = FakeNvml(h100_node(), legacy_bytes=True)
    assert nvml.collect(old) == nvml.collect(fake)


def test_drivers_without_the_v2_profile_info_read_the_same(fake: FakeNvml):
    old = FakeNvml(h100_node(), old_driver=True)
    assert nvml.collect(old) == nvml.collect(fake)


@pytest.mark.parametrize(
    ("name", "memory_mb", "sku"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        ("NVIDIA H100 PCIe", 81559, "H100-80GB"),
        ("NVIDIA H100 NVL", 95830, "H100-NVL-94GB"),
        ("NVIDIA A100-SXM4-40GB", 40536, "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"),
        ("NVIDIA H200", 143771, "H200-141GB"),
        ("NVIDIA B200", 183359, "B200-180GB"),
        ("NVIDIA GH200 480GB", 97871, None),
        ("Tesla V100-SXM2-32GB", 32768, None),
        (None, None, None),
    ],
)
def test_sku_for_nvml_names(name, memory_mb, sku):
    found = nvml.sku_for(name, memory_mb)
    assert (found and found.name) == sku


def test_other_nvml_errors_raise_and_still_shut_down(fake: FakeNvml):
    fake.gpus[1].fails = {"nvmlDeviceGetVbiosVersion": pynvml.NVML_ERROR_GPU_IS_LOST}
    with pytest.raises(nvml.NvmlError, match="vbios_version: GPU is lost"):
        nvml.collect(fake)
    assert fake.initialized == 0 and fake.shutdowns == 1


def test_no_driver_is_a_clear_error():
    fake = FakeNvml(h100_node(), init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    with pytest.raises(nvml.NvmlUnavailable, match=r"libnvidia-ml\.so\.1.*driver installed"):
        nvml.collect(fake)
    fake = FakeNvml(h100_node(), init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(nvml.NvmlUnavailable, match="driver is not loaded"):
        nvml.collect(fake)


def test_the_real_bindings_without_a_driver_say_so():
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:  # a machine with a GPU driver
        pynvml.nvmlShutdown()
        inv = nvml.collect()
        assert all(g["uuid"] for g in inv["gpus"])
        return
    with pytest.raises(nvml.NvmlUnavailable, match="NVML is not available"):
        nvml.collect()


def test_missing_bindings_are_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with pytest.raises(nvml.NvmlUnavailable, match=r"pip install 'proofplane\[nvml\]'"):
        nvml.collect()


# --- the verifier reads the collected inventory ---------------------------------------------
def _verdict(inventory: dict | None, **policy: Any):
    node = SimulatedAttester.create()
    node.boot(demo_boot_log(b"vmlinuz-6.1"))
    nonce = b"\x07" * 32
    ev = node.evidence(nonce, list(range(10)), inventory=inventory)
    now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    exp = Expected(nonce, now, node.ak_public, node.ek_public)
    return verify(ev, exp, Policy(id="gpu", require_secure_boot=False, **policy), now)


def test_collected_inventory_passes_the_gpu_allow_list(fake: FakeNvml):
    inv = nvml.collect(fake)
    ok = _verdict(inv, allowed_vbios=frozenset({VBIOS}), min_driver="550.54.0")
    assert ok.ok, ok.reasons
    old = _verdict(inv, allowed_vbios=frozenset({VBIOS}), min_driver="555.0")
    assert list(old.reasons) == ["driver_too_old"]
    fake.gpus[4].vbios = "96.00.30.00.01"
    fake.gpus[6].not_supported = {"nvmlDeviceGetVbiosVersion"}  # null VBIOS: fail-closed
    bad = _verdict(nvml.collect(fake), allowed_vbios=frozenset({VBIOS}))
    assert list(bad.reasons) == ["vbios_not_allowed"]
    msg = bad.messages["vbios_not_allowed"]
    assert "96.00.30.00.01" in msg and "None" in msg


# --- the agent ------------------------------------------------------------------------------
runner = CliRunner()


def test_agent_collect_inventory_prints_json(monkeypatch, fake: FakeNvml):
    monkeypatch.setattr(nvml, "load", lambda: fake)
    result = runner.invoke(app, ["agent", "--collect-inventory"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == nvml.collect(fake)


def test_agent_collect_inventory_without_nvml_fails_clearly(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    result = runner.invoke(app, ["agent", "--collect-inventory"])
    assert result.exit_code == 1
    assert "proofplane[nvml]" in result.stderr and "Traceback" not in result.output


def test_agent_attesting_needs_server_token_and_node():
    result = runner.invoke(app, ["agent", "--once"], env={"PROOFPLANE_SERVER": ""})
    assert result.exit_code == 2
    assert "missing --server, --token, --node" in result.stderr


def test_agent_inventory_each_round(tmp_path, fake: FakeNvml, capsys):
    # a recording is replayed as it is
    rec = tmp_path / "inv.json"
    rec.write_text(json.dumps({"gpus": []}))
    assert agent_cli.gpu_inventory(rec, fake) == {"gpus": []}
    # otherwise NVML is read
    assert agent_cli.gpu_inventory(None, fake) == nvml.collect(fake)
    # no NVML: nothing is sent, and stderr says why (the server's policy decides)
    gone = FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    assert agent_cli.gpu_inventory(None, gone) is None
    assert "sending no GPU inventory: NVML is not available" in capsys.readouterr().err
    assert list(_verdict(None, allowed_vbios=frozenset({VBIOS})).reasons) == ["inventory_missing"]
