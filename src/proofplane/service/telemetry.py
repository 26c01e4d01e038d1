"""Telemetry (issue 15): ingesting the agents' GPU samples, keeping them (raw for
PROOFPLANE_TELEMETRY_RAW_HOURS, default 48; hourly rollups for 400 days), and the read
functions metering, alerting and capacity use.

Ingest (``ingest``): a node's agent posts readings of its own GPUs and MIG instances
(``meter.samples.parse_devices`` checks the body). A device's readings at one time (a
*sample*: 17 DCGM fields of a GPU, 5 of a MIG instance) are one row of ``telemetry_samples``,
one nullable column per field (``store.tables.TELEMETRY_COLUMNS``), written with one prepared
``executemany`` per post: no ORM object and no row per reading. Each sample is keyed to the
placement that held the device at that moment (its series, ``telemetry_device_series``): a
whole GPU's holder; a MIG instance's holder; for a sample of a whole GPU that MIG instances or
shares of several workloads divide, one row per holder with its ``share`` (its compute-slice
fraction, its share_milli / 1000) and one unattributed row for the rest (counters are split
by share, so energy adds up; see ``meter.rollup``). ``telemetry_device_latest`` keeps each
device's newest sample (a field it lacks keeps its previous value). A
holder placed after the reading's time did not hold it then. Readings of health fields go
through ``meter.health``: a fatal one drains the GPU (``service.gpu_health``) in the same
transaction. A reading sent twice is stored once (a retried batch is harmless).

Samples are measurements, not control-plane state: storing them writes no audit event (a
fleet posts hundreds of batches a second). What they cause does: a drained GPU, an idle
notice, a reclaimed workload each write their event.

Read functions (for M2/M3; no actor: callers authorize):

* ``hourly(store, *, start, end, tenant=None, field=None) -> list[dict]``: one dict per
  (hour, node, gpu_uuid, gi_id, field, workload, tenant) with ``count, sum, min, max, last``
  and ``simulated``, for the hours starting in [start, end), oldest first. Hours the rollup
  worker has not stored yet are rolled up from the raw readings on the fly. Counters (energy,
  ECC): ``sum`` is the increase attributed to that holder in that hour.
* ``latest(store, *, node=None) -> list[dict]``: the newest reading per device and field
  (``node, gpu_uuid, gi_id, profile, field, ts, value, workload, tenant, simulated``; the
  holder when the device had exactly one then, else None).
* ``energy_kwh(store, *, start, end) -> dict[(tenant, workload), float]``: metered energy per
  holder over the hours starting in [start, end); (None, None): energy nobody held.
"""

from __future__ import annotations

import threading
import weakref
from collections import ChainMap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, bindparam, delete, func, insert, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from proofplane.access import Actor, Permission, authorize
from proofplane.errors import InvalidState, NotFound, ValidationFailed
from proofplane.hardware.skus import COMPUTE_SLICES, SKUS
from proofplane.meter.fields import COUNTERS, FIELDS, GR_ENGINE_ACTIVE, TOTAL_ENERGY
from proofplane.meter.health import HEALTH_FIELDS, Finding, assess, worth_checking
from proofplane.meter.rollup import HOUR, Hourly, Point, SeriesKey, hour_of, merge, rollup
from proofplane.meter.samples import MAX_SAMPLES, DeviceSample, Sample, parse_devices
from proofplane.model import NodeState
from proofplane.service.attestation import authorize_node
from proofplane.service.context import Store
from proofplane.service.pagination import Page, check_limit, decode_cursor, paginate
from proofplane.store.audit_log import sqlite_connection
from proofplane.store.tables import (
    TELEMETRY_COLUMNS,
    EventRow,
    GpuRow,
    NodeRow,
    PlacementRow,
    TelemetryHourlyRow,
    TelemetrySeriesRow,
    TenantRow,
    WorkloadRow,
    placement_nodes,
    telemetry_device_latest,
    telemetry_samples,
)

RAW_HOURS = 48.0  # PROOFPLANE_TELEMETRY_RAW_HOURS
HOURLY_DAYS = 400
#: how far back a counter's previous reading is looked for when an hour is rolled up
COUNTER_LOOKBACK = timedelta(hours=2)
#: an hour is rolled up (and stored) once it ended this long ago (late batches still count)
ROLLUP_GRACE = timedelta(minutes=2)
MJ_PER_KWH = 3.6e9
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_SEP = "\x1f"


def to_ms(ts: datetime) -> int:
    return (ts - _EPOCH) // timedelta(milliseconds=1)


def from_ms(ms: int) -> datetime:
    return _EPOCH + timedelta(milliseconds=ms)


# --- who holds what on a node ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Holder:
    workload: str
    tenant: str
    since: datetime
    share: float  # of the whole GPU


@dataclass(slots=True)
class NodeDevices:
    """One node's GPUs and the placements holding them, for attributing readings."""

    node: str
    state: str
    gpus: dict[str, tuple[int, str | None, dict[int, str]]]  # uuid → (index, model, start→prof)
    whole: dict[str, Holder] = field(default_factory=dict)
    mig: dict[tuple[str, int], Holder] = field(default_factory=dict)
    parts: dict[str, list[Holder]] = field(default_factory=dict)  # slices and shares of a GPU
    # per device (uuid, gi_id, profile, mig_start, simulated): who holds it once every holder
    # is placed (the newest ``since``), as series identities, the sole holder and the
    # device's key: a node's devices are worked out once per change, not once per post
    resolved: dict[tuple[Any, ...], _Resolved] = field(default_factory=dict)
    node_id: int = 0


@dataclass(frozen=True, slots=True)
class _Resolved:
    since: datetime  # valid for samples at or after this time
    idents: tuple[tuple[Any, ...], ...]  # a series identity per holder (and the rest)
    sole: tuple[str | None, str | None]
    key: str  # telemetry_device_latest


def _slice_share(model: str | None, profile: str | None) -> float:
    sku = SKUS.get(model or "")
    p = sku.profile(profile) if sku is not None and profile else None
    slices = p.compute_slices if p is not None else int((profile or "1g").split("g", 1)[0] or 1)
    return min(1.0, slices / COMPUTE_SLICES)


