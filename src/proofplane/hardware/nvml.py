"""The node's GPU inventory read through NVML (``pynvml``, from the ``nvidia-ml-py`` package).

:func:`collect` returns the JSON object the node agent sends as ``evidence.inventory`` and that
the verifier's firmware allow-list reads (``gpus[*].vbios_version``, ``driver_version``)::

    {"source": "nvml", "driver_version": "550.54.15", "cuda_driver_version": "12.4",
     "nvml_version": "12.550.54.15",
     "gpus": [{"index": 0, "uuid": "GPU-…", "serial": "…", "name": "NVIDIA H100 80GB HBM3",
               "model": "H100-80GB", "memory_mb": 81559, "pci_bus_id": "00000000:18:00.0",
               "vbios_version": "96.00.99.00.01", "driver_version": "550.54.15",
               "ecc_enabled": true, "ecc_pending": true,
               "mig_enabled": true, "mig_pending": true,
               "mig_instances": [{"profile": "3g.40gb", "profile_id": 9, "start": 0, "size": 4,
                                  "gpu_instance_id": 2}],
               "unsupported": []}]}

The per-GPU keys follow :class:`proofplane.model.Gpu` (``index``, ``uuid``, ``model``,
``memory_mb``, ``mig_enabled``, ``mig_instances`` with ``profile`` and ``start``,
``vbios_version``, ``driver_version``). ``model`` is our SKU name (None for a GPU the SKU table
does not know) and MIG instance profiles are named from that table by their NVML profile ID,
falling back to the name NVML reports. A query the GPU answers with NVML_ERROR_NOT_SUPPORTED
gives null and its key is listed in ``unsupported``: a null VBIOS fails an allow-list, so
this stays fail-closed. Any other NVML error raises :class:`NvmlError`.

``pynvml`` is imported lazily: the control plane never needs it, and on a node without the
package or the driver :func:`collect` raises :class:`NvmlUnavailable` with what to install.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
from collections.abc import Callable
from typing import Any, TypeVar

from proofplane.errors import ProofplaneError
from proofplane.hardware.skus import SKUS, Sku

T = TypeVar("T")

#: How many GPU instance profile indexes to probe when the module does not say
#: (``NVML_GPU_INSTANCE_PROFILE_COUNT``; 8 in the oldest bindings with MIG).
_DEFAULT_PROFILE_COUNT = 8
#: Errors meaning "this profile index does not exist on this GPU" while probing profiles.
_NO_PROFILE_ERRORS = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT",
                      "NVML_ERROR_NOT_FOUND")  # fmt: skip
_UNAVAILABLE_ERRORS = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": "the NVML library (libnvidia-ml.so.1) was not found: "
    "is the NVIDIA driver installed?",
    "NVML_ERROR_DRIVER_NOT_LOADED": "the NVIDIA driver is not loaded",
    "NVML_ERROR_NO_PERMISSION": "no permission to use NVML",
    "NVML_ERROR_FUNCTION_NOT_FOUND": "the NVML library is too old for these bindings",
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": "the NVML library and the kernel driver differ "
    "in version (reboot after a driver upgrade?)",
}


class NvmlError(ProofplaneError):
    """NVML answered with an error the collector cannot turn into a null field."""

    code = "nvml_error"


class NvmlUnavailable(NvmlError):
    """No NVML here: ``nvidia-ml-py`` is not installed, or there is no (working) driver."""

    code = "nvml_unavailable"


def load() -> Any:
    """The ``pynvml`` module; NvmlUnavailable when the package is not installed."""
    try:
        import pynvml
    except ImportError:
        raise NvmlUnavailable(
            "the NVML bindings are not installed: pip install 'proofplane[nvml]' "
            "(the nvidia-ml-py package)"
        ) from None
    return pynvml


def collect(nvml: Any = None) -> dict[str, Any]:
    """Read the GPU inventory through NVML (``nvml``: the ``pynvml`` module or an object with
    its API; default: import ``pynvml``). Initializes NVML and always shuts it down again."""
    nv = load() if nvml is None else nvml
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        name = _error_name(nv, exc)
        why = _UNAVAILABLE_ERRORS.get(name or "", f"nvmlInit failed: {exc}")
        raise NvmlUnavailable(f"NVML is not available: {why}") from None
    try:
        return _Collector(nv).inventory()
    finally:
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlShutdown()


def topology_from_gpus(gpus: list[dict[str, Any]]) -> dict[str, str]:
    """The node's ``nvlink_domain`` (issue 17 §4) from its GPUs' fabric info: when every GPU
    sits in the same NVLink cluster and clique, ``{"nvlink_domain": "nvl-<cluster>-<clique>"}``
    (a node name-safe label, the same on every node of that NVLink domain); else nothing."""
    fabrics = {(g["fabric"]["cluster_uuid"], g["fabric"]["clique_id"]) for g in gpus
               if g.get("fabric")}  # fmt: skip
    if len(fabrics) != 1 or any(not g.get("fabric") for g in gpus):
        return {}
    cluster, clique = fabrics.pop()
    return {"nvlink_domain": f"nvl-{cluster}-{clique}"}


def sku_for(name: str | None, memory_mb: int | None) -> Sku | None:
    """Our SKU for an NVML device name (``NVIDIA H100 80GB HBM3``, ``NVIDIA A100-SXM4-40GB``):
    the SKU whose family (``H100``) the name contains, nearest in memory size."""
    if not name:
        return None
    upper = name.upper()
    # whole words only: "GH200" (Grace Hopper) is not an H200
    found = [s for s in SKUS.values() if re.search(rf"\b{s.name.split('-')[0]}\b", upper)]
    if not found:
        return None
    if "NVL" in upper and any("NVL" in s.name for s in found):
        found = [s for s in found if "NVL" in s.name]
    return min(found, key=lambda s: abs(s.memory_mb - (memory_mb or s.memory_mb)))


def _error_name(nv: Any, exc: BaseException) -> str | None:
    """The ``NVML_ERROR_*`` constant name of an NVMLError's code (None if unknown)."""
    value = getattr(exc, "value", None)
    for name in dir(nv):
        if name.startswith("NVML_ERROR_") and getattr(nv, name) == value:
            return str(name)
    return None


