"""The telemetry fields proofplane keeps, named as DCGM and dcgm-exporter name them, and the
table of NVIDIA's XID error classes.

A field is a ``gauge`` (a reading: a power draw, a temperature, a ratio of time busy) or a
``counter`` (a running total since the driver loaded: energy, ECC errors; its increase is what
is metered, and a value lower than the previous one means the driver reloaded). ``mig`` says
whether the field is measured per MIG instance (GPU instance, dcgm-exporter's ``GPU_I_ID``
label) or only for the whole GPU: ``DCGM_FI_DEV_GPU_UTIL`` is never valid for a MIG instance
(NVML answers NOT_SUPPORTED in MIG mode); ``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` is the utilisation
that works for both.

Units are DCGM's: ratios 0..1 for the profiling (``PROF``) fields, percent for the
``DEV_*_UTIL`` fields, MiB for frame buffer, W for power, mJ for energy, degrees C, bytes per
second for the PCIe and NVLink throughput fields (DCGM defines ``DCGM_FI_PROF_PCIE_TX_BYTES``
and friends as rates although dcgm-exporter's default CSV declares them ``counter``: here they
are gauges, and a volume is the mean rate times the time).

``XID_CLASSES`` is data: NVIDIA's XID catalogue ("XID Errors", NVIDIA GPU deployment and
management documentation) for the codes a fleet sees, with what each means and what the
control plane does about it (``meter.health``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

Kind = Literal["gauge", "counter"]


@dataclass(frozen=True, slots=True)
class Field:
    """One telemetry field: its DCGM name, unit, kind, whether it is valid for a MIG
    instance, the bounds of a plausible value (a sample outside them is refused), and what it
    is."""

    name: str
    unit: str
    kind: Kind
    mig: bool
    low: float
    high: float
    help: str


GR_ENGINE_ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
SM_ACTIVE = "DCGM_FI_PROF_SM_ACTIVE"
DRAM_ACTIVE = "DCGM_FI_PROF_DRAM_ACTIVE"
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
POWER_USAGE = "DCGM_FI_DEV_POWER_USAGE"
TOTAL_ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
GPU_TEMP = "DCGM_FI_DEV_GPU_TEMP"
MEMORY_TEMP = "DCGM_FI_DEV_MEMORY_TEMP"
XID_ERRORS = "DCGM_FI_DEV_XID_ERRORS"
ECC_DBE_VOL_TOTAL = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
ECC_SBE_VOL_TOTAL = "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"
UNCORRECTABLE_REMAPPED_ROWS = "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"
CORRECTABLE_REMAPPED_ROWS = "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"
ROW_REMAP_FAILURE = "DCGM_FI_DEV_ROW_REMAP_FAILURE"
THERMAL_VIOLATION = "DCGM_FI_DEV_THERMAL_VIOLATION"
PCIE_TX_BYTES = "DCGM_FI_PROF_PCIE_TX_BYTES"
PCIE_RX_BYTES = "DCGM_FI_PROF_PCIE_RX_BYTES"
NVLINK_TX_BYTES = "DCGM_FI_PROF_NVLINK_TX_BYTES"
NVLINK_RX_BYTES = "DCGM_FI_PROF_NVLINK_RX_BYTES"

_BIG = 1e18  # no plausible counter or rate reaches it; it keeps inf and garbage out
_ENTRIES = (
    Field(GR_ENGINE_ACTIVE, "ratio", "gauge", True, 0.0, 1.0,
          "ratio of time the graphics/compute engine was active (per GPU or MIG instance)"),
    Field(SM_ACTIVE, "ratio", "gauge", True, 0.0, 1.0,
          "ratio of cycles at least one warp was resident on an SM"),
    Field(DRAM_ACTIVE, "ratio", "gauge", True, 0.0, 1.0,
          "ratio of cycles the device memory interface was sending or receiving data"),
    Field(GPU_UTIL, "%", "gauge", False, 0.0, 100.0,
          "GPU utilisation (percent of time a kernel ran); never valid for a MIG instance"),
    Field(FB_USED, "MiB", "gauge", True, 0.0, 16 * 1024 * 1024.0, "frame buffer memory used"),
    Field(FB_FREE, "MiB", "gauge", True, 0.0, 16 * 1024 * 1024.0, "frame buffer memory free"),
    Field(POWER_USAGE, "W", "gauge", False, 0.0, 10_000.0, "power draw"),
    Field(TOTAL_ENERGY, "mJ", "counter", False, 0.0, _BIG,
          "energy consumed since the driver was last loaded"),
    Field(GPU_TEMP, "C", "gauge", False, -50.0, 200.0, "GPU temperature"),
    Field(MEMORY_TEMP, "C", "gauge", False, -50.0, 200.0, "memory (HBM) temperature"),
    Field(XID_ERRORS, "xid", "gauge", False, 0.0, 65535.0,
          "the last XID error seen (0: none); see XID_CLASSES"),
    Field(ECC_DBE_VOL_TOTAL, "errors", "counter", False, 0.0, _BIG,
          "double-bit (uncorrectable) ECC errors since the driver was loaded"),
    Field(ECC_SBE_VOL_TOTAL, "errors", "counter", False, 0.0, _BIG,
          "single-bit (corrected) ECC errors since the driver was loaded"),
    Field(UNCORRECTABLE_REMAPPED_ROWS, "rows", "counter", False, 0.0, _BIG,
          "memory rows remapped for uncorrectable errors"),
    Field(CORRECTABLE_REMAPPED_ROWS, "rows", "counter", False, 0.0, _BIG,
          "memory rows remapped for correctable errors"),
    Field(ROW_REMAP_FAILURE, "bool", "gauge", False, 0.0, 1.0,
          "1 when a row remapping failed (no spare rows left): the GPU must be serviced"),
    Field(THERMAL_VIOLATION, "us", "counter", False, 0.0, _BIG,
          "time the GPU was held back by thermal limits"),
    Field(PCIE_TX_BYTES, "B/s", "gauge", False, 0.0, _BIG, "PCIe transmit throughput"),
    Field(PCIE_RX_BYTES, "B/s", "gauge", False, 0.0, _BIG, "PCIe receive throughput"),
    Field(NVLINK_TX_BYTES, "B/s", "gauge", False, 0.0, _BIG, "NVLink transmit throughput"),
    Field(NVLINK_RX_BYTES, "B/s", "gauge", False, 0.0, _BIG, "NVLink receive throughput"),
)  # fmt: skip

#: Every field proofplane keeps, by DCGM name.
FIELDS: Mapping[str, Field] = MappingProxyType({f.name: f for f in _ENTRIES})
#: The counters (their increase is metered).
COUNTERS: frozenset[str] = frozenset(f.name for f in _ENTRIES if f.kind == "counter")
#: The fields valid for a MIG instance.
MIG_FIELDS: frozenset[str] = frozenset(f.name for f in _ENTRIES if f.mig)


def field(name: str) -> Field | None:
    """The field named ``name`` (None: not one proofplane keeps)."""
    return FIELDS.get(name)


# --- XID errors ----------------------------------------------------------------------------

Action = Literal["none", "drain_device", "drain_node"]


@dataclass(frozen=True, slots=True)
class XidClass:
    """One XID code: what it means, whether it is fatal for the device, what the control
    plane does (``drain_device``: no new work on the GPU; ``drain_node``: the node is
    cordoned), and whether the work running on the GPU is lost (it is then re-placed on
    compliant capacity)."""

    xid: int
    meaning: str
    fatal: bool
    action: Action
    device_lost: bool


_XIDS = (
    XidClass(13, "Graphics engine exception (usually an application fault)", False, "none",
             False),
    XidClass(31, "GPU memory page fault (usually an application fault)", False, "none", False),
    XidClass(43, "GPU stopped processing (the faulting application was stopped)", False, "none",
             False),
    XidClass(45, "Preemptive cleanup, due to previous errors", False, "none", False),
    XidClass(48, "Double-bit ECC error (uncorrectable memory error)", True, "drain_device",
             True),
    XidClass(61, "Internal micro-controller breakpoint/warning: GPU reset needed", True,
             "drain_device", True),
    XidClass(62, "Internal micro-controller halt: GPU reset needed", True, "drain_device", True),
    XidClass(63, "ECC page retirement or row remapping recording event: reset the GPU once "
             "its work is done", True, "drain_device", False),
    XidClass(64, "ECC page retirement or row remapper recording failure", True, "drain_device",
             False),
    XidClass(74, "NVLink error", True, "drain_device", True),
    XidClass(79, "GPU has fallen off the bus: the node needs service", True, "drain_node", True),
    XidClass(92, "High single-bit ECC error rate", True, "drain_device", False),
    XidClass(94, "Contained ECC error (the application that hit it was stopped): reset the "
             "GPU once its work is done", True, "drain_device", False),
    XidClass(95, "Uncontained ECC error: every application on the GPU is affected", True,
             "drain_device", True),
    XidClass(119, "GSP RPC timeout: GPU reset needed", True, "drain_device", True),
    XidClass(120, "GSP error: GPU reset needed", True, "drain_device", True),
)  # fmt: skip

#: NVIDIA's XID classes by code (data: extend it, never branch on codes elsewhere).
XID_CLASSES: Mapping[int, XidClass] = MappingProxyType({x.xid: x for x in _XIDS})
#: The fatal codes.
FATAL_XIDS: frozenset[int] = frozenset(x.xid for x in _XIDS if x.fatal)