def load_devices(session: Session, node_id: int, name: str, state: str) -> NodeDevices:
    """The node's GPUs (from its inventory) and who holds each now."""
    gpus = {
        uuid: (index, model, {int(i["start"]): str(i["profile"]) for i in (mig or ())})
        for uuid, index, model, mig in session.execute(
            select(GpuRow.uuid, GpuRow.index, GpuRow.model, GpuRow.mig_instances).where(
                GpuRow.node_id == node_id
            )
        )
    }
    out = NodeDevices(name, state, gpus, node_id=node_id)
    on_node = select(placement_nodes.c.placement_id).where(placement_nodes.c.node_id == node_id)
    rows = session.execute(
        select(
            PlacementRow.devices, PlacementRow.members, PlacementRow.placed_at,
            WorkloadRow.name, TenantRow.name, NodeRow.name,
        )
        .join(WorkloadRow, WorkloadRow.id == PlacementRow.workload_id)
        .join(TenantRow, TenantRow.id == WorkloadRow.tenant_id)
        .join(NodeRow, NodeRow.id == PlacementRow.node_id)
        .where(or_(PlacementRow.node_id == node_id, PlacementRow.id.in_(on_node)))
    )  # fmt: skip
    for devices, members, placed_at, workload, tenant, primary in rows:
        parts = members or [{"node": primary, "devices": devices}]
        for part in parts:
            if part.get("node") != name:
                continue
            for d in part.get("devices") or ():
                uuid = d.get("gpu_uuid")
                if uuid not in gpus:
                    continue
                start, milli = d.get("mig_start"), d.get("share_milli")
                if start is not None:
                    share = _slice_share(gpus[uuid][1], d.get("mig_profile"))
                    h = Holder(workload, tenant, placed_at, share)
                    out.mig[(uuid, int(start))] = h
                    out.parts.setdefault(uuid, []).append(h)
                elif milli is not None:
                    h = Holder(workload, tenant, placed_at, min(1.0, int(milli) / 1000))
                    out.parts.setdefault(uuid, []).append(h)
                else:
                    out.whole[uuid] = Holder(workload, tenant, placed_at, 1.0)
    return out


