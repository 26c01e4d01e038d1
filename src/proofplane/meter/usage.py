"""Usage from the record (issue 15, §4): allocation intervals from the audit events, GPU-hours
per tenant per SKU, priced with a rate card (pure: the service streams the event rows in).

**Intervals.** A ``workload.place`` event opens an interval for the workload (its tenant and
name) on the devices it names; the next ``workload.evict`` (preempted, node failed or drained,
certification revoked: the failover's first half), ``workload.cancel``, ``workload.succeeded``,
``workload.failed`` or ``workload.cancelled`` of that workload closes it; a re-placement opens
the next one. An interval still open at the end of the report is cut there; one opened before
the window counts from the window's start. Durations are whole microseconds of event time.

**Weights.** A whole GPU counts 1 GPU-hour per hour; a MIG instance its compute-slice fraction
(``3g.40gb``: 3/7 of a GPU, the SKU tables of ``hardware.skus``); a shared GPU its
``share_milli``/1000. The SKU of a device is the model its node's ``node.register`` event
states for its GPU UUID, so the report needs nothing but the log.

**Money.** Quantities are kept exact (integer microseconds times integer units, then
``Fraction``); each output line's cost is rounded once, ROUND_HALF_EVEN, to the currency's
minor unit; totals are sums of the rounded lines (what an invoice adds up). Quantities are
shown to 6 decimals (ROUND_HALF_EVEN). The same rows give the same report, byte for byte.

**Not the invoice basis:** "allocated but idle" device-hours (``waste``) come from telemetry
rollups, and energy (kWh) from metered counters; both are shown beside the usage, never priced.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction
from typing import Any, NamedTuple

from proofplane.errors import ValidationFailed
from proofplane.hardware.skus import COMPUTE_SLICES, SKUS
from proofplane.meter.rates import RateCard, Segment

MICROS_PER_HOUR = 3_600_000_000
QUANTITY_PLACES = 6  # GPU-hours, device-hours, pricing quantities
ENERGY_PLACES = 3  # kWh (Wh resolution)
GPU, MIG, SHARED = "gpu", "mig", "shared"
UNKNOWN_SKU = "unknown"
GROUP_BY = ("tenant", "pool", "sku", "workload")
ROUNDING = "ROUND_HALF_EVEN"

# The events that end a workload's hold on its devices (see the module docstring).
RELEASE_ACTIONS = (
    "workload.evict",
    "workload.cancel",
    "workload.succeeded",
    "workload.failed",
    "workload.cancelled",
)
PLACE_ACTION = "workload.place"
USAGE_ACTIONS = (PLACE_ACTION, *RELEASE_ACTIONS)

_EPOCH = datetime(1970, 1, 1)
_UTC_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def micros(ts: datetime | str) -> int:
    """Microseconds since the epoch of an event time: a datetime (naive means UTC, as the
    store keeps them) or its text (SQLite's ``2026-01-01 00:00:00.000000``, or ISO 8601)."""
    if isinstance(ts, str):
        ts = datetime.fromisoformat(ts)
    d = ts - _EPOCH if ts.tzinfo is None else ts - _UTC_EPOCH
    return (d.days * 86_400 + d.seconds) * 1_000_000 + d.microseconds


def from_micros(us: int) -> datetime:
    return _UTC_EPOCH + timedelta(microseconds=us)


def pool_name(tags: Mapping[str, str]) -> str:
    """A compliance pool (the workload's tags, ``schedule.engine.pool_of``) as one string:
    ``gdpr-zone=frankfurt,hipaa=true``; no tags: the empty string."""
    return ",".join(f"{k}={v}" for k, v in sorted(tags.items()))


def pool_tags(pool: str) -> dict[str, str]:
    """Back from ``pool_name`` (tag keys and values hold neither ',' nor '=')."""
    return dict(p.split("=", 1) for p in pool.split(",")) if pool else {}


class UsageKey(NamedTuple):
    """What one accumulator adds up: a tenant's holding of one kind of device in one pool.
    ``profile`` is the MIG profile (MIG) or ""; ``workload`` is "" unless grouped by it."""

    tenant: str
    pool: str
    sku: str
    kind: str
    profile: str
    workload: str


# One usage event as the service reads it (columns the store extracts from the details):
# (action, ts, workload, tenant, node, tags JSON, mig_profile, share_milli, device count,
#  first device's GPU UUID, devices JSON or None, members JSON or None). The devices JSON is
# needed only on a node with GPUs of several models; members only on a gang placement.
EventTuple = tuple[
    str,
    datetime | str,
    str,
    str | None,
    str | None,
    str | Mapping[str, str] | None,
    str | None,
    int | None,
    int | None,
    str | None,
    str | list[Any] | None,
    str | list[Any] | None,
]


@dataclass
class Metered:
    """What the meter added up: weighted microseconds per (rate segment, key), the same per
    tracked workload (to share its metered energy among its lines), and what it noticed."""

    usage: dict[tuple[int, UsageKey], int]
    tracked: dict[tuple[str, str], dict[tuple[int, UsageKey], int]]
    releases_matched_by_name: int = 0
    unknown_gpus: set[str] = field(default_factory=set)
    events: int = 0

    def add(self, other: Metered) -> None:
        """Add ``other`` (a meter over other workloads' events of the same window) to this."""
        for slot, units in other.usage.items():
            self.usage[slot] = self.usage.get(slot, 0) + units
        for name, slots in other.tracked.items():
            mine = self.tracked.setdefault(name, {})
            for slot, units in slots.items():
                mine[slot] = mine.get(slot, 0) + units
        self.releases_matched_by_name += other.releases_matched_by_name
        self.unknown_gpus |= other.unknown_gpus
        self.events += other.events


Key = tuple[str, str, str, str, str, str]  # a UsageKey as a plain tuple (cheaper to make)
Parts = tuple[tuple[int, int], ...]  # (line id, units) of what a placement holds
Held = tuple[str, int, "str | None", Parts]  # tenant, start µs, node, parts
# A hold handed from the meter of one range of the log to the join (``join_ranges``): tenant,
# name, start µs, node, and what it holds as (line, units) with the line spelled out (line
# ids are each meter's own).
Carried = tuple[str, str, int, "str | None", tuple[tuple[Key, int], ...]]
# The first usage event of (tenant, name) in range ``j`` of the log, as µs; None: there is none.
FirstEvent = Callable[[int, str, str], "int | None"]


@dataclass
class RangePart:
    """What the meter of one range of the log hands to the join: the intervals that opened
    and closed in the range, the holds still open at its end (not cut), the first release of
    each (tenant, name) that found no hold of the range's own with whether that name was
    placed in the range before it, and every release that named no tenant (time, name, node,
    the tenant whose hold it ended or None)."""

    metered: Metered
    holds: list[Carried]
    orphans: dict[tuple[str, str], tuple[int, bool]]
    tenantless: list[tuple[int, str, str | None, str | None]]


class Meter:
    """Allocation intervals from a stream of usage events, in log order (see the module
    docstring). ``cuts`` are the rate-period boundaries inside [start, end): time on either
    side of one is added up separately. ``gpu_models`` maps GPU UUID to SKU (the
    ``node.register`` events). ``tracked`` workloads ((tenant, name)) are also added up on
    their own.

    Only the order of each workload's own events matters: a stream grouped by workload name
    (each name's events in log order) gives the same totals as the whole log in order, and
    so do meters over disjoint sets of names, added up (``Metered.add``).

    A month of a large fleet is millions of events, read in one tight loop: open holds are
    keyed by workload name (unique per tenant, and in practice across tenants: a namesake of
    another tenant goes to a second table), a placement's accumulators are small integers
    worked out once, a release's time is added to a list slot."""

    def __init__(
        self,
        start: datetime,
        end: datetime,
        gpu_models: Mapping[str, str],
        *,
        cuts: Sequence[datetime] = (),
        by_workload: bool = False,
        tracked: Collection[tuple[str, str]] = (),
        ranged: bool = False,
    ) -> None:
        self.start = micros(start)
        self.end = micros(end)
        edges = [self.start, *sorted(micros(c) for c in cuts), self.end]
        self.segments = [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]
        self.gpu_models = gpu_models
        self.by_workload = by_workload
        self.tracked_names = frozenset(tracked)
        self.open: dict[str, Held] = {}  # workload name -> its hold
        self.others: dict[tuple[str, str], Held] = {}  # holds of namesakes, by (tenant, name)
        self.lines: list[Key] = []
        self.line_ids: dict[Key, int] = {}
        self.acc: list[list[int]] = [[] for _ in self.segments] or [[]]
        self.tracked: dict[tuple[str, str], dict[tuple[int, int], int]] = {}
        self.matched_by_name = 0
        self.unknown: set[str] = set()
        self.events = 0
        self._tags: dict[Any, str] = {}
        self._skus: dict[str | None, str] = {}
        # What a meter over one range of the log (``range_meter``) tells the join: the first
        # release of each (tenant, name) that found no hold of this range (a hold from before
        # it ends there), whether that name had been placed in the range before it (if so the
        # release may not be that hold's end: the join looks it up), and every release that
        # names no tenant (matched by name and node, possibly against a hold from before).
        self.orphans: dict[tuple[str, str], tuple[int, bool]] = {}
        self.placed: set[str] | None = set() if ranged else None
        self.tenantless: list[tuple[int, str, str | None, str | None]] = []

    # -- the stream ---------------------------------------------------------------------------

    def feed(self, rows: Iterable[EventTuple]) -> None:
        """Apply usage events in log (``seq``) order (or grouped by name, see above)."""
        opened = self.open
        others = self.others
        line_ids = self.line_ids
        ws, we = self.start, self.end
        single = len(self.segments) == 1
        acc0 = self.acc[0]
        tracked_names = self.tracked_names
        skus = self._skus
        pools = self._tags
        by_workload = self.by_workload
        fromiso = datetime.fromisoformat
        epoch = _EPOCH
        orphans = self.orphans
        placed = self.placed
        count = 0
        for (
            action,
            ts,
            name,
            tenant,
            node,
            tags,
            profile,
            share,
            n,
            first,
            devices,
            members,
        ) in rows:
            count += 1
            if ts.__class__ is str:
                d = fromiso(ts) - epoch  # the store's naive UTC text
                t = (d.days * 86_400 + d.seconds) * 1_000_000 + d.microseconds
            else:
                t = micros(ts)
            if action == PLACE_ACTION:
                if tenant is None:
                    continue
                if placed is not None:
                    placed.add(name)
                if members is None and devices is None:
                    sku = skus.get(first)
                    if sku is None:
                        sku = self._sku(first)
                    pool = pools.get(tags) if tags.__class__ is str else None
                    if pool is None:
                        pool = self._pool(tags)
                    wl = name if by_workload else ""
                    if profile is not None:
                        line: Key = (tenant, pool, sku, MIG, profile, wl)
                        units = n or 0
                    elif share is not None:
                        line = (tenant, pool, sku, SHARED, "", wl)
                        units = (n or 0) * int(share)
                    else:
                        line = (tenant, pool, sku, GPU, "", wl)
                        units = n or 0
                    lid = line_ids.get(line)
                    if lid is None:
                        lid = self._line(line)
                    parts: Parts = ((lid, units),)
                else:
                    parts = self._parts(tenant, name, tags, profile, share, devices, members)
                new = (tenant, t, node, parts)
                held = opened.get(name)
                if held is None:
                    if others and (tenant, name) in others:  # its namesake left the main table
                        self._close(name, others.pop((tenant, name)), t)
                    opened[name] = new
                elif held[0] == tenant:  # placed again without a release: the old hold ends
                    self._close(name, held, t)
                    opened[name] = new
                else:  # another tenant's workload of the same name holds it
                    other = others.get((tenant, name))
                    if other is not None:
                        self._close(name, other, t)
                    others[(tenant, name)] = new
                continue
            if tenant is None:  # an older workload.cancel names no tenant: the name and node
                held = self._by_name(name, node)
                self.tenantless.append((t, name, node, None if held is None else held[0]))
                if held is None:
                    continue
            else:
                held = opened.pop(name, None)
                if held is None or held[0] != tenant:
                    if held is not None:  # a namesake's: put it back
                        opened[name] = held
                    held = others.pop((tenant, name), None) if others else None
                    if held is None:  # no hold of this meter's: one from before, if any
                        if (tenant, name) not in orphans:
                            orphans[(tenant, name)] = (t, placed is None or name not in placed)
                        continue
            if not single or (tracked_names and (tenant, name) in tracked_names):
                self._close(name, held, t)
                continue
            start = held[1]
            lo = start if start > ws else ws
            hi = t if t < we else we
            if hi > lo:
                dur = hi - lo
                for lid, units in held[3]:
                    acc0[lid] += dur * units
        self.events += count

    def finish(self) -> Metered:
        """Cut every interval still open at the end of the window and return the totals."""
        for name, held in sorted(self.open.items()):
            self._close(name, held, self.end)
        for (_tenant, name), held in sorted(self.others.items()):
            self._close(name, held, self.end)
        self.open, self.others = {}, {}
        lines = [UsageKey(*k) for k in self.lines]
        return Metered(
            {
                (i, lines[lid]): v
                for i, acc in enumerate(self.acc)
                for lid, v in enumerate(acc)
                if v
            },
            {
                key: {(i, lines[lid]): v for (i, lid), v in slots.items()}
                for key, slots in self.tracked.items()
            },
            self.matched_by_name,
            set(self.unknown),
            self.events,
        )

    def hand_over(self) -> RangePart:
        """``finish`` for the meter of one range of the log (made with ``ranged=True``): the
        holds still open are handed over, not cut (a later range ends them, or the join cuts
        them at the window's end)."""
        lines = self.lines
        holds: list[Carried] = [
            (h[0], name, h[1], h[2], tuple((lines[lid], u) for lid, u in h[3]))
            for name, h in self.open.items()
        ]
        holds.extend(
            (tenant, name, h[1], h[2], tuple((lines[lid], u) for lid, u in h[3]))
            for (tenant, name), h in self.others.items()
        )
        self.open, self.others = {}, {}
        return RangePart(self.finish(), holds, dict(self.orphans), list(self.tenantless))

    def end_hold(self, hold: Carried, end: int) -> None:
        """Add up a hold handed over by another range's meter, ended at ``end`` (µs)."""
        tenant, name, start, node, parts = hold
        ids = []
        for line, units in parts:
            lid = self.line_ids.get(line)
            ids.append((self._line(line) if lid is None else lid, units))
        self._close(name, (tenant, start, node, tuple(ids)), end)

    # -- internals ----------------------------------------------------------------------------

    def _line(self, line: Key) -> int:
        lid = self.line_ids[line] = len(self.lines)
        self.lines.append(line)
        for acc in self.acc:
            acc.append(0)
        return lid

    def _by_name(self, name: str, node: str | None) -> Held | None:
        """The hold a release without a tenant ends, taken out of its table: the workload of
        that name held on that node (the first tenant by name, should namesakes share it)."""
        found: list[tuple[str, bool]] = []
        held = self.open.get(name)
        if held is not None and held[2] == node:
            found.append((held[0], True))
        for (tenant, other), h in self.others.items():
            if other == name and h[2] == node:
                found.append((tenant, False))
        if not found:
            return None
        self.matched_by_name += 1
        tenant, main = min(found)
        if main:
            return self.open.pop(name)
        return self.others.pop((tenant, name))

    def _pool(self, tags: str | Mapping[str, str] | None) -> str:
        if tags is None:
            return ""
        hashable: Any = tags if isinstance(tags, str) else json.dumps(tags, sort_keys=True)
        pool = self._tags.get(hashable)
        if pool is None:
            parsed = json.loads(tags) if isinstance(tags, str) else tags
            pool = self._tags[hashable] = pool_name(parsed or {})
        return pool

    def _sku(self, uuid: str | None) -> str:
        sku = self.gpu_models.get(uuid) if uuid is not None else None
        if sku is None:
            self.unknown.add(uuid or "?")
            sku = UNKNOWN_SKU
        self._skus[uuid] = sku
        return sku

    def _parts(
        self,
        tenant: str,
        name: str,
        tags: str | Mapping[str, str] | None,
        profile: str | None,
        share: int | None,
        devices: str | list[Any] | None,
        members: str | list[Any] | None,
    ) -> Parts:
        """A gang, or a node with GPUs of several models: every device's own model."""
        if profile is not None:
            kind, each, label = MIG, 1, profile
        elif share is not None:
            kind, each, label = SHARED, int(share), ""
        else:
            kind, each, label = GPU, 1, ""
        pool = self._pool(tags)
        workload = name if self.by_workload else ""
        if members is not None:
            member_list = json.loads(members) if isinstance(members, str) else members
            uuids = [d["gpu_uuid"] for m in member_list for d in m["devices"]]
        else:
            assert devices is not None
            device_list = json.loads(devices) if isinstance(devices, str) else devices
            uuids = [d["gpu_uuid"] for d in device_list]
        units: dict[int, int] = {}
        for uuid in uuids:
            line = (tenant, pool, self._skus.get(uuid) or self._sku(uuid), kind, label, workload)
            lid = self.line_ids.get(line)
            if lid is None:
                lid = self._line(line)
            units[lid] = units.get(lid, 0) + each
        return tuple(sorted(units.items()))

    def _close(self, name: str, held: Held, end: int) -> None:
        tenant, start, _node, parts = held
        lo = max(start, self.start)
        hi = min(end, self.end)
        if hi <= lo:
            return
        tracked = None
        if (tenant, name) in self.tracked_names:
            tracked = self.tracked.setdefault((tenant, name), {})
        for i, (a, b) in enumerate(self.segments):
            s, e = max(lo, a), min(hi, b)
            if e <= s:
                continue
            acc = self.acc[i]
            for lid, units in parts:
                acc[lid] += (e - s) * units
                if tracked is not None:
                    tracked[(i, lid)] = tracked.get((i, lid), 0) + (e - s) * units


def join_ranges(
    meter: Meter, parts: Sequence[RangePart], first_event: FirstEvent
) -> Metered | None:
    """What one meter over the whole log in order adds up, from meters over consecutive
    ranges of ``seq`` (``parts``, in log order, each made with ``ranged=True``: it knew
    nothing of the holds open at its range's start). ``meter`` is a fresh meter of the same
    window, cuts and tracking: it ends the holds handed over.

    A hold open at the end of a range ends at the first usage event of its (tenant, name) in
    a later range: a release that found no hold there (``RangePart.orphans``), when nothing
    of that name was placed in that range before it; otherwise ``first_event`` looks it up
    (a placement again, or a release after one). Holds open at the end of the last range are
    cut at the window's end, as ``Meter.finish`` does. None when a release that names no
    tenant meets a handed-over hold of its name: the meter that matched it by name and node
    did not know that hold, so the caller meters the log in one pass instead."""
    carried: dict[tuple[str, str], Carried] = {}
    for j, part in enumerate(parts):
        if carried:
            names = {name for _tenant, name in carried}
            if any(name in names for _t, name, _node, _tenant in part.tenantless):
                return None
            for key, hold in list(carried.items()):
                orphan = part.orphans.get(key)
                t = orphan[0] if orphan is not None and orphan[1] else first_event(j, *key)
                if t is not None:
                    meter.end_hold(hold, t)
                    del carried[key]
        for hold in part.holds:
            carried[(hold[0], hold[1])] = hold
    for hold in carried.values():
        meter.end_hold(hold, meter.end)
    total = meter.finish()
    for part in parts:
        total.add(part.metered)
    return total


# --- pricing -------------------------------------------------------------------------------------


def round_fraction(value: Fraction, places: int) -> Decimal:
    """``value`` rounded ROUND_HALF_EVEN to ``places`` decimals, exactly (no float, no
    intermediate decimal context)."""
    scaled = value * 10**places
    n, r = divmod(scaled.numerator, scaled.denominator)
    twice = 2 * r
    if twice > scaled.denominator or (twice == scaled.denominator and n % 2 == 1):
        n += 1
    return Decimal(n).scaleb(-places)


def gpu_fraction(sku: str, kind: str, profile: str) -> Fraction:
    """GPUs one unit of this key stands for: 1 (a whole GPU), the MIG profile's compute
    slices over 7, or 1/1000 (a unit of a share is one thousandth of a GPU)."""
    if kind == GPU:
        return Fraction(1)
    if kind == SHARED:
        return Fraction(1, 1000)
    spec = SKUS.get(sku)
    prof = spec.profile(profile) if spec is not None else None
    if prof is None:
        raise ValidationFailed(
            f"MIG profile {profile!r} is not one of {sku}'s: its usage cannot be weighted",
            code="usage_unweighable",
            details={"sku": sku, "mig_profile": profile},
        )
    return Fraction(prof.compute_slices, COMPUTE_SLICES)


@dataclass(frozen=True, slots=True)
class UsageLine:
    """One line of the report: a tenant's usage in one rate segment, at the chosen grouping
    (the fields finer than it are None)."""

    tenant: str
    pool: str | None
    sku: str | None
    kind: str | None
    mig_profile: str | None
    workload: str | None
    period_start: datetime
    period_end: datetime
    gpu_hours: Decimal  # GPU-equivalent hours (MIG weighted by compute slices, shares)
    device_hours: Decimal | None  # hours of the devices held: GPUs, or MIG instances
    pricing_unit: str | None  # "GPU-Hours" or "Instance-Hours" (a MIG profile's own price)
    pricing_quantity: Decimal | None
    list_unit_price: Decimal | None
    contracted_unit_price: Decimal | None
    list_cost: Decimal
    billed_cost: Decimal  # list less the card's discount; also the effective cost
    energy_kwh: Decimal | None
    sku_id: str | None  # "H100-80GB", "H100-80GB/3g.40gb", "H100-80GB/shared"


@dataclass(frozen=True, slots=True)
class TenantTotal:
    tenant: str
    gpu_hours: Decimal
    list_cost: Decimal
    billed_cost: Decimal
    energy_kwh: Decimal


@dataclass(frozen=True, slots=True)
class Waste:
    """Allocated but idle device-hours of one tenant, from telemetry hourly rollups of
    ``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` (each rollup row: one device, one hour)."""

    tenant: str
    allocated_device_hours: int
    idle_device_hours: int  # hours whose max activity stayed below the threshold
    utilisation_adjusted_idle_hours: Decimal  # sum of (1 - mean activity) over those hours
    mean_activity: Decimal | None


@dataclass(frozen=True, slots=True)
class UsageReport:
    start: datetime
    end: datetime  # where intervals were cut: min(to, now)
    requested_end: datetime
    group_by: str
    currency: str
    rate_card_name: str
    rate_card_digest: str
    minor_unit: int
    lines: tuple[UsageLine, ...]
    tenants: tuple[TenantTotal, ...]
    total_gpu_hours: Decimal
    total_list_cost: Decimal
    total_billed_cost: Decimal
    total_energy_kwh: Decimal
    unallocated_energy_kwh: Decimal | None
    notes: tuple[str, ...]
    waste: tuple[Waste, ...] | None = None


Dims = tuple[str, str | None, str | None, str | None, str, str | None]


def _dims(group_by: str, key: UsageKey) -> Dims:
    tenant, pool, sku, kind, profile, workload = key
    if group_by == "tenant":
        return (tenant, None, None, None, "", None)
    if group_by == "pool":
        return (tenant, pool, None, None, "", None)
    if group_by == "sku":
        return (tenant, pool, sku, kind, profile, None)
    return (tenant, pool, sku, kind, profile, workload)


def _sku_id(sku: str | None, kind: str | None, profile: str) -> str | None:
    if sku is None:
        return None
    if kind == MIG:
        return f"{sku}/{profile}"
    if kind == SHARED:
        return f"{sku}/shared"
    return sku


@dataclass
class _Acc:
    gpu_hours: Fraction = Fraction(0)
    device_hours: Fraction | None = Fraction(0)
    list_cost: Fraction = Fraction(0)
    pricing_quantity: Fraction = Fraction(0)
    unit: str | None = None
    unit_price: Decimal | None = None
    uniform: bool = True  # one unit and one price: the unit price is the line's
    energy: Fraction = Fraction(0)
    has_energy: bool = False


def _price_part(
    seg: Segment, key: UsageKey, units_us: int, missing: set[str]
) -> tuple[Fraction, Fraction | None, Fraction, str, Fraction, Decimal]:
    """(GPU-hours, device-hours, list cost, pricing unit, pricing quantity, unit price) of one
    accumulator in one rate segment."""
    hours = Fraction(units_us, MICROS_PER_HOUR)
    gpu_hours = hours * gpu_fraction(key.sku, key.kind, key.profile)
    device_hours: Fraction | None = None if key.kind == SHARED else hours
    rate = seg.period.skus.get(key.sku)
    if rate is None:
        missing.add(key.sku)
        return (gpu_hours, device_hours, Fraction(0), "GPU-Hours", gpu_hours, Decimal(0))
    if key.kind == MIG and key.profile in rate.mig:
        price = rate.mig[key.profile]
        return (gpu_hours, device_hours, hours * Fraction(price), "Instance-Hours", hours, price)
    price = rate.gpu_hour
    return (gpu_hours, device_hours, gpu_hours * Fraction(price), "GPU-Hours", gpu_hours, price)


def _energy_shares(
    metered: Metered, energy: Mapping[tuple[str, str], float]
) -> tuple[dict[tuple[int, UsageKey], Fraction], dict[str, Fraction]]:
    """Each tracked workload's metered energy shared among the accumulators it used, in
    proportion to its GPU-equivalent time in each; energy of a workload that held nothing in
    the window stays with its tenant (second value)."""
    out: dict[tuple[int, UsageKey], Fraction] = {}
    leftover: dict[str, Fraction] = {}
    for (tenant, name), kwh in sorted(energy.items()):
        value = Fraction(Decimal(repr(kwh)))
        used = metered.tracked.get((tenant, name))
        weights = {
            slot: units * gpu_fraction(slot[1].sku, slot[1].kind, slot[1].profile)
            for slot, units in sorted((used or {}).items())
        }
        total = sum(weights.values(), Fraction(0))
        if total == 0:
            leftover[tenant] = leftover.get(tenant, Fraction(0)) + value
            continue
        for slot, w in weights.items():
            out[slot] = out.get(slot, Fraction(0)) + value * w / total
    return out, leftover


def price(
    metered: Metered,
    card: RateCard,
    segments: Sequence[Segment],
    *,
    start: datetime,
    end: datetime,
    requested_end: datetime,
    group_by: str = "sku",
    tenants: Collection[str] | None = None,
    energy: Mapping[tuple[str, str], float] | None = None,
    unallocated_energy: float | None = None,
    notes: Sequence[str] = (),
    waste: Sequence[Waste] | None = None,
) -> UsageReport:
    """The priced report: ``metered`` (from a ``Meter`` over the same ``segments``) grouped
    by ``group_by`` (tenant | pool | sku | workload: each adds dimensions to the previous; sku
    and workload lines are per SKU and MIG profile), for ``tenants`` (None: every tenant).
    ``energy`` is the metered kWh per (tenant, workload)."""
    if group_by not in GROUP_BY:
        raise ValidationFailed(
            f"group_by {group_by!r}: one of {', '.join(GROUP_BY)}",
            code="invalid_group_by",
            details={"group_by": group_by, "allowed": list(GROUP_BY)},
        )
    wanted = None if tenants is None else frozenset(tenants)
    energy_by_slot, energy_leftover = _energy_shares(metered, energy or {})
    missing: set[str] = set()
    lines: dict[tuple[int, tuple[Any, ...]], _Acc] = {}
    for (seg_index, key), units_us in sorted(metered.usage.items()):
        if wanted is not None and key.tenant not in wanted:
            continue
        seg = segments[seg_index]
        gpu_h, dev_h, cost, unit, qty, unit_price = _price_part(seg, key, units_us, missing)
        acc = lines.setdefault((seg_index, _dims(group_by, key)), _Acc())
        acc.gpu_hours += gpu_h
        if dev_h is None or acc.device_hours is None:
            acc.device_hours = None
        else:
            acc.device_hours += dev_h
        acc.list_cost += cost
        acc.pricing_quantity += qty
        if acc.unit is None:
            acc.unit, acc.unit_price = unit, unit_price
        elif acc.unit != unit or acc.unit_price != unit_price:
            acc.uniform = False
        share = energy_by_slot.get((seg_index, key))
        if share is not None:
            acc.energy += share
            acc.has_energy = True
    if missing:
        raise ValidationFailed(
            f"rate card {card.name or card.digest[:12]!r} has no price for "
            f"{', '.join(sorted(missing))}, used in the report window",
            code="rate_missing",
            details={"skus": sorted(missing), "rate_card": card.name},
        )
    minor = card.minor_unit
    out: list[UsageLine] = []
    totals: dict[str, list[Any]] = {}
    for (seg_index, dims), acc in sorted(lines.items(), key=lambda kv: _line_order(kv[0])):
        seg = segments[seg_index]
        tenant, pool, sku, kind, profile, workload = dims
        keep = Fraction(1) - Fraction(seg.period.discount)
        list_cost = round_fraction(acc.list_cost, minor)
        billed = round_fraction(acc.list_cost * keep, minor)
        per_sku = sku is not None and acc.uniform
        line_price = acc.unit_price if per_sku else None
        line = UsageLine(
            tenant=tenant,
            pool=pool,
            sku=sku,
            kind=kind,
            mig_profile=profile or None,
            workload=workload,
            period_start=seg.start,
            period_end=seg.end,
            gpu_hours=round_fraction(acc.gpu_hours, QUANTITY_PLACES),
            device_hours=(
                None
                if acc.device_hours is None or sku is None
                else round_fraction(acc.device_hours, QUANTITY_PLACES)
            ),
            pricing_unit=acc.unit if per_sku else None,
            pricing_quantity=(
                round_fraction(acc.pricing_quantity, QUANTITY_PLACES) if per_sku else None
            ),
            list_unit_price=line_price,
            contracted_unit_price=(
                None if line_price is None else line_price * (1 - seg.period.discount)
            ),
            list_cost=list_cost,
            billed_cost=billed,
            energy_kwh=round_fraction(acc.energy, ENERGY_PLACES) if acc.has_energy else None,
            sku_id=_sku_id(sku, kind, profile),
        )
        out.append(line)
        t = totals.setdefault(tenant, [Fraction(0), Decimal(0), Decimal(0), Fraction(0)])
        t[0] += acc.gpu_hours
        t[1] += list_cost
        t[2] += billed
        t[3] += acc.energy
    for tenant, kwh in energy_leftover.items():
        if wanted is None or tenant in wanted:
            totals.setdefault(tenant, [Fraction(0), Decimal(0), Decimal(0), Fraction(0)])
            totals[tenant][3] += kwh
    tenant_totals = tuple(
        TenantTotal(
            tenant=name,
            gpu_hours=round_fraction(t[0], QUANTITY_PLACES),
            list_cost=t[1],
            billed_cost=t[2],
            energy_kwh=round_fraction(t[3], ENERGY_PLACES),
        )
        for name, t in sorted(totals.items())
    )
    zero = Decimal(0).scaleb(-minor)
    return UsageReport(
        start=start,
        end=end,
        requested_end=requested_end,
        group_by=group_by,
        currency=card.currency,
        rate_card_name=card.name,
        rate_card_digest=card.digest,
        minor_unit=minor,
        lines=tuple(out),
        tenants=tenant_totals,
        total_gpu_hours=round_fraction(sum((t[0] for t in totals.values()), Fraction(0)), 6),
        total_list_cost=sum((t.list_cost for t in tenant_totals), zero),
        total_billed_cost=sum((t.billed_cost for t in tenant_totals), zero),
        total_energy_kwh=round_fraction(
            sum((t[3] for t in totals.values()), Fraction(0)), ENERGY_PLACES
        ),
        unallocated_energy_kwh=(
            None
            if unallocated_energy is None
            else round_fraction(Fraction(Decimal(repr(unallocated_energy))), ENERGY_PLACES)
        ),
        notes=tuple(notes),
        waste=None if waste is None else tuple(waste),
    )


def _line_order(key: tuple[int, tuple[Any, ...]]) -> tuple[Any, ...]:
    seg_index, dims = key
    return (dims[0], tuple("" if d is None else d for d in dims[1:]), seg_index)


# --- the waste view ------------------------------------------------------------------------------

ACTIVITY_FIELD = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
IDLE_THRESHOLD = 0.05


def waste_view(
    rows: Iterable[Mapping[str, Any]],
    *,
    threshold: float = IDLE_THRESHOLD,
    tenants: Collection[str] | None = None,
) -> list[Waste]:
    """Allocated-but-idle device-hours per tenant from hourly rollups of the activity field
    (rows of other fields, and of devices no workload held, are skipped)."""
    wanted = None if tenants is None else frozenset(tenants)
    acc: dict[str, list[Any]] = {}
    for row in rows:
        tenant = row.get("tenant")
        if row.get("field") != ACTIVITY_FIELD or tenant is None or row.get("workload") is None:
            continue
        if wanted is not None and tenant not in wanted:
            continue
        count = int(row.get("count") or 0)
        if count <= 0:
            continue
        mean = Fraction(Decimal(repr(float(row["sum"])))) / count
        mean = min(max(mean, Fraction(0)), Fraction(1))
        a = acc.setdefault(tenant, [0, 0, Fraction(0), Fraction(0)])
        a[0] += 1
        if float(row["max"]) < threshold:
            a[1] += 1
        a[2] += 1 - mean
        a[3] += mean
    return [
        Waste(
            tenant=t,
            allocated_device_hours=a[0],
            idle_device_hours=a[1],
            utilisation_adjusted_idle_hours=round_fraction(a[2], QUANTITY_PLACES),
            mean_activity=round_fraction(a[3] / a[0], 4) if a[0] else None,
        )
        for t, a in sorted(acc.items())
    ]


# --- rendering -----------------------------------------------------------------------------------


def fmt_time(ts: datetime) -> str:
    """UTC, ``Z``, seconds (FOCUS's date/time format); microseconds only when there are some."""
    ts = ts.astimezone(UTC)
    if ts.microsecond:
        return ts.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return ts.strftime("%Y-%m-%dT%H:%M:%SZ")


def _s(value: Decimal | None) -> str | None:
    return None if value is None else str(value)


def line_json(line: UsageLine, currency: str) -> dict[str, Any]:
    return {
        "tenant": line.tenant,
        "pool": line.pool,
        "tags": pool_tags(line.pool) if line.pool is not None else None,
        "sku": line.sku,
        "kind": line.kind,
        "mig_profile": line.mig_profile,
        "sku_id": line.sku_id,
        "workload": line.workload,
        "period_start": fmt_time(line.period_start),
        "period_end": fmt_time(line.period_end),
        "gpu_hours": str(line.gpu_hours),
        "device_hours": _s(line.device_hours),
        "pricing_unit": line.pricing_unit,
        "pricing_quantity": _s(line.pricing_quantity),
        "list_unit_price": _s(line.list_unit_price),
        "contracted_unit_price": _s(line.contracted_unit_price),
        "list_cost": str(line.list_cost),
        "billed_cost": str(line.billed_cost),
        "currency": currency,
        "energy_kwh": _s(line.energy_kwh),
    }


def report_json(report: UsageReport) -> dict[str, Any]:
    """The report as JSON values: decimals as strings (exact), times in UTC with ``Z``."""
    return {
        "window": {
            "from": fmt_time(report.start),
            "to": fmt_time(report.requested_end),
            "end": fmt_time(report.end),
            "partial": report.end < report.requested_end,
        },
        "group_by": report.group_by,
        "currency": report.currency,
        "rate_card": {"name": report.rate_card_name, "sha256": report.rate_card_digest},
        "rounding": (
            f"{ROUNDING} to {Decimal(1).scaleb(-report.minor_unit)} {report.currency} per line; "
            f"totals are sums of lines; quantities to {QUANTITY_PLACES} decimals"
        ),
        "lines": [line_json(x, report.currency) for x in report.lines],
        "tenants": [
            {
                "tenant": t.tenant,
                "gpu_hours": str(t.gpu_hours),
                "list_cost": str(t.list_cost),
                "billed_cost": str(t.billed_cost),
                "energy_kwh": str(t.energy_kwh),
            }
            for t in report.tenants
        ],
        "total": {
            "gpu_hours": str(report.total_gpu_hours),
            "list_cost": str(report.total_list_cost),
            "billed_cost": str(report.total_billed_cost),
            "energy_kwh": str(report.total_energy_kwh),
            "unallocated_energy_kwh": _s(report.unallocated_energy_kwh),
        },
        "waste": (
            None
            if report.waste is None
            else [
                {
                    "tenant": w.tenant,
                    "allocated_device_hours": w.allocated_device_hours,
                    "idle_device_hours": w.idle_device_hours,
                    "utilisation_adjusted_idle_hours": str(w.utilisation_adjusted_idle_hours),
                    "mean_activity": _s(w.mean_activity),
                }
                for w in report.waste
            ]
        ),
        "notes": list(report.notes),
    }


def report_bytes(report: UsageReport) -> bytes:
    """The JSON report as bytes: keys in a fixed order, no whitespace variation."""
    return (json.dumps(report_json(report), separators=(",", ":")) + "\n").encode()


CSV_COLUMNS = (
    "tenant",
    "pool",
    "sku_id",
    "workload",
    "period_start",
    "period_end",
    "gpu_hours",
    "device_hours",
    "pricing_unit",
    "pricing_quantity",
    "list_unit_price",
    "list_cost",
    "billed_cost",
    "currency",
    "energy_kwh",
)


def csv_cell(value: object) -> str:
    """RFC 4180 quoting (only where needed), None as the empty cell."""
    if value is None:
        return ""
    text = str(value)
    if any(c in text for c in ',"\r\n'):
        return '"' + text.replace('"', '""') + '"'
    return text


def report_csv(report: UsageReport) -> str:
    """The lines as CSV (``\\n`` line ends), a header row first."""
    rows = [",".join(CSV_COLUMNS)]
    for line in report.lines:
        j = line_json(line, report.currency)
        rows.append(",".join(csv_cell(j[c]) for c in CSV_COLUMNS))
    return "\n".join(rows) + "\n"
