"""The node agent's telemetry collectors (issue 15): what the agent posts to
``POST /api/v1/nodes/{name}/telemetry`` each interval, named with DCGM's field names.

:class:`NvmlTelemetry` reads the GPUs through NVML (``pynvml``, from ``nvidia-ml-py``; the
inventory collector :mod:`proofplane.hardware.nvml` lives beside it), per GPU and per MIG
instance:

* ``DCGM_FI_PROF_GR_ENGINE_ACTIVE``: GPM ``NVML_GPM_METRIC_GRAPHICS_UTIL`` between two reads
  (``nvmlGpmSampleGet``; ``nvmlGpmMigSampleGet`` per MIG instance; Hopper and later). Without
  GPM, for a whole GPU only: ``nvmlDeviceGetUtilizationRates().gpu`` / 100 (the time a kernel
  ran: the nearest NVML offers). ``_SM_ACTIVE``, ``_DRAM_ACTIVE``: GPM SM_UTIL, DRAM_BW_UTIL.
* ``DCGM_FI_DEV_GPU_UTIL``: ``nvmlDeviceGetUtilizationRates().gpu`` (never in MIG mode).
* ``DCGM_FI_DEV_FB_USED``/``_FREE``: ``nvmlDeviceGetMemoryInfo`` (of the MIG device for an
  instance), MiB; version 2 where the bindings have it, whose ``used`` leaves out the memory the
  driver reserves for itself (as nvidia-smi and DCGM count it: on a real idle H100 80GB, driver
  580, v1 says 480 MiB used and nvidia-smi 0).
* ``DCGM_FI_DEV_POWER_USAGE``: ``nvmlDeviceGetPowerUsage`` (mW → W);
  ``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION``: ``nvmlDeviceGetTotalEnergyConsumption`` (mJ);
  ``DCGM_FI_DEV_GPU_TEMP``: ``nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)``.
* ``DCGM_FI_DEV_XID_ERRORS``: XID events (``nvmlDeviceRegisterEvents`` with
  ``nvmlEventTypeXidCriticalError``, drained with ``nvmlEventSetWait_v2(…, 0)``): each XID at
  the read that finds it, 0 otherwise.
* ``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL``/``_SBE_``: ``nvmlDeviceGetTotalEccErrors`` (uncorrected /
  corrected, volatile); remapped rows and ``DCGM_FI_DEV_ROW_REMAP_FAILURE``:
  ``nvmlDeviceGetRemappedRows``; ``DCGM_FI_DEV_THERMAL_VIOLATION``:
  ``nvmlDeviceGetViolationStatus(NVML_PERF_POLICY_THERMAL)`` (ns → µs).
* ``DCGM_FI_PROF_PCIE_TX/RX_BYTES``: GPM PCIE_TX/RX_PER_SEC, else
  ``nvmlDeviceGetPcieThroughput`` (KB/s), in B/s; ``DCGM_FI_PROF_NVLINK_TX/RX_BYTES``: GPM
  NVLINK_TOTAL_TX/RX_PER_SEC, B/s.

A query a GPU answers with NVML_ERROR_NOT_SUPPORTED (or another error) leaves that field out
for that GPU: telemetry is best effort, attestation is where a missing fact fails closed.

:class:`DcgmScrape` reads a site's dcgm-exporter instead (``--dcgm-url``): the Prometheus text
format, parsed with ``prometheus_client``'s parser (``meter.samples.parse_dcgm_text``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

import httpx

from proofplane.hardware import nvml
from proofplane.meter import fields as F
from proofplane.meter.samples import Sample, parse_dcgm_text

T = TypeVar("T")
MIB = 1024 * 1024
#: GPM metric IDs (``NVML_GPM_METRIC_*``) and the field each gives, with its scale
_GPM = (
    (1, F.GR_ENGINE_ACTIVE, 0.01),  # GRAPHICS_UTIL, percent
    (2, F.SM_ACTIVE, 0.01),  # SM_UTIL
    (10, F.DRAM_ACTIVE, 0.01),  # DRAM_BW_UTIL
    (20, F.PCIE_TX_BYTES, float(MIB)),  # PCIE_TX_PER_SEC, MiB/s
    (21, F.PCIE_RX_BYTES, float(MIB)),
    (61, F.NVLINK_TX_BYTES, float(MIB)),  # NVLINK_TOTAL_TX_PER_SEC
    (60, F.NVLINK_RX_BYTES, float(MIB)),
)
_GPM_MIG = {F.GR_ENGINE_ACTIVE, F.SM_ACTIVE, F.DRAM_ACTIVE}


class NvmlTelemetry:
    """Reads telemetry through NVML. ``open`` initialises NVML and registers for XID events;
    ``read`` may be called every interval; ``close`` shuts NVML down. ``nvml_module``: the
    ``pynvml`` module or an object with its API (tests pass tests/fake_nvml.py)."""

    def __init__(self, nvml_module: Any = None) -> None:
        self._given = nvml_module
        self.nv: Any = None
        self._events: Any = None
        self._gpm: dict[tuple[str, int | None], Any] = {}  # device → its previous GPM sample
        self._profiles: dict[int, str] = {}

    # --- life cycle -------------------------------------------------------------------------

    def open(self) -> NvmlTelemetry:
        nv = nvml.load() if self._given is None else self._given
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            raise nvml.NvmlUnavailable(f"NVML is not available: {exc}") from None
        self.nv = nv
        with contextlib.suppress(nv.NVMLError, AttributeError):
            events = nv.nvmlEventSetCreate()
            xid = getattr(nv, "nvmlEventTypeXidCriticalError", 0x8)
            for i in range(int(nv.nvmlDeviceGetCount())):
                with contextlib.suppress(nv.NVMLError):
                    nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(i), xid, events)
            self._events = events
        return self

    def close(self) -> None:
        nv = self.nv
        if nv is None:
            return
        for sample in self._gpm.values():
            with contextlib.suppress(nv.NVMLError, AttributeError):
                nv.nvmlGpmSampleFree(sample)
        self._gpm.clear()
        if self._events is not None:
            with contextlib.suppress(nv.NVMLError, AttributeError):
                nv.nvmlEventSetFree(self._events)
            self._events = None
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlShutdown()
        self.nv = None

    def __enter__(self) -> NvmlTelemetry:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- reading ----------------------------------------------------------------------------

    def _try(self, fn: Callable[..., T], *args: Any) -> T | None:
        try:
            return fn(*args)
        except self.nv.NVMLError:
            return None
        except AttributeError:  # bindings too old for this call
            return None

    def _memory(self, handle: Any) -> Any:
        """Memory info, version 2 (``used`` without the driver's reserve) where there is one."""
        v2 = getattr(self.nv, "nvmlMemory_v2", None)
        if v2 is not None:
            mem = self._try(self.nv.nvmlDeviceGetMemoryInfo, handle, v2)
            if mem is not None:
                return mem
        return self._try(self.nv.nvmlDeviceGetMemoryInfo, handle)

    def read(self, node: str, now: datetime) -> list[Sample]:
        """Every reading NVML gives now, as samples of ``node`` at ``now``."""
        if self.nv is None:
            self.open()
        nv = self.nv
        out: list[Sample] = []
        xids = self._xids()
        for i in range(int(nv.nvmlDeviceGetCount())):
            h = self._try(nv.nvmlDeviceGetHandleByIndex, i)
            uuid = _text(self._try(nv.nvmlDeviceGetUUID, h)) if h is not None else None
            if not uuid:
                continue

            def add(field: str, value: float | None, uuid: str = uuid) -> None:
                if value is not None:
                    out.append(Sample(node, uuid, None, None, field, now, float(value)))

            mig: Any = self._try(nv.nvmlDeviceGetMigMode, h)
            mig_on = mig is not None and int(mig[0]) == getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1)
            gpm = self._gpm_metrics(h, uuid, None)
            util = None if mig_on else self._try(nv.nvmlDeviceGetUtilizationRates, h)
            if util is not None:
                add(F.GPU_UTIL, util.gpu)
            for field, value in (gpm or {}).items():
                add(field, value)
            if gpm is None and util is not None:  # no GPM on this GPU: the nearest NVML has
                add(F.GR_ENGINE_ACTIVE, util.gpu / 100)
            mem = self._memory(h)
            if mem is not None:
                add(F.FB_USED, int(mem.used) / MIB)
                add(F.FB_FREE, int(mem.free) / MIB)
            power = self._try(nv.nvmlDeviceGetPowerUsage, h)
            add(F.POWER_USAGE, None if power is None else power / 1000)
            add(F.TOTAL_ENERGY, self._try(nv.nvmlDeviceGetTotalEnergyConsumption, h))
            add(F.GPU_TEMP, self._try(nv.nvmlDeviceGetTemperature, h,
                                      getattr(nv, "NVML_TEMPERATURE_GPU", 0)))  # fmt: skip
            add(F.XID_ERRORS, xids.get(uuid, 0) if self._events is not None else None)
            volatile = getattr(nv, "NVML_VOLATILE_ECC", 0)
            add(F.ECC_DBE_VOL_TOTAL, self._try(
                nv.nvmlDeviceGetTotalEccErrors, h,
                getattr(nv, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1), volatile))  # fmt: skip
            add(F.ECC_SBE_VOL_TOTAL, self._try(
                nv.nvmlDeviceGetTotalEccErrors, h,
                getattr(nv, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0), volatile))  # fmt: skip
            rows = self._try(nv.nvmlDeviceGetRemappedRows, h)
            if rows is not None:
                add(F.CORRECTABLE_REMAPPED_ROWS, rows[0])
                add(F.UNCORRECTABLE_REMAPPED_ROWS, rows[1])
                add(F.ROW_REMAP_FAILURE, 1 if rows[3] else 0)
            viol = self._try(nv.nvmlDeviceGetViolationStatus, h,
                             getattr(nv, "NVML_PERF_POLICY_THERMAL", 1))  # fmt: skip
            if viol is not None:
                add(F.THERMAL_VIOLATION, int(viol.violationTime) / 1000)
            if gpm is None:
                for field, counter in ((F.PCIE_TX_BYTES, 0), (F.PCIE_RX_BYTES, 1)):
                    kb = self._try(nv.nvmlDeviceGetPcieThroughput, h, counter)
                    add(field, None if kb is None else kb * 1024)
            if mig_on:
                out.extend(self._instances(node, now, h, uuid))
        return out

    def _xids(self) -> dict[str, int]:
        """The XID events since the last read (the last per GPU)."""
        nv = self.nv
        out: dict[str, int] = {}
        if self._events is None:
            return out
        for _ in range(1000):  # drain what is pending, never wait
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError:
                break  # NVML_ERROR_TIMEOUT: nothing more
            uuid = _text(self._try(nv.nvmlDeviceGetUUID, data.device))
            if uuid:
                out[uuid] = int(data.eventData)
        return out

    def _gpm_metrics(self, h: Any, uuid: str, gi: int | None) -> dict[str, float] | None:
        """GPM metrics since the previous read of the device ({} at the first read); None
        when the device has no GPM (before Hopper, or bindings without it)."""
        nv = self.nv
        if not hasattr(nv, "nvmlGpmSampleAlloc"):
            return None
        if gi is None:
            support = self._try(nv.nvmlGpmQueryDeviceSupport, h)
            if support is None or not int(support.isSupportedDevice):
                return None
        sample = self._try(nv.nvmlGpmSampleAlloc)
        if sample is None:
            return None
        got = (
            self._try(nv.nvmlGpmSampleGet, h, sample)
            if gi is None
            else self._try(nv.nvmlGpmMigSampleGet, h, gi, sample)
        )
        if got is None:
            self._try(nv.nvmlGpmSampleFree, sample)
            return None
        previous = self._gpm.get((uuid, gi))
        self._gpm[(uuid, gi)] = sample
        if previous is None:
            return {}
        wanted = [g for g in _GPM if gi is None or g[1] in _GPM_MIG]
        try:
            mg = nv.c_nvmlGpmMetricsGet_t()
            mg.version = getattr(nv, "NVML_GPM_METRICS_GET_VERSION", 1)
            mg.numMetrics = len(wanted)
            mg.sample1, mg.sample2 = previous, sample
            for k, (metric, _f, _s) in enumerate(wanted):
                mg.metrics[k].metricId = metric
            nv.nvmlGpmMetricsGet(mg)
        except (nv.NVMLError, AttributeError):
            return {}
        finally:
            self._try(nv.nvmlGpmSampleFree, previous)
        out = {}
        for k, (_m, field, scale) in enumerate(wanted):
            if int(mg.metrics[k].nvmlReturn) == 0:
                value = float(mg.metrics[k].value) * scale
                out[field] = min(value, 1.0) if scale == 0.01 else value
        return out

    def _instances(self, node: str, now: datetime, h: Any, uuid: str) -> list[Sample]:
        """Readings of each MIG instance (GPU instance) of a MIG-enabled GPU."""
        nv = self.nv
        out: list[Sample] = []
        seen: set[int] = set()
        count = self._try(nv.nvmlDeviceGetMaxMigDeviceCount, h) or 0
        model = nvml.sku_for(_text(self._try(nv.nvmlDeviceGetName, h)), None)
        by_id = {p.profile_id: p.name for p in model.mig_profiles} if model else {}
        for k in range(int(count)):
            mh = self._try(nv.nvmlDeviceGetMigDeviceHandleByIndex, h, k)
            if mh is None:
                continue
            gi = self._try(nv.nvmlDeviceGetGpuInstanceId, mh)
            if gi is None or gi in seen:
                continue  # several compute instances of one GPU instance: one reading
            seen.add(int(gi))
            profile, start = None, None
            gih = self._try(nv.nvmlDeviceGetGpuInstanceById, h, gi)
            info = self._try(nv.nvmlGpuInstanceGetInfo, gih) if gih is not None else None
            if info is not None:
                profile = by_id.get(int(info.profileId))
                start = int(info.placement.start)

            def add(field: str, value: float | None, gi: int = int(gi), profile: Any = profile,
                    start: Any = start) -> None:  # fmt: skip
                if value is not None:
                    out.append(Sample(node, uuid, gi, profile, field, now, float(value), start))

            mem = self._memory(mh)
            if mem is not None:
                add(F.FB_USED, int(mem.used) / MIB)
                add(F.FB_FREE, int(mem.free) / MIB)
            for field, value in (self._gpm_metrics(h, uuid, int(gi)) or {}).items():
                add(field, value)
        return out