class _DeviceCache:
    """Per database: each node's ``NodeDevices`` and the newest event seq it was read at.
    Every change to placements, inventory or drains writes an event (rule 1), so an
    unchanged newest seq means an unchanged answer."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.nodes: dict[str, tuple[int, NodeDevices]] = {}
        self.series: dict[tuple[Any, ...], int] = {}  # series identity → id (committed ones)
        self.seen: dict[int, int] = {}  # series id → the newest hour (ms // HOUR_MS) stamped

    @staticmethod
    def newest(session: Session) -> int:
        raw = sqlite_connection(session)
        if raw is not None:
            return int(raw.execute("SELECT max(seq) FROM events").fetchone()[0] or 0)
        return int(session.scalar(select(func.max(EventRow.seq))) or 0)

    def cached(self, session: Session, name: str) -> NodeDevices | None:
        """The node's devices (its id and state with them) when nothing changed since they
        were read; None: read them (``devices``)."""
        newest = self.newest(session)
        with self.lock:
            hit = self.nodes.get(name)
        return hit[1] if hit is not None and hit[0] == newest else None

    def devices(self, session: Session, node_id: int, name: str, state: str) -> NodeDevices:
        newest = self.newest(session)
        with self.lock:
            hit = self.nodes.get(name)
        if hit is not None and hit[0] == newest:
            return hit[1]
        devices = load_devices(session, node_id, name, state)
        with self.lock:
            if len(self.nodes) > 100_000:
                self.nodes.clear()
            self.nodes[name] = (newest, devices)
        return devices


_CACHES: weakref.WeakKeyDictionary[Engine, _DeviceCache] = weakref.WeakKeyDictionary()
_CACHES_LOCK = threading.Lock()


def _cache(engine: Engine) -> _DeviceCache:
    with _CACHES_LOCK:
        c = _CACHES.get(engine)
        if c is None:
            c = _CACHES[engine] = _DeviceCache()
        return c


# --- ingest ----------------------------------------------------------------------------------


def _series_key(*parts: object) -> str:
    return _SEP.join("" if p is None else str(p) for p in parts)


@dataclass(frozen=True, slots=True)
class Ingested:
    node: str
    accepted: int
    stored: int
    ignored: dict[str, int]
    drained: list[dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "accepted": self.accepted,
            "stored": self.stored,
            "ignored": self.ignored,
            "drained": self.drained,
        }


def ingest(
    store: Store,
    actor: Actor,
    name: str,
    body: Any,
    *,
    now: datetime | None = None,
    raw_hours: float = RAW_HOURS,
    max_samples: int = MAX_SAMPLES,
) -> Ingested:
    """Store a node's posted readings (see the module docstring). ``invalid_telemetry`` /
    ``too_many_samples`` (422) for a body that is not the form; ``gpu_not_on_node`` (422) for
    a reading of a GPU the node does not have; 404 for a node an agent is not; 409
    ``decommissioned_node``."""
    authorize_node(actor, name)
    now = now or datetime.now(UTC)
    batch = parse_devices(
        body, now=now, oldest=now - timedelta(hours=raw_hours), max_samples=max_samples
    )
    return store_devices(store, actor, name, batch.devices, simulated=batch.simulated,
                         ignored=batch.ignored, now=now)  # fmt: skip


def store_samples(
    store: Store,
    actor: Actor,
    name: str,
    samples: Sequence[Sample],
    *,
    simulated: bool = False,
    ignored: dict[str, int] | None = None,
    now: datetime | None = None,
) -> Ingested:
    """Store checked samples of node ``name`` (one per reading: the demo's simulated source),
    grouped per device and time as ``store_devices`` keeps them."""
    groups: dict[tuple[Any, ...], DeviceSample] = {}
    for s in samples:
        key = (s.gpu_uuid, s.gi_id, s.profile, s.mig_start, s.ts)
        d = groups.get(key)
        if d is None:
            d = groups[key] = DeviceSample(s.gpu_uuid, s.gi_id, s.profile, s.mig_start, s.ts, {})
        d.values.setdefault(s.field, s.value)
    return store_devices(store, actor, name, list(groups.values()), simulated=simulated,
                         ignored=ignored, now=now)  # fmt: skip


def store_devices(
    store: Store,
    actor: Actor,
    name: str,
    devices: Sequence[DeviceSample],
    *,
    simulated: bool = False,
    ignored: dict[str, int] | None = None,
    now: datetime | None = None,
) -> Ingested:
    """Store checked device samples of node ``name`` (``ingest`` after parsing): one row per
    device holder and time, the device's newest sample, and the health check, in one write
    transaction."""
    from proofplane.service import gpu_health

    cache = _cache(store.engine)
    with store.write(actor, now) as tx:
        session = tx.session
        held = cache.cached(session, name)  # unchanged since the last post: no node query
        if held is not None:
            node_id, state = held.node_id, held.state
        else:
            found = session.execute(
                select(NodeRow.id, NodeRow.state).where(NodeRow.name == name)
            ).first()
            if found is None:
                raise NotFound(f"node {name!r} not found", details={"node": name})
            node_id, state = found
        if state == NodeState.DECOMMISSIONED.value:
            raise InvalidState(
                f"node {name!r} is decommissioned", code="decommissioned_node",
                details={"node": name},
            )  # fmt: skip
        if held is None:
            held = cache.devices(session, node_id, name, state)
        att = _attribute(held, devices, simulated)
        series_ids = _series_ids(session, cache, att.rows)
        rows = [(row[0], series_ids[k[0]], *row[1:]) for k, row in att.rows.items()]
        _insert_samples(session, rows)
        _mark_seen(session, cache, {(series_ids[ident], ms // HOUR_MS) for ident, ms in att.rows})
        # only a reading that could mean trouble needs the device's previous one (a fleet's
        # readings are XID 0, no ECC error, cool: no extra query)
        worth = {(key, f) for key, _ts, _uuid, f, value in att.health
                 if worth_checking(f, value)}  # fmt: skip
        previous = _previous(session, {k for k, _f in worth}) if worth else {}
        _upsert_latest(session, list(att.latest.values()))
        drained: list[dict[str, Any]] = []
        if worth:
            node = session.get(NodeRow, node_id)
            assert node is not None
            for key, _ts, uuid, f, value in sorted(att.health, key=lambda h: h[1]):
                if (key, f) not in worth:
                    continue
                finding = assess(f, value, previous.get((key, f)))
                previous[(key, f)] = value
                if finding is not None:
                    done = gpu_health.drain(tx, node, uuid, finding)
                    if done is not None:
                        drained.append(done)
        return Ingested(name, att.readings, att.stored, dict(ignored or {}), drained)


def _device_key(node: str, uuid: str, gi_id: int | None) -> str:
    """A device's key in ``telemetry_device_latest`` (node first: a node's devices sit
    together, and its post updates one or two pages)."""
    return f"{node}{_SEP}{uuid}{_SEP}{'' if gi_id is None else gi_id}"


#: The fields in storage order, and their columns (``store.tables.TELEMETRY_COLUMNS``).
_ORDER: tuple[str, ...] = tuple(TELEMETRY_COLUMNS)
_COLS: tuple[str, ...] = tuple(TELEMETRY_COLUMNS.values())
_HEALTH_ORDER = tuple((i, f) for i, f in enumerate(_ORDER) if f in HEALTH_FIELDS)

_Ident = tuple[Any, ...]  # a series: node, gpu_uuid, gi_id, profile, workload, tenant, share,
# simulated


@dataclass(slots=True)
class _Attributed:
    rows: dict[tuple[_Ident, int], list[Any]]  # (series, ms) → [ms, value per _ORDER field]
    latest: dict[str, list[Any]]  # device key → a telemetry_device_latest row (_LATEST_COLS)
    health: list[tuple[str, int, str, str, float]]  # (device key, ms, uuid, field, value)
    readings: int = 0
    stored: int = 0


def _attribute(
    devices: NodeDevices, samples: Iterable[DeviceSample], simulated: bool
) -> _Attributed:
    """Each device sample's rows (one per holder: series identity and time → values), the
    newest sample per device (a row of ``telemetry_device_latest``), and the readings of
    health fields. ``gpu_not_on_node`` for another node's GPU."""
    out = _Attributed({}, {}, [])
    rows, latest, health = out.rows, out.latest, out.health
    resolved = devices.resolved
    order = _ORDER
    ms_of: dict[datetime, int] = {}
    readings = stored = 0
    for s in samples:
        uuid, gi, profile, ts, values = s.gpu_uuid, s.gi_id, s.profile, s.ts, s.values
        if not values:
            continue
        ms = ms_of.get(ts)
        if ms is None:
            ms = ms_of[ts] = to_ms(ts)
        r = resolved.get((uuid, gi, profile, s.mig_start, simulated))
        if r is None or ts < r.since:
            r = _resolve(devices, s, simulated)
        vals = list(map(values.get, order))
        n = len(values)
        readings += n
        stored += n * len(r.idents)
        for ident in r.idents:
            k = (ident, ms)
            seen = rows.get(k)
            if seen is None:
                rows[k] = [ms, *vals]
            else:  # the same device and time twice: the first reading of a field counts
                seen[1:] = [a if a is not None else b for a, b in zip(seen[1:], vals,
                                                                       strict=True)]  # fmt: skip
        key = r.key
        prev = latest.get(key)
        if prev is None:
            latest[key] = [key, devices.node, uuid, gi, profile, ms, *r.sole, simulated, *vals]
        elif prev[5] <= ms:  # a newer sample: its values, the older ones where it has none
            latest[key] = [key, devices.node, uuid, gi, profile, ms, *r.sole, simulated] + [
                a if a is not None else b for a, b in zip(vals, prev[9:], strict=True)]  # fmt: skip
        else:
            prev[9:] = [a if a is not None else b for a, b in zip(prev[9:], vals, strict=True)]
        for i, f in _HEALTH_ORDER:
            v = vals[i]
            if v is not None:
                health.append((key, ms, uuid, f, v))
    out.readings, out.stored = readings, stored
    return out


def _resolve(devices: NodeDevices, s: DeviceSample, simulated: bool) -> _Resolved:
    """Who held the device of ``s`` at its time (its series identities: one per holder, and
    one for the part nobody held); remembered for the later samples every holder covers."""
    node = devices.node
    uuid, gi, profile, ts = s.gpu_uuid, s.gi_id, s.profile, s.ts
    gpu = devices.gpus.get(uuid)
    if gpu is None:
        raise ValidationFailed(
            f"GPU {uuid} is not a GPU of node {node}: a node posts readings of its own GPUs",
            code="gpu_not_on_node",
            details={"node": node, "gpu_uuid": uuid},
        )
    holders: list[Holder]
    if gi is not None:
        start = s.mig_start
        if start is None:  # name the instance by its profile when unambiguous
            found = [st for st, p in gpu[2].items() if p == profile]
            start = found[0] if len(found) == 1 else None
        h = devices.mig.get((uuid, start)) if start is not None else None
        holders = [Holder(h.workload, h.tenant, h.since, 1.0)] if h is not None else []
    else:
        w = devices.whole.get(uuid)
        holders = [w] if w is not None else devices.parts.get(uuid, [])
    held = [h for h in holders if h.since <= ts]
    rest = 1.0 - sum(h.share for h in held)
    targets = [(h.workload, h.tenant, round(h.share, 6)) for h in held]
    if rest > 1e-9:
        targets.append((None, None, round(rest, 6)))
    sole = (held[0].workload, held[0].tenant) if len(targets) == 1 and held else (None, None)
    idents = tuple((node, uuid, gi, profile, w, t, share, simulated) for w, t, share in targets)
    r = _Resolved(ts, idents, sole, _device_key(node, uuid, gi))
    if len(held) == len(holders):  # every holder counted: so it stays for later samples
        since = max((h.since for h in holders), default=_EPOCH)
        r = _Resolved(since, idents, sole, r.key)
        if len(devices.resolved) < 100_000:
            devices.resolved[(uuid, gi, profile, s.mig_start, simulated)] = r
    return r


