"""An NVML-shaped fake of an 8 x H100 node, for the collector's tests and the agent's.

It follows pynvml's real API (nvidia-ml-py): the same function names and argument order,
opaque ctypes handles, the real ctypes structures as return values, strings as ``str`` (or
``bytes``, as bindings before 11.515 returned them), the C-style out-parameters of
``nvmlDeviceGetGpuInstances``, and pynvml's own NVMLError with the real error codes.
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