def _text(value: Any) -> str | None:
    """NVML strings: ``str`` in current bindings, ``bytes`` in older ones (before 11.515)."""
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        value = bytes(value).split(b"\0", 1)[0].decode("utf-8", "replace")
    return str(value).strip()


def _on(value: Any, enabled: int) -> bool | None:
    return None if value is None else int(value) == enabled


class _Collector:
    def __init__(self, nv: Any) -> None:
        self.nv = nv
        self.not_supported = getattr(nv, "NVML_ERROR_NOT_SUPPORTED", 3)
        self.no_profile = {getattr(nv, n) for n in _NO_PROFILE_ERRORS if hasattr(nv, n)}

    def call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``; an NVMLError becomes NvmlError naming ``what``."""
        try:
            return fn(*args)
        except self.nv.NVMLError as exc:
            raise NvmlError(f"NVML {what}: {exc}") from None

    def optional(self, what: str, unsupported: list[str], fn: Callable[..., T],
                 *args: Any) -> T | None:  # fmt: skip
        """``fn(*args)``, or None (``what`` listed in ``unsupported``) on NOT_SUPPORTED."""
        try:
            return fn(*args)
        except self.nv.NVMLError as exc:
            if getattr(exc, "value", None) == self.not_supported:
                unsupported.append(what)
                return None
            raise NvmlError(f"NVML {what}: {exc}") from None

    def inventory(self) -> dict[str, Any]:
        nv = self.nv
        system: list[str] = []
        driver = _text(self.call("driver version", nv.nvmlSystemGetDriverVersion))
        cuda = None
        if hasattr(nv, "nvmlSystemGetCudaDriverVersion_v2"):
            cuda = self.optional("cuda_driver_version", system,
                                 nv.nvmlSystemGetCudaDriverVersion_v2)  # fmt: skip
        nvml_version = None
        if hasattr(nv, "nvmlSystemGetNVMLVersion"):
            nvml_version = _text(self.optional("nvml_version", system, nv.nvmlSystemGetNVMLVersion))
        count = int(self.call("device count", nv.nvmlDeviceGetCount))
        gpus = [self.gpu(i, driver) for i in range(count)]
        topology = topology_from_gpus(gpus)
        return {
            "source": "nvml",
            "driver_version": driver,
            "cuda_driver_version": None if cuda is None else f"{cuda // 1000}.{cuda % 1000 // 10}",
            "nvml_version": nvml_version,
            "gpus": gpus,
            "unsupported": system,
        } | ({"topology": topology} if topology else {})

    def gpu(self, index: int, driver: str | None) -> dict[str, Any]:
        nv = self.nv
        h = self.call(f"GPU {index} handle", nv.nvmlDeviceGetHandleByIndex, index)
        nos: list[str] = []
        uuid = _text(self.call(f"GPU {index} UUID", nv.nvmlDeviceGetUUID, h))
        name = _text(self.optional("name", nos, nv.nvmlDeviceGetName, h))
        mem = self.optional("memory_mb", nos, nv.nvmlDeviceGetMemoryInfo, h)
        memory_mb = None if mem is None else int(mem.total) // (1024 * 1024)
        pci = self.optional("pci_bus_id", nos, nv.nvmlDeviceGetPciInfo, h)
        ecc = self.optional("ecc_enabled", nos, nv.nvmlDeviceGetEccMode, h) or (None, None)
        mig = self.optional("mig_enabled", nos, nv.nvmlDeviceGetMigMode, h) or (None, None)
        nos += [f"{k}_pending" for k in ("ecc", "mig") if f"{k}_enabled" in nos]
        sku = sku_for(name, memory_mb)
        mig_on = _on(mig[0], getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1))
        feature_on = getattr(nv, "NVML_FEATURE_ENABLED", 1)
        return {
            "index": index,
            "uuid": uuid,
            "serial": _text(self.optional("serial", nos, nv.nvmlDeviceGetSerial, h)),
            "name": name,
            "model": None if sku is None else sku.name,
            "memory_mb": memory_mb,
            "pci_bus_id": None if pci is None else _text(pci.busId),
            "vbios_version": _text(
                self.optional("vbios_version", nos, nv.nvmlDeviceGetVbiosVersion, h)
            ),
            "driver_version": driver,
            "ecc_enabled": _on(ecc[0], feature_on),
            "ecc_pending": _on(ecc[1], feature_on),
            "mig_enabled": mig_on,
            "mig_pending": _on(mig[1], getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1)),
            "mig_instances": self.gpu_instances(index, h, sku) if mig_on else [],
            "unsupported": nos,
        } | self.fabric(h)

    def fabric(self, h: Any) -> dict[str, Any]:
        """The GPU's multi-node NVLink fabric (GB200 NVL72 and the like): ``{"fabric":
        {"cluster_uuid": hex, "clique_id": n}}`` once the fabric manager has registered it, else
        nothing (a GPU outside such a fabric answers NOT_SUPPORTED)."""
        nv = self.nv
        if not hasattr(nv, "nvmlDeviceGetGpuFabricInfo") or not hasattr(
            nv, "c_nvmlGpuFabricInfo_t"
        ):
            return {}
        info = nv.c_nvmlGpuFabricInfo_t()
        try:
            nv.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(info))
        except nv.NVMLError:
            return {}
        completed = getattr(nv, "NVML_GPU_FABRIC_STATE_COMPLETED", 3)
        # NVML_GPU_FABRIC_UUID_LEN is 16; some bindings declare a longer field (a real H100,
        # driver 580, answered 80 zero bytes with state NOT_SUPPORTED)
        uuid = bytes(info.clusterUuid)[:16].hex()
        if info.state != completed or info.status != 0 or not uuid.strip("0"):
            return {}
        return {"fabric": {"cluster_uuid": uuid, "clique_id": int(info.cliqueId)}}

    def profile_info(self, h: Any, prof_index: int) -> Any:
        """GPU instance profile info: the v2 structure (with the profile's name) where the driver
        has it, else v1 (drivers before R470 lack ``nvmlDeviceGetGpuInstanceProfileInfoV``)."""
        nv = self.nv
        try:
            return nv.nvmlDeviceGetGpuInstanceProfileInfo(h, prof_index)
        except nv.NVMLError as exc:
            if getattr(exc, "value", None) != getattr(nv, "NVML_ERROR_FUNCTION_NOT_FOUND", 13):
                raise
        return nv.nvmlDeviceGetGpuInstanceProfileInfo(h, prof_index, 1)

    def gpu_instances(self, index: int, h: Any, sku: Sku | None) -> list[dict[str, Any]]:
        """The GPU instances of a MIG-enabled GPU: for each GPU instance profile the GPU has,
        the instances of that profile and their placements (first memory slot, slots used)."""
        nv = self.nv
        by_id = {p.profile_id: p.name for p in sku.mig_profiles} if sku is not None else {}
        out: list[dict[str, Any]] = []
        seen: set[int] = set()
        n_profiles = getattr(nv, "NVML_GPU_INSTANCE_PROFILE_COUNT", _DEFAULT_PROFILE_COUNT)
        for prof_index in range(n_profiles):
            try:
                info = self.profile_info(h, prof_index)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) in self.no_profile:
                    continue
                raise NvmlError(f"NVML GPU {index} MIG profile {prof_index}: {exc}") from None
            if info.id in seen:
                continue
            seen.add(info.id)
            nvml_name = _text(getattr(info, "name", None)) or None
            if nvml_name and nvml_name.upper().startswith("MIG "):
                nvml_name = nvml_name[4:]
            handles = (nv.c_nvmlGpuInstance_t * max(int(info.instanceCount), 1))()
            found = ctypes.c_uint(0)
            self.call(f"GPU {index} GPU instances of profile {info.id}",
                      nv.nvmlDeviceGetGpuInstances, h, info.id, handles,
                      ctypes.byref(found))  # fmt: skip
            for k in range(found.value):
                gi = self.call(f"GPU {index} GPU instance info", nv.nvmlGpuInstanceGetInfo,
                               handles[k])  # fmt: skip
                out.append({
                    "profile": by_id.get(int(gi.profileId), nvml_name),
                    "profile_id": int(gi.profileId),
                    "start": int(gi.placement.start),
                    "size": int(gi.placement.size),
                    "gpu_instance_id": int(gi.id),
                })  # fmt: skip
        return sorted(out, key=lambda i: (i["start"], i["gpu_instance_id"]))