_SERIES_COLS = ("node", "gpu_uuid", "gi_id", "profile", "workload", "tenant", "share",
                "simulated")  # fmt: skip


def _mark_seen(session: Session, cache: _DeviceCache, used: set[tuple[int, int]]) -> None:
    """Move each series' ``seen_ms`` to the newest hour it now has samples in: once per series
    and hour in a process (a fleet's series are stamped once an hour, not once a post)."""
    seen = cache.seen
    todo = {}
    for sid, hour in used:
        if seen.get(sid, -1) < hour and todo.get(sid, -1) < hour:
            todo[sid] = hour
    if not todo:
        return
    stmt = (
        update(TelemetrySeriesRow)
        .where(
            TelemetrySeriesRow.id == bindparam("sid"), TelemetrySeriesRow.seen_ms < bindparam("ms")
        )
        .values(seen_ms=bindparam("ms"))
    )
    session.connection().execute(stmt, [{"sid": sid, "ms": h * HOUR_MS} for sid, h in todo.items()])
    if len(seen) > 1_000_000:
        seen.clear()

    def remember(_s: Session) -> None:
        seen.update(todo)

    from sqlalchemy import event as sa_event

    sa_event.listen(session, "after_commit", remember, once=True)


def _series_ids(
    session: Session, cache: _DeviceCache, rows: Mapping[tuple[_Ident, int], Any]
) -> Mapping[_Ident, int]:
    """The series id of each row's identity, creating the series not stored yet."""
    known = cache.series
    missing = {ident for ident, _ms in rows if ident not in known}
    if not missing:
        return known
    by_key = {_series_key(*ident): ident for ident in missing}
    keys = list(by_key)
    found: dict[str, int] = {}
    for chunk in _chunks(keys, 500):
        found.update(session.execute(
            select(TelemetrySeriesRow.key, TelemetrySeriesRow.id)
            .where(TelemetrySeriesRow.key.in_(chunk))
        ).all())  # fmt: skip
    new = [k for k in keys if k not in found]
    if new:
        seen_ms = min(ms for _ident, ms in rows) // HOUR_MS * HOUR_MS
        values = [{"key": k, **dict(zip(_SERIES_COLS, by_key[k], strict=True)),
                   "seen_ms": seen_ms} for k in new]  # fmt: skip
        session.execute(_dialect_insert(session, TelemetrySeriesRow).on_conflict_do_nothing(),
                        values)  # fmt: skip
        for chunk in _chunks(new, 500):
            found.update(session.execute(
                select(TelemetrySeriesRow.key, TelemetrySeriesRow.id)
                .where(TelemetrySeriesRow.key.in_(chunk))
            ).all())  # fmt: skip
    if len(known) > 1_000_000:
        known.clear()
    # only once this transaction commits are new ids sure to exist: until then they are this
    # transaction's; a rollback forgets them (``_forget_on_rollback``)
    fresh = {by_key[k]: sid for k, sid in found.items()}
    _remember_on_commit(session, known, fresh)
    return ChainMap(fresh, known)


def _remember_on_commit(
    session: Session, known: dict[_Ident, int], fresh: dict[_Ident, int]
) -> None:
    from sqlalchemy import event as sa_event

    def remember(_s: Session) -> None:
        known.update(fresh)

    sa_event.listen(session, "after_commit", remember, once=True)