class DcgmScrape:
    """Reads a dcgm-exporter (``url``: its /metrics). ``starts``: (GPU UUID, GPU instance ID)
    → first memory slot, from NVML where the node has it (the exporter names MIG instances by
    ID and profile only)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 5.0,
        starts: dict[tuple[str, int], int] | None = None,
        get: Callable[..., Any] | None = None,
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.starts = starts or {}
        self._get = get or httpx.get

    def read(self, node: str, now: datetime) -> list[Sample]:
        resp = self._get(self.url, timeout=self.timeout_s)
        resp.raise_for_status()
        samples = parse_dcgm_text(resp.text, node=node, ts=now)
        if not self.starts:
            return samples
        return [
            s._replace(mig_start=self.starts.get((s.gpu_uuid, s.gi_id)))
            if s.gi_id is not None and s.mig_start is None
            else s
            for s in samples
        ]


def mig_starts(inventory: dict[str, Any] | None) -> dict[tuple[str, int], int]:
    """(GPU UUID, GPU instance ID) → start, from an NVML inventory (``hardware.nvml.collect``)."""
    out: dict[tuple[str, int], int] = {}
    for g in (inventory or {}).get("gpus") or ():
        for inst in g.get("mig_instances") or ():
            if g.get("uuid") and inst.get("gpu_instance_id") is not None:
                out[(str(g["uuid"]), int(inst["gpu_instance_id"]))] = int(inst["start"])
    return out


def _text(value: Any) -> str | None:
    """NVML strings: ``str`` in current bindings, ``bytes`` in older ones."""
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        value = bytes(value).split(b"\0", 1)[0].decode("utf-8", "replace")
    return str(value).strip()
