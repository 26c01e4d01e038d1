"""Hourly rollups of raw telemetry: per hour, device, field and placement holder, the count,
sum, minimum, maximum and last value.

A raw :class:`Point` is a stored sample keyed to the placement that held the device then
(``workload``, ``tenant``; None: nobody), with ``share``: the part of the device that holder
held (1 for a whole GPU or a MIG instance's own reading; a MIG instance's compute-slice
fraction or a GPU share's fraction for a reading of a whole GPU several holders share: the
same reading is stored once per holder, and once more, unattributed, for the part nobody
held).

Gauges roll up as they are. Counters (``fields.COUNTERS``) roll up by their increase: the
increase at a reading is its value minus the device's previous reading (the value itself when
it went down: the driver reloaded and the counter restarted), the first reading of a device
counting from ``previous`` (the device's last reading before the points; without one it adds
nothing). The increase is split between the holders by ``share``: a counter's ``sum`` is the
increase attributed to that holder in that hour, so summing ``sum`` over holders gives the
device's increase. ``min``, ``max`` and ``last`` stay the counter's own readings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from proofplane.meter.fields import COUNTERS

SeriesKey = tuple[str, int | None, str]  # (gpu_uuid, gi_id, field): one device's readings
HOUR = timedelta(hours=1)


@dataclass(frozen=True, slots=True)
class Point:
    """One stored raw reading."""

    node: str
    gpu_uuid: str
    gi_id: int | None
    field: str
    ts: datetime
    value: float
    workload: str | None = None
    tenant: str | None = None
    share: float = 1.0
    simulated: bool = False


@dataclass(frozen=True, slots=True)
class Hourly:
    """One rollup row. ``simulated``: some reading in it was simulated."""

    hour: datetime
    node: str
    gpu_uuid: str
    gi_id: int | None
    field: str
    workload: str | None
    tenant: str | None
    count: int
    sum: float
    min: float
    max: float
    last: float
    simulated: bool

    def as_dict(self) -> dict[str, object]:
        return {
            "hour": self.hour,
            "node": self.node,
            "gpu_uuid": self.gpu_uuid,
            "gi_id": self.gi_id,
            "field": self.field,
            "workload": self.workload,
            "tenant": self.tenant,
            "count": self.count,
            "sum": self.sum,
            "min": self.min,
            "max": self.max,
            "last": self.last,
            "simulated": self.simulated,
        }


def hour_of(ts: datetime) -> datetime:
    """The start of the hour ``ts`` falls in (same time zone)."""
    return ts.replace(minute=0, second=0, microsecond=0)


def increases(
    points: Iterable[Point], previous: Mapping[SeriesKey, float] | None = None
) -> list[tuple[Point, float]]:
    """Each counter point with the increase attributed to it (its device's increase at that
    reading times its ``share``), in time order; gauges are left out. Readings of the same
    device at the same time (one per holder) share one increase."""
    prev = dict(previous or {})
    at: dict[SeriesKey, tuple[datetime, float]] = {}  # the device's increase at its last time
    out: list[tuple[Point, float]] = []
    for p in sorted((p for p in points if p.field in COUNTERS), key=lambda p: p.ts):
        key = (p.gpu_uuid, p.gi_id, p.field)
        seen = at.get(key)
        if seen is not None and seen[0] == p.ts:
            inc = seen[1]
        else:
            before = prev.get(key)
            if before is None:
                inc = 0.0
            elif p.value >= before:
                inc = p.value - before
            else:
                inc = p.value  # the counter restarted (driver reload)
            prev[key] = p.value
            at[key] = (p.ts, inc)
        out.append((p, inc * p.share))
    return out


class _Acc:
    __slots__ = ("count", "last", "max", "min", "simulated", "sum")

    def __init__(self, add: float, value: float, simulated: bool) -> None:
        self.count = 1
        self.sum = add
        self.min = self.max = self.last = value
        self.simulated = simulated


def rollup(
    points: Iterable[Point], previous: Mapping[SeriesKey, float] | None = None
) -> list[Hourly]:
    """The hourly rows of ``points`` (any hours), ordered by hour, node, device, field and
    holder. ``previous``: each counter device's last reading before the points."""
    pts = sorted(points, key=lambda p: p.ts)
    inc_of: dict[int, float] = {id(p): inc for p, inc in increases(pts, previous)}
    groups: dict[tuple[datetime, str, str, int | None, str, str | None, str | None], _Acc] = {}
    for p in pts:
        key = (hour_of(p.ts), p.node, p.gpu_uuid, p.gi_id, p.field, p.workload, p.tenant)
        add = inc_of[id(p)] if p.field in COUNTERS else p.value
        g = groups.get(key)
        if g is None:
            groups[key] = _Acc(add, p.value, p.simulated)
            continue
        g.count += 1
        g.sum += add
        if p.value < g.min:
            g.min = p.value
        if p.value > g.max:
            g.max = p.value
        g.last = p.value
        g.simulated = g.simulated or p.simulated
    rows = [Hourly(*k, g.count, g.sum, g.min, g.max, g.last, g.simulated)
            for k, g in groups.items()]  # fmt: skip
    rows.sort(key=_order)
    return rows


def _order(h: Hourly) -> tuple[object, ...]:
    return (h.hour, h.node, h.gpu_uuid, -1 if h.gi_id is None else h.gi_id, h.field,
            h.workload or "", h.tenant or "")  # fmt: skip


def merge(a: Hourly, b: Hourly) -> Hourly:
    """Two rollups of the same key over readings where ``b``'s come after ``a``'s."""
    return Hourly(
        a.hour, a.node, a.gpu_uuid, a.gi_id, a.field, a.workload, a.tenant,
        a.count + b.count, a.sum + b.sum, min(a.min, b.min), max(a.max, b.max), b.last,
        a.simulated or b.simulated,
    )  # fmt: skip