def _chunks(items: list[Any], n: int) -> Iterable[list[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def _dialect_insert(session: Session, table: Any) -> Any:
    if session.get_bind().dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


_T = telemetry_samples
_L = telemetry_device_latest
_SAMPLE_COLS = ("ts", "series_id", *_COLS)
# a re-sent sample is a no-op; one that brings fields the stored one lacks fills them
_SAMPLES_SQLITE = (
    f"INSERT INTO telemetry_samples ({', '.join(_SAMPLE_COLS)}) "
    f"VALUES ({', '.join('?' * len(_SAMPLE_COLS))}) ON CONFLICT (ts, series_id) DO UPDATE SET "
    + ", ".join(f"{c} = coalesce(telemetry_samples.{c}, excluded.{c})" for c in _COLS)
)
_LATEST_COLS = ("key", "node", "gpu_uuid", "gi_id", "profile", "ts", "workload", "tenant",
                "simulated", *_COLS)  # fmt: skip
_LATEST_META = _LATEST_COLS[4:9]  # what an update sets (key, node, GPU, instance are the key)
_LATEST_SQLITE = (
    f"INSERT INTO telemetry_device_latest ({', '.join(_LATEST_COLS)}) "
    f"VALUES ({', '.join('?' * len(_LATEST_COLS))}) ON CONFLICT (key) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in _LATEST_META)
    + ", "
    + ", ".join(f"{c} = coalesce(excluded.{c}, telemetry_device_latest.{c})" for c in _COLS)
    + " WHERE excluded.ts >= telemetry_device_latest.ts"
)


def _insert_samples(session: Session, rows: list[tuple[Any, ...]]) -> None:
    """Rows in ``_SAMPLE_COLS`` order."""
    if not rows:
        return
    raw = sqlite_connection(session)
    if raw is not None:
        raw.executemany(_SAMPLES_SQLITE, rows)
        return
    stmt = postgresql.insert(_T)
    stmt = stmt.on_conflict_do_update(
        index_elements=["ts", "series_id"],
        set_={c: func.coalesce(_T.c[c], stmt.excluded[c]) for c in _COLS},
    )
    session.execute(stmt, [dict(zip(_SAMPLE_COLS, r, strict=True)) for r in rows])


def _upsert_latest(session: Session, rows: list[list[Any]]) -> None:
    """Rows in ``_LATEST_COLS`` order; an older sample never replaces a newer one, and a
    field the newer one lacks keeps its value."""
    if not rows:
        return
    raw = sqlite_connection(session)
    if raw is not None:
        raw.executemany(_LATEST_SQLITE, rows)
        return
    stmt = postgresql.insert(_L)
    set_: dict[str, Any] = {c: stmt.excluded[c] for c in _LATEST_META}
    set_.update({c: func.coalesce(stmt.excluded[c], _L.c[c]) for c in _COLS})
    stmt = stmt.on_conflict_do_update(
        index_elements=["key"], set_=set_, where=stmt.excluded.ts >= _L.c.ts
    )
    session.execute(stmt, [dict(zip(_LATEST_COLS, r, strict=True)) for r in rows])


def _previous(session: Session, keys: set[str]) -> dict[tuple[str, str], float]:
    """The newest stored reading of each health field of the devices ``keys`` names."""
    out: dict[tuple[str, str], float] = {}
    cols = [_L.c[TELEMETRY_COLUMNS[f]] for _i, f in _HEALTH_ORDER]
    for chunk in _chunks(sorted(keys), 500):
        for key, *values in session.execute(select(_L.c.key, *cols).where(_L.c.key.in_(chunk))):
            for (_i, f), v in zip(_HEALTH_ORDER, values, strict=True):
                if v is not None:
                    out[(key, f)] = v
    return out


# --- reads -----------------------------------------------------------------------------------

_S = TelemetrySeriesRow
_H = TelemetryHourlyRow


def _col(table: Any, field_name: str) -> Any:
    return table.c[TELEMETRY_COLUMNS[field_name]]


def rolled_through(session: Session) -> datetime | None:
    """The end of the newest stored hourly rollup (None: none stored)."""
    last = session.scalar(select(func.max(_H.hour)))
    return None if last is None else last + HOUR


def _points(
    session: Session,
    start: datetime,
    end: datetime,
    *,
    tenant: str | None = None,
    field_name: str | None = None,
    node: str | None = None,
    fields: Iterable[str] | None = None,
) -> tuple[list[Point], dict[SeriesKey, float]]:
    """Raw points (one per reading) in [start, end) (filtered; ``fields``: only these), and
    the previous reading of each counter device before ``start`` (within
    ``COUNTER_LOOKBACK``)."""
    wanted = None if fields is None else set(fields)
    names = [f for f in _ORDER if (wanted is None or f in wanted)
             and (field_name is None or f == field_name)]  # fmt: skip
    if not names:
        return [], {}
    cols = [_col(_T, f) for f in names]
    q = (
        select(_S.node, _S.gpu_uuid, _S.gi_id, _T.c.ts, _S.workload, _S.tenant, _S.share,
               _S.simulated, *cols)
        .join(_S, _S.id == _T.c.series_id)
        .where(_T.c.ts >= to_ms(start), _T.c.ts < to_ms(end), or_(*(c.is_not(None)
                                                                    for c in cols)))
    )  # fmt: skip
    if tenant is not None:
        q = q.where(_S.tenant == tenant)
    if node is not None:
        q = q.where(_S.node == node)
    points = []
    for n, g, gi, ts, w, t, sh, sim, *values in session.execute(q):
        at = from_ms(ts)
        for f, v in zip(names, values, strict=True):
            if v is not None:
                points.append(Point(n, g, gi, f, at, v, w, t, sh, bool(sim)))
    previous: dict[SeriesKey, float] = {}
    counters = {(p.gpu_uuid, p.gi_id, p.field) for p in points if p.field in COUNTERS}
    if counters:
        cfields = sorted({k[2] for k in counters})
        ccols = [_col(_T, f) for f in cfields]
        prev_q = (
            select(_S.gpu_uuid, _S.gi_id, _T.c.ts, *ccols)
            .join(_S, _S.id == _T.c.series_id)
            .where(_T.c.ts >= to_ms(start - COUNTER_LOOKBACK), _T.c.ts < to_ms(start),
                   or_(*(c.is_not(None) for c in ccols)))
            .order_by(_T.c.ts)
        )  # fmt: skip
        if node is not None:
            prev_q = prev_q.where(_S.node == node)
        for g, gi, _ts, *values in session.execute(prev_q):
            for f, v in zip(cfields, values, strict=True):
                if v is not None and (g, gi, f) in counters:
                    previous[(g, gi, f)] = v
    return points, previous


HOUR_MS = 3_600_000


def aggregate(
    session: Session,
    start: datetime,
    end: datetime,
    *,
    tenant: str | None = None,
    field_name: str | None = None,
    node: str | None = None,
) -> list[Hourly]:
    """The hourly rollups of the raw samples in [start, end): gauges summed up in the
    database (per series and hour, one column each), counters' increases in Python
    (``meter.rollup``) from all of each device's readings (a holder's increase needs the
    readings before it held the device), then filtered. Series of the same holder (another
    share, profile) are merged."""
    lo, hi = to_ms(start), to_ms(end)
    out: dict[tuple[Any, ...], Hourly] = {}
    gauges = [f for f in _ORDER if f not in COUNTERS and (field_name is None or f == field_name)]
    if gauges:
        gcols = [_col(_T, f) for f in gauges]
        bucket = (_T.c.ts // HOUR_MS).label("bucket")
        stats = []
        for i, c in enumerate(gcols):
            stats += [func.count(c).label(f"n{i}"), func.sum(c).label(f"s{i}"),
                      func.min(c).label(f"lo{i}"), func.max(c).label(f"hi{i}")]  # fmt: skip
        agg = (
            select(_T.c.series_id, bucket, func.max(_T.c.ts).label("mt"), *stats)
            .join(_S, _S.id == _T.c.series_id)
            .where(_T.c.ts >= lo, _T.c.ts < hi, or_(*(c.is_not(None) for c in gcols)))
            .group_by(_T.c.series_id, bucket)
        )  # fmt: skip
        if tenant is not None:
            agg = agg.where(_S.tenant == tenant)
        if node is not None:
            agg = agg.where(_S.node == node)
        a = agg.subquery()
        last = _T.alias("last")
        q = (
            select(a, _S.node, _S.gpu_uuid, _S.gi_id, _S.workload, _S.tenant, _S.simulated,
                   *(_col(last, f) for f in gauges))
            .join(_S, _S.id == a.c.series_id)
            .join(last, and_(last.c.series_id == a.c.series_id, last.c.ts == a.c.mt))
            .order_by(a.c.mt)
        )  # fmt: skip
        width = 3 + 4 * len(gauges)
        for row in session.execute(q):
            sid, b, _mt = row[0], int(row[1]), row[2]
            n_, g, gi, w, t, sim = row[width : width + 6]
            lasts = row[width + 6 :]
            hour = from_ms(b * HOUR_MS)
            for i, f in enumerate(gauges):
                cnt = row[3 + 4 * i]
                if not cnt:
                    continue
                lv = lasts[i]
                if lv is None:  # the hour's newest sample lacks it: its own newest reading
                    col = _col(_T, f)
                    lv = session.scalar(
                        select(col).where(_T.c.series_id == sid, col.is_not(None),
                                          _T.c.ts >= max(lo, b * HOUR_MS),
                                          _T.c.ts < min(hi, (b + 1) * HOUR_MS))
                        .order_by(_T.c.ts.desc()).limit(1)
                    )  # fmt: skip
                h = Hourly(hour, n_, g, gi, f, w, t, int(cnt), float(row[4 + 4 * i]),
                           float(row[5 + 4 * i]), float(row[6 + 4 * i]), float(lv),
                           bool(sim))  # fmt: skip
                key = (hour, n_, g, gi, f, w, t)
                seen = out.get(key)
                out[key] = h if seen is None else merge(seen, h)
    counters = [f for f in _ORDER if f in COUNTERS and (field_name is None or f == field_name)]
    if counters:
        points, previous = _points(session, start, end, node=node, fields=counters)
        for row in rollup(points, previous):
            if tenant is None or row.tenant == tenant:
                key = (row.hour, row.node, row.gpu_uuid, row.gi_id, row.field, row.workload,
                       row.tenant)  # fmt: skip
                seen = out.get(key)
                out[key] = row if seen is None else merge(seen, row)
    return sorted(out.values(), key=_order)


def _order(h: Hourly) -> tuple[Any, ...]:
    return (h.hour, h.node, h.gpu_uuid, -1 if h.gi_id is None else h.gi_id, h.field,
            h.workload or "", h.tenant or "")  # fmt: skip


_HOURLY_COLS = ("hour", "node", "gpu_uuid", "gi_id", "field", "workload", "tenant", "count",
                "sum", "min", "max", "last", "simulated")  # fmt: skip


def insert_hourly(session: Session, rows: Sequence[Hourly] | Sequence[tuple[Any, ...]]) -> int:
    """Store rollup rows (``Hourly`` values, or tuples in its field order) in bulk: prepared
    tuples on SQLite (the hour as its column type stores it), a Core insert elsewhere."""
    if not rows:
        return 0
    tuples = [tuple(r) if isinstance(r, tuple) else _hourly_tuple(r) for r in rows]
    raw = sqlite_connection(session)
    if raw is not None:
        process = _H.__table__.c.hour.type._cached_bind_processor(session.get_bind().dialect)
        sql = (f"INSERT INTO telemetry_hourly ({', '.join(_HOURLY_COLS)}) "
               f"VALUES ({', '.join('?' * len(_HOURLY_COLS))})")  # fmt: skip
        hours: dict[Any, Any] = {}  # a batch holds few distinct hours: format each once
        for t in tuples:
            if t[0] not in hours:
                hours[t[0]] = process(t[0]) if process else t[0]
        raw.executemany(sql, [(hours[t[0]], *t[1:]) for t in tuples])
        return len(tuples)
    session.execute(insert(_H.__table__), [dict(zip(_HOURLY_COLS, t, strict=True))
                                           for t in tuples])  # fmt: skip
    return len(tuples)


def _hourly_tuple(h: Hourly) -> tuple[Any, ...]:
    return (h.hour, h.node, h.gpu_uuid, h.gi_id, h.field, h.workload, h.tenant, h.count, h.sum,
            h.min, h.max, h.last, h.simulated)  # fmt: skip


def _stored_hourly(
    session: Session,
    start: datetime,
    end: datetime,
    *,
    tenant: str | None = None,
    field_name: str | None = None,
) -> list[Hourly]:
    q = select(
        _H.hour, _H.node, _H.gpu_uuid, _H.gi_id, _H.field, _H.workload, _H.tenant, _H.count,
        _H.sum, _H.min, _H.max, _H.last, _H.simulated,
    ).where(_H.hour >= start, _H.hour < end)  # fmt: skip
    if tenant is not None:
        q = q.where(_H.tenant == tenant)
    if field_name is not None:
        q = q.where(_H.field == field_name)
    return [Hourly(*row) for row in session.execute(q.order_by(_H.hour, _H.id))]


def hourly(
    store: Store,
    *,
    start: datetime,
    end: datetime,
    tenant: str | None = None,
    field: str | None = None,
) -> list[dict[str, Any]]:
    """Hourly rollups of the hours starting in [start, end), oldest first (see the module
    docstring); the hours not stored yet come from the raw readings."""
    return [h.as_dict() for h in hourly_rows(store, start=start, end=end, tenant=tenant,
                                             field_name=field)]  # fmt: skip


def hourly_rows(
    store: Store,
    *,
    start: datetime,
    end: datetime,
    tenant: str | None = None,
    field_name: str | None = None,
) -> list[Hourly]:
    start, end = _aware(start, "start"), _aware(end, "end")
    first = hour_of(start) if start != hour_of(start) else start
    if first < start:
        first += HOUR
    with store.read() as session:
        through = rolled_through(session)
        stored_end = min(end, through) if through is not None else first
        rows = _stored_hourly(session, first, stored_end, tenant=tenant, field_name=field_name)
        live_start = max(first, stored_end)
        if live_start < end:
            rows.extend(aggregate(session, live_start, end, tenant=tenant,
                                  field_name=field_name))  # fmt: skip
    return rows


def latest(store: Store, *, node: str | None = None) -> list[dict[str, Any]]:
    """The newest reading per (node, gpu_uuid, gi_id, field), by node, GPU and field
    (``ts``: the time of the device's newest sample)."""
    q = select(_L.c.node, _L.c.gpu_uuid, _L.c.gi_id, _L.c.profile, _L.c.ts, _L.c.workload,
               _L.c.tenant, _L.c.simulated, *(_L.c[c] for c in _COLS))  # fmt: skip
    if node is not None:
        q = q.where(_L.c.node == node)
    with store.read() as session:
        out = []
        for n, g, gi, prof, ts, w, t, sim, *values in session.execute(q):
            at = from_ms(ts)
            for f, v in zip(_ORDER, values, strict=True):
                if v is not None:
                    out.append({"node": n, "gpu_uuid": g, "gi_id": gi, "profile": prof,
                                "field": f, "ts": at, "value": v, "workload": w, "tenant": t,
                                "simulated": bool(sim)})  # fmt: skip
    out.sort(key=lambda d: (d["node"], d["gpu_uuid"], -1 if d["gi_id"] is None else d["gi_id"],
                            d["field"]))  # fmt: skip
    return out


def list_latest(store: Store, actor: Actor, node: str | None = None) -> list[dict[str, Any]]:
    """``latest`` for a reader (``workloads:read``): one scoped to tenants sees the readings
    of devices its tenants' workloads held alone."""
    authorize(actor, Permission.WORKLOADS_READ)
    visible = actor.visible_tenants(Permission.WORKLOADS_READ)
    rows = latest(store, node=node)
    if visible is not None:
        rows = [r for r in rows if r["tenant"] in visible]
    for r in rows:
        f = FIELDS.get(r["field"])
        r["unit"] = f.unit if f is not None else None
    return rows


def tenant_latest(store: Store, *, fields: Iterable[str], since: datetime) -> list[dict[str, Any]]:
    """Per (tenant, field), over the newest reading of each device newer than ``since``:
    ``tenant, field, devices, sum, min, max`` (tenant None: devices no single placement held),
    computed in the database (what /metrics reads on every scrape)."""
    names = sorted(f for f in set(fields) if f in TELEMETRY_COLUMNS)
    if not names:
        return []
    stats = []
    for f in names:
        c = _col(_L, f)
        stats += [func.count(c), func.sum(c), func.min(c), func.max(c)]
    q = (
        select(_L.c.tenant, *stats)
        .where(_L.c.ts >= to_ms(_aware(since, "since")))
        .group_by(_L.c.tenant)
    )
    out = []
    with store.read() as session:
        for t, *values in session.execute(q):
            for i, f in enumerate(names):
                n, total, lo, hi = values[4 * i : 4 * i + 4]
                if n:
                    out.append({"tenant": t, "field": f, "devices": int(n), "sum": float(total),
                                "min": float(lo), "max": float(hi)})  # fmt: skip
    return out


def energy_kwh(
    store: Store, *, start: datetime, end: datetime
) -> dict[tuple[str | None, str | None], float]:
    """Metered energy (kWh) per (tenant, workload) over the hours starting in [start, end)."""
    out: dict[tuple[str | None, str | None], float] = {}
    for h in hourly_rows(store, start=start, end=end, field_name=TOTAL_ENERGY):
        key = (h.tenant, h.workload)
        out[key] = out.get(key, 0.0) + h.sum / MJ_PER_KWH
    return out


def _aware(ts: datetime, name: str) -> datetime:
    if ts.tzinfo is None:
        raise ValidationFailed(f"{name} must carry a UTC offset", code="validation_failed",
                               details={name: ts.isoformat()})  # fmt: skip
    return ts.astimezone(UTC)


# --- the API's list -------------------------------------------------------------------------


def list_telemetry(
    store: Store,
    actor: Actor,
    *,
    node: str | None = None,
    tenant: str | None = None,
    field_name: str | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
    resolution: str = "raw",
    limit: int = 100,
    cursor: str | None = None,
) -> Page[dict[str, Any]]:
    """Readings (``raw``, by time) or stored hourly rollups (``hour``), filtered; a reader
    scoped to tenants sees only readings its tenants' workloads held."""
    authorize(actor, Permission.WORKLOADS_READ)
    check_limit(limit)
    visible = actor.visible_tenants(Permission.WORKLOADS_READ)
    if tenant is not None and visible is not None and tenant not in visible:
        raise NotFound(f"tenant {tenant!r} not found", details={"tenant": tenant})
    if field_name is not None and field_name not in FIELDS:
        raise ValidationFailed(
            f"unknown field {field_name!r}", code="unknown_field",
            details={"field": field_name, "known": sorted(FIELDS)},
        )  # fmt: skip
    start = _aware(start, "from") if start is not None else None
    end = _aware(end, "to") if end is not None else None
    if resolution == "raw":
        return _list_raw(store, node, tenant, visible, field_name, start, end, limit, cursor)
    if resolution == "hour":
        return _list_hourly(store, node, tenant, visible, field_name, start, end, limit, cursor)
    raise ValidationFailed("resolution must be raw or hour", code="validation_failed",
                           details={"resolution": resolution})  # fmt: skip


def _filtered(
    q: Any,
    cols: tuple[Any, Any, Any, Any],
    tenant: str | None,
    visible: frozenset[str] | None,
    node: str | None,
    field_name: str | None,
    lo: Any,
    hi: Any,
) -> Any:
    """A listing's filters on its (tenant, node, field, time) columns: the caller's tenant
    scope, then each filter given (a time bound in the time column's own unit)."""
    tenant_col, node_col, field_col, time_col = cols
    if tenant is not None:
        q = q.where(tenant_col == tenant)
    if visible is not None:
        q = q.where(tenant_col.in_(sorted(visible)))
    if node is not None:
        q = q.where(node_col == node)
    if field_name is not None and field_col is not None:
        q = q.where(field_col == field_name)
    if lo is not None:
        q = q.where(time_col >= lo)
    if hi is not None:
        q = q.where(time_col < hi)
    return q


def _list_raw(
    store: Store,
    node: str | None,
    tenant: str | None,
    visible: frozenset[str] | None,
    field_name: str | None,
    start: datetime | None,
    end: datetime | None,
    limit: int,
    cursor: str | None,
) -> Page[dict[str, Any]]:
    """One item per reading: each stored sample's fields (in ``FIELDS`` order) by time and
    series; the cursor names the last item's sample and field."""
    after = decode_cursor("telemetry-raw", cursor, str)
    names = [field_name] if field_name is not None else list(_ORDER)
    cols = [_col(_T, f) for f in names]
    q = select(
        _T.c.ts, _T.c.series_id, _S.node, _S.gpu_uuid, _S.gi_id, _S.profile, _S.workload,
        _S.tenant, _S.share, _S.simulated, *cols,
    ).join(_S, _S.id == _T.c.series_id)  # fmt: skip
    lo, hi = (None if t is None else to_ms(t) for t in (start, end))
    q = _filtered(q, (_S.tenant, _S.node, None, _T.c.ts), tenant, visible, node, None, lo, hi)
    if field_name is not None:
        q = q.where(cols[0].is_not(None))
    skip: tuple[int, int, int] | None = None
    if after is not None:
        try:
            parts = [int(p) for p in str(after).split(":")]
            ts_after, sid_after = parts[0], parts[1]
            fi_after = parts[2] if len(parts) == 3 else len(_ORDER)
            if len(parts) not in (2, 3):
                raise ValueError
        except (ValueError, IndexError):
            raise ValidationFailed("invalid cursor", code="invalid_cursor") from None
        skip = (ts_after, sid_after, fi_after)
        q = q.where(or_(_T.c.ts > ts_after,
                        and_(_T.c.ts == ts_after, _T.c.series_id >= sid_after)))  # fmt: skip
    q = q.order_by(_T.c.ts, _T.c.series_id)
    index = {f: i for i, f in enumerate(_ORDER)}
    items: list[dict[str, Any]] = []
    keys: list[str] = []
    offset = 0
    with store.read() as session:
        while len(items) <= limit:
            rows = session.execute(q.offset(offset).limit(limit + 2)).all()
            offset += len(rows)
            for ts, sid, n, g, gi, prof, w, t, sh, sim, *values in rows:
                at = from_ms(ts)
                for f, v in zip(names, values, strict=True):
                    if v is None:
                        continue
                    fi = index[f]
                    if skip is not None and (ts, sid) == skip[:2] and fi <= skip[2]:
                        continue
                    items.append({
                        "ts": at, "node": n, "gpu_uuid": g, "gi_id": gi, "profile": prof,
                        "field": f, "value": v, "unit": FIELDS[f].unit, "workload": w,
                        "tenant": t, "share": sh, "simulated": bool(sim),
                    })  # fmt: skip
                    keys.append(f"{ts}:{sid}:{fi}")
            if len(rows) < limit + 2:
                break
    key = keys[limit - 1] if len(items) > limit else None
    return paginate("telemetry-raw", items[: limit + 1], limit, key)


def _list_hourly(
    store: Store,
    node: str | None,
    tenant: str | None,
    visible: frozenset[str] | None,
    field_name: str | None,
    start: datetime | None,
    end: datetime | None,
    limit: int,
    cursor: str | None,
) -> Page[dict[str, Any]]:
    after = decode_cursor("telemetry-hour", cursor, int)
    q = select(_H)
    q = _filtered(q, (_H.tenant, _H.node, _H.field, _H.hour), tenant, visible, node, field_name,
                  start, end)  # fmt: skip
    if after is not None:
        q = q.where(_H.id > after)
    q = q.order_by(_H.id).limit(limit + 1)
    with store.read() as session:
        rows = list(session.scalars(q))
    items = [
        {
            "hour": r.hour, "node": r.node, "gpu_uuid": r.gpu_uuid, "gi_id": r.gi_id,
            "field": r.field, "unit": FIELDS[r.field].unit if r.field in FIELDS else None,
            "workload": r.workload, "tenant": r.tenant, "count": r.count, "sum": r.sum,
            "min": r.min, "max": r.max, "last": r.last, "simulated": r.simulated,
        }
        for r in rows
    ]  # fmt: skip
    key = rows[limit - 1].id if len(rows) > limit else None
    return paginate("telemetry-hour", items, limit, key)


# --- rollup and retention (the telemetry worker's passes) -------------------------------------


def rollup_hours(
    store: Store, actor: Actor, now: datetime, *, max_hours: int = 48
) -> list[datetime]:
    """Store the hourly rollups of the complete hours not stored yet that have readings,
    oldest first (at most ``max_hours`` per call). An hour is complete ``ROLLUP_GRACE`` after
    it ended. Each hour is summed up in a read transaction (it never holds up writers) and
    stored in a short write transaction, unless another process stored it meanwhile. Returns
    the hours rolled up."""
    done: list[datetime] = []
    last_complete = hour_of(now - ROLLUP_GRACE) - HOUR  # the newest hour that has ended
    hour: datetime | None = None
    while len(done) < max_hours:
        with store.read() as session:
            stored = rolled_through(session)
            if stored is not None and (hour is None or stored > hour):
                hour = stored
            q = select(func.min(_T.c.ts))
            if hour is not None:
                q = q.where(_T.c.ts >= to_ms(hour))
            first = session.scalar(q)  # skip to the next hour with readings
            if first is None:
                break
            at = hour_of(from_ms(first))
            hour = at if hour is None else max(hour, at)
            if hour > last_complete:
                break
            rows = aggregate(session, hour, hour + HOUR)
        with store.write(actor, now) as tx:
            again = rolled_through(tx.session)
            if again is None or again <= hour:
                insert_hourly(tx.session, rows)
        done.append(hour)
        hour += HOUR
    return done


def apply_retention(
    store: Store, actor: Actor, now: datetime, *, raw_hours: float = RAW_HOURS,
    hourly_days: int = HOURLY_DAYS,
) -> dict[str, int]:  # fmt: skip
    """Delete raw samples older than ``raw_hours`` (never one whose hour is not rolled up
    yet), rollups older than ``hourly_days``, series without samples and stale newest
    samples. Returns the counts deleted (``raw``: samples, one per device holder and time;
    ``latest``: devices)."""
    with store.write(actor, now) as tx:
        session = tx.session
        through = rolled_through(session)
        cutoff = now - timedelta(hours=raw_hours)
        raw = 0
        if through is not None:  # nothing rolled up yet: every raw reading still counts
            cutoff = min(cutoff, through)
            raw = session.execute(delete(_T).where(_T.c.ts < to_ms(cutoff))).rowcount
        hourly_cut = now - timedelta(days=hourly_days)
        hours = session.execute(delete(_H).where(_H.hour < hourly_cut)).rowcount
        latest_cut = to_ms(now - timedelta(hours=raw_hours))
        stale = session.execute(delete(_L).where(_L.c.ts < latest_cut)).rowcount
        series = 0
        if through is not None:  # a series whose newest hour ended by the cutoff has no sample
            gone = to_ms(cutoff) - HOUR_MS
            series = session.execute(delete(_S).where(_S.seen_ms <= gone)).rowcount
    if series:
        cache = _cache(store.engine)
        cache.series.clear()
        cache.seen.clear()
    return {"raw": raw or 0, "hourly": hours or 0, "latest": stale or 0, "series": series or 0}


def utilisation_summary(
    store: Store, since: datetime, until: datetime
) -> dict[tuple[str, str], tuple[datetime, datetime, float, int]]:
    """Per (tenant, workload): the first and last time, the highest value and the count of the
    GR_ENGINE_ACTIVE readings in [since, until] of devices the workload held alone (share 1):
    what idle detection judges (``meter.idle``)."""
    gr = _col(_T, GR_ENGINE_ACTIVE)
    q = (
        select(_S.tenant, _S.workload, func.min(_T.c.ts), func.max(_T.c.ts), func.max(gr),
               func.count(gr))
        .join(_S, _S.id == _T.c.series_id)
        .where(_T.c.ts >= to_ms(since), _T.c.ts <= to_ms(until), gr.is_not(None),
               _S.workload.is_not(None), _S.share >= 0.999999)
        .group_by(_S.tenant, _S.workload)
    )  # fmt: skip
    with store.read() as session:
        return {
            (t, w): (from_ms(first), from_ms(last), float(peak), int(n))
            for t, w, first, last, peak, n in session.execute(q)
        }


__all__ = [
    "Finding",
    "Ingested",
    "energy_kwh",
    "hourly",
    "ingest",
    "latest",
    "list_telemetry",
]
