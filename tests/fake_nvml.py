"""An NVML-shaped fake of an 8 x H100 node, for the collector's tests and the agent's.

It follows pynvml's real API (nvidia-ml-py): the same function names and argument order,
opaque ctypes handles, the real ctypes structures as return values, strings as ``str`` (or
``bytes``, as bindings before 11.515 returned them), the C-style out-parameters of
``nvmlDeviceGetGpuInstances``, and pynvml's own NVMLError with the real error codes.

The telemetry calls (issue 15) answer from each GPU's readings (``util``, ``power_mw``,
``energy_mj``, ``temp``, ECC counts, remapped rows, PCIe throughput, thermal violation time,
pending ``xids``): utilisation is NOT_SUPPORTED in MIG mode and ECC counts when ECC is off,
as on a real GPU; MIG devices (``nvmlDeviceGetMigDeviceHandleByIndex``) are the GPU's
instances; GPM samples (``nvmlGpmSampleGet``/``nvmlGpmMigSampleGet``) snapshot ``gpm`` (per
GPU) or ``gpm_mig`` (per GPU instance ID) and ``nvmlGpmMetricsGet`` answers the second sample's
values (NOT_SUPPORTED for a metric not in it).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import pynvml

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
    # --- telemetry readings -----------------------------------------------------------------
    util: int = 37  # percent
    power_mw: int = 312_500
    energy_mj: int = 1_000_000_000
    temp: int = 55
    ecc_errors: tuple[int, int] = (0, 0)  # volatile (corrected, uncorrected)
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)  # corr, unc, pending, failure
    pcie_kb: tuple[int, int] = (1000, 2000)  # tx, rx KB/s
    violation_ns: int = 0
    xids: list[int] = field(default_factory=list)  # pending XID events
    #: GPM metric id -> value (None: the GPU has no GPM, as before Hopper)
    gpm: dict[int, float] | None = field(
        default_factory=lambda: {1: 42.0, 2: 40.0, 10: 20.0, 20: 100.0, 21: 200.0, 60: 300.0,
                                 61: 400.0}
    )  # fmt: skip
    #: GPU instance id -> GPM metric id -> value
    gpm_mig: dict[int, dict[int, float]] = field(default_factory=dict)
    #: GPU instance id -> MiB used
    mig_fb_used: dict[int, int] = field(default_factory=dict)
    #: multi-node NVLink fabric: (cluster UUID bytes, clique id, state); None: NOT_SUPPORTED
    fabric: tuple[bytes, int, int] | None = None


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
    nvmlMemory_v2 = pynvml.nvmlMemory_v2
    c_nvmlGpuInstance_t = pynvml.c_nvmlGpuInstance_t
    c_nvmlGpmMetricsGet_t = pynvml.c_nvmlGpmMetricsGet_t
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError
    c_nvmlGpuFabricInfo_t = pynvml.c_nvmlGpuFabricInfo_t
    NVML_GPU_FABRIC_STATE_COMPLETED = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED

    def __init__(self, gpus: list[FakeGpu], *, legacy_bytes: bool = False,
                 init_error: int | None = None, profiles: dict | None = None,
                 old_driver: bool = False) -> None:  # fmt: skip
        for name in dir(pynvml):
            if name.startswith(("NVML_ERROR_", "NVML_FEATURE_", "NVML_DEVICE_MIG_",
                                "NVML_GPU_INSTANCE_PROFILE_", "NVML_SUCCESS",
                                "NVML_TEMPERATURE_", "NVML_MEMORY_ERROR_TYPE_",
                                "NVML_VOLATILE_ECC", "NVML_PERF_POLICY_", "NVML_PCIE_UTIL_",
                                "NVML_GPM_")):  # fmt: skip
                setattr(self, name, getattr(pynvml, name))
        self.gpus = gpus
        self.legacy_bytes = legacy_bytes
        self.old_driver = old_driver
        self.init_error = init_error
        self.profiles = H100_PROFILES if profiles is None else profiles
        self.initialized = 0
        self.shutdowns = 0
        self._gi_handles: dict[int, tuple[int, int, int, int, int]] = {}
        self._mig_handles: dict[int, tuple[int, int]] = {}  # addr -> (GPU index, GI id)
        self._event_sets: dict[int, set[int]] = {}  # addr -> GPU indexes registered
        self._gpm_samples: dict[int, dict[int, float] | None] = {}  # addr -> snapshot
        self._next_addr = 0x800000

    # --- helpers -------------------------------------------------------------------------------
    def _s(self, value: str) -> str | bytes:
        return value.encode() if self.legacy_bytes else value

    def _live(self) -> None:
        if not self.initialized:
            raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)

    def _addr(self, handle: Any) -> int:
        return ctypes.cast(handle, ctypes.c_void_p).value or 0

    def _new_addr(self) -> int:
        self._next_addr += 0x10
        return self._next_addr

    def _gpu(self, handle: Any, fn: str) -> FakeGpu:
        self._live()
        addr = self._addr(handle)
        if addr in self._mig_handles:
            addr = 0x1000 * (self._mig_handles[addr][0] + 1)
        if not 0 < addr // 0x1000 <= len(self.gpus) or addr % 0x1000:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
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

    def nvmlDeviceGetGpuFabricInfo(self, handle: Any, info_ref: Any) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetGpuFabricInfo")
        if gpu.fabric is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = info_ref._obj
        uuid, clique, state = gpu.fabric
        ctypes.memmove(info.clusterUuid, uuid, 16)
        info.cliqueId, info.state, info.status = clique, state, 0
        return pynvml.NVML_SUCCESS

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
        mig = self._mig_handles.get(self._addr(handle))
        if mig is not None:  # a MIG device: its GPU instance's memory
            gi = mig[1]
            size = next(i[3] for i in gpu.instances if i[0] == gi)
            mem.total = size * (gpu.memory_total // 8)
            mem.used = gpu.mig_fb_used.get(gi, 1024) * MIB
            mem.free = mem.total - mem.used
            return mem
        if version == pynvml.nvmlMemory_v2:  # v2: the driver's reserve counted apart
            v2 = pynvml.c_nvmlMemory_v2_t()
            v2.version, v2.total, v2.reserved = version, gpu.memory_total, 480 * MIB
            v2.used = 32 * MIB
            v2.free = v2.total - v2.reserved - v2.used
            return v2
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

    # --- telemetry (issue 15) ------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetUtilizationRates")
        if gpu.mig[0] == pynvml.NVML_DEVICE_MIG_ENABLE:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        util = pynvml.c_nvmlUtilization_t()
        util.gpu, util.memory = gpu.util, gpu.util // 2
        return util

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetTotalEnergyConsumption").energy_mj

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTemperature")
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.temp

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTotalEccErrors")
        if gpu.ecc[0] != pynvml.NVML_FEATURE_ENABLED:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.ecc_errors[1 if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else 0]

    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        return self._gpu(device, "nvmlDeviceGetRemappedRows").remapped

    def nvmlDeviceGetPcieThroughput(self, device: Any, counter: int) -> int:
        return self._gpu(device, "nvmlDeviceGetPcieThroughput").pcie_kb[counter]

    def nvmlDeviceGetViolationStatus(self, device: Any, perfPolicyType: int) -> Any:
        gpu = self._gpu(device, "nvmlDeviceGetViolationStatus")
        out = pynvml.c_nvmlViolationTime_t()
        out.referenceTime, out.violationTime = 10**12, gpu.violation_ns
        return out

    def nvmlEventSetCreate(self) -> Any:
        self._live()
        addr = self._new_addr()
        self._event_sets[addr] = set()
        return ctypes.cast(ctypes.c_void_p(addr), pynvml.c_nvmlEventSet_t)

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        self._gpu(handle, "nvmlDeviceRegisterEvents")
        self._event_sets[self._addr(eventSet)].add(self._addr(handle) // 0x1000 - 1)

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        self._live()
        for index in sorted(self._event_sets[self._addr(eventSet)]):
            if self.gpus[index].xids:
                data = pynvml.c_nvmlEventData_t()
                data.device = self.nvmlDeviceGetHandleByIndex(index)
                data.eventType = pynvml.nvmlEventTypeXidCriticalError
                data.eventData = self.gpus[index].xids.pop(0)
                return data
        raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        self._event_sets.pop(self._addr(eventSet), None)

    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        gpu = self._gpu(device, "nvmlDeviceGetMaxMigDeviceCount")
        return 7 if gpu.mig[0] == pynvml.NVML_DEVICE_MIG_ENABLE else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        gpu = self._gpu(device, "nvmlDeviceGetMigDeviceHandleByIndex")
        if not 0 <= index < len(gpu.instances):
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        dev = self._addr(device)
        addr = 0x400000 + dev + index
        self._mig_handles[addr] = (dev // 0x1000 - 1, gpu.instances[index][0])
        return ctypes.cast(ctypes.c_void_p(addr), pynvml.c_nvmlDevice_t)

    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        self._live()
        mig = self._mig_handles.get(self._addr(device))
        if mig is None:  # not a MIG device
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return mig[1]

    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> Any:
        gpu = self._gpu(device, "nvmlDeviceGetGpuInstanceById")
        dev = self._addr(device)
        for gi_id, pid, start, size in gpu.instances:
            if gi_id == gpuInstanceId:
                addr = 0x100000 + dev + gi_id
                self._gi_handles[addr] = (dev, gi_id, pid, start, size)
                return ctypes.cast(ctypes.c_void_p(addr), pynvml.c_nvmlGpuInstance_t)
        raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlGpmQueryDeviceSupport(self, device: Any) -> Any:
        gpu = self._gpu(device, "nvmlGpmQueryDeviceSupport")
        out = pynvml.c_nvmlGpmSupport_t()
        out.version, out.isSupportedDevice = 1, int(gpu.gpm is not None)
        return out

    def nvmlGpmSampleAlloc(self) -> Any:
        self._live()
        addr = self._new_addr()
        self._gpm_samples[addr] = None
        return ctypes.cast(ctypes.c_void_p(addr), pynvml.c_nvmlGpmSample_t)

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        self._gpm_samples.pop(self._addr(gpmSample), None)

    def nvmlGpmSampleGet(self, device: Any, gpmSample: Any) -> Any:
        gpu = self._gpu(device, "nvmlGpmSampleGet")
        if gpu.gpm is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self._gpm_samples[self._addr(gpmSample)] = dict(gpu.gpm)
        return gpmSample

    def nvmlGpmMigSampleGet(self, device: Any, gpuInstanceId: int, gpmSample: Any) -> Any:
        gpu = self._gpu(device, "nvmlGpmMigSampleGet")
        if gpu.gpm is None or gpuInstanceId not in {i[0] for i in gpu.instances}:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self._gpm_samples[self._addr(gpmSample)] = dict(gpu.gpm_mig.get(gpuInstanceId, {}))
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        self._live()
        first = self._gpm_samples.get(self._addr(metricsGet.sample1))
        second = self._gpm_samples.get(self._addr(metricsGet.sample2))
        if first is None or second is None:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for k in range(metricsGet.numMetrics):
            m = metricsGet.metrics[k]
            if m.metricId in second:
                m.value, m.nvmlReturn = second[m.metricId], pynvml.NVML_SUCCESS
            else:
                m.value, m.nvmlReturn = 0.0, pynvml.NVML_ERROR_NOT_SUPPORTED
        return metricsGet


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
