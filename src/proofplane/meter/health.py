"""GPU health: which readings mean a device must be drained, and whether its work is lost.

:func:`assess` looks at one reading with the device's previous reading of the same field and
answers a :class:`Finding` or None:

* ``DCGM_FI_DEV_XID_ERRORS``: a new XID (the value changed and is not 0) of a fatal class
  (``fields.XID_CLASSES``) does what its class says (drain the device, or the node for a GPU
  that fell off the bus), and loses the device's work where the class says so. dcgm-exporter
  repeats the last XID on every scrape: only a change is an error.
* ``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL`` changing to a value above 0 (it rose, or the driver
  reloaded and it counts again; or above 0 at a device's first reading): an uncorrectable
  memory error; the device is drained and its work lost.
* ``DCGM_FI_DEV_ROW_REMAP_FAILURE`` becoming 1: no spare rows left; drained, work kept.
* ``DCGM_FI_DEV_GPU_TEMP`` crossing ``thermal_limit_c`` (default 90 C, where data-centre GPUs
  throttle hard): a thermal violation; drained, work kept.

A drain stops new work (the scheduler no longer offers the device, or the node is cordoned);
work on a lost device is evicted and re-placed only where its compliance tags hold. Recovery
is an operator's action: nothing here ever undoes a drain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from proofplane.meter.fields import (
    ECC_DBE_VOL_TOTAL,
    GPU_TEMP,
    ROW_REMAP_FAILURE,
    XID_CLASSES,
    XID_ERRORS,
)

THERMAL_LIMIT_C = 90.0
Cause = Literal["xid", "ecc_dbe", "row_remap_failure", "thermal"]
Scope = Literal["device", "node"]
#: the fields :func:`assess` reads
HEALTH_FIELDS = frozenset({XID_ERRORS, ECC_DBE_VOL_TOTAL, ROW_REMAP_FAILURE, GPU_TEMP})


@dataclass(frozen=True, slots=True)
class Finding:
    """What a reading says about a device: drain the device or its node, and whether the
    work on the device is lost (it is then re-placed)."""

    cause: Cause
    scope: Scope
    device_lost: bool
    message: str
    field: str
    value: float
    xid: int | None = None


def worth_checking(field: str, value: float, *, thermal_limit_c: float = THERMAL_LIMIT_C) -> bool:
    """Whether :func:`assess` could find anything in this reading, whatever came before: a
    healthy reading (XID 0, no uncorrectable error, no remap failure, below the limit) never
    needs the device's previous one."""
    if field == XID_ERRORS:
        return int(value) != 0
    if field == ECC_DBE_VOL_TOTAL:
        return value > 0
    if field == ROW_REMAP_FAILURE:
        return value >= 1
    if field == GPU_TEMP:
        return value >= thermal_limit_c
    return False


def assess(
    field: str,
    value: float,
    previous: float | None,
    *,
    thermal_limit_c: float = THERMAL_LIMIT_C,
) -> Finding | None:
    """The finding of one reading of ``field`` (``previous``: the device's last reading of
    it, None at its first); None when the reading says nothing is wrong."""
    if field == XID_ERRORS:
        xid = int(value)
        if xid == 0 or (previous is not None and int(previous) == xid):
            return None
        cls = XID_CLASSES.get(xid)
        if cls is None or not cls.fatal:
            return None
        return Finding(
            "xid",
            "node" if cls.action == "drain_node" else "device",
            cls.device_lost,
            f"XID {xid}: {cls.meaning}",
            field,
            value,
            xid,
        )
    if field == ECC_DBE_VOL_TOTAL:
        if value > 0 and value != previous:  # rose, or restarted (driver reload) and rose
            return Finding(
                "ecc_dbe",
                "device",
                True,
                f"uncorrectable (double-bit) ECC errors: {value:g} since the driver loaded",
                field,
                value,
            )
        return None
    if field == ROW_REMAP_FAILURE:
        if value >= 1 and (previous is None or previous < 1):
            return Finding(
                "row_remap_failure",
                "device",
                False,
                "row remapping failed: no spare memory rows left, the GPU needs service",
                field,
                value,
            )
        return None
    if field == GPU_TEMP:
        if value >= thermal_limit_c and (previous is None or previous < thermal_limit_c):
            return Finding(
                "thermal",
                "device",
                False,
                f"thermal violation: {value:g} C at or above the {thermal_limit_c:g} C limit",
                field,
                value,
            )
        return None
    return None
