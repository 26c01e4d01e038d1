"""Telemetry (issue 15): ingesting the agents' GPU samples, keeping them (raw for
PROOFPLANE_TELEMETRY_RAW_HOURS, default 48; hourly rollups for 400 days), and the read
functions metering, alerting and capacity use.

Ingest (``ingest``): a node's agent posts readings of its own GPUs and MIG instances
(``meter.samples.parse_batch`` checks the body). Each reading is keyed to the placement that
held the device at that moment: a whole GPU's holder; a MIG instance's holder; for a reading
of a whole GPU that MIG instances or shares of several workloads divide, one row per holder
with its ``share`` (its compute-slice fraction, its share_milli / 1000) and one unattributed
row for the rest (counters are split by share, so energy adds up; see ``meter.rollup``). A
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

from sqlalchemy import and_, delete, func, insert, or_, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, aliased

from proofplane.access import Actor, Permission, authorize
from proofplane.errors import InvalidState, NotFound, ValidationFailed
from proofplane.hardware.skus import COMPUTE_SLICES, SKUS
from proofplane.meter.fields import COUNTERS, FIELDS, GR_ENGINE_ACTIVE, TOTAL_ENERGY
from proofplane.meter.health import HEALTH_FIELDS, Finding, assess, worth_checking
from proofplane.meter.rollup import HOUR, Hourly, Point, SeriesKey, hour_of, merge, rollup
from proofplane.meter.samples import MAX_SAMPLES, Sample, parse_batch
from proofplane.model import NodeState
from proofplane.service.attestation import authorize_node
from proofplane.service.context import Store
from proofplane.service.pagination import Page, check_limit, decode_cursor, paginate
from proofplane.store.audit_log import sqlite_connection
from proofplane.store.tables import (
    EventRow,
    GpuRow,
    NodeRow,
    PlacementRow,
    TelemetryHourlyRow,
    TelemetryLatestRow,
    TelemetryRawRow,
    TelemetrySeriesRow,
    TenantRow,
    WorkloadRow,
    placement_nodes,
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
    out = NodeDevices(name, state, gpus)
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

    def devices(self, session: Session, node_id: int, name: str, state: str) -> NodeDevices:
        raw = sqlite_connection(session)
        if raw is not None:
            newest = raw.execute("SELECT max(seq) FROM events").fetchone()[0] or 0
        else:
            newest = session.scalar(select(func.max(EventRow.seq))) or 0
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
    batch = parse_batch(
        body, node=name, now=now, oldest=now - timedelta(hours=raw_hours), max_samples=max_samples
    )
    return store_samples(store, actor, name, batch.samples, simulated=batch.simulated,
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
    """Store checked samples of node ``name`` (``ingest`` after parsing; the demo's simulated
    source directly)."""
    from proofplane.service import gpu_health

    cache = _cache(store.engine)
    with store.write(actor, now) as tx:
        session = tx.session
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
        devices = cache.devices(session, node_id, name, state)
        rows, latest, health = _attribute(devices, samples, simulated)
        series_ids = _series_ids(session, cache, rows)
        raw = [(series_ids[ident], ms, value) for ident, ms, value in rows]
        _insert_raw(session, raw)
        # only a reading that could mean trouble needs the device's previous one (a fleet's
        # readings are XID 0, no ECC error, cool: no extra query)
        worth = {_device_key(s.gpu_uuid, s.gi_id, s.field) for s in health
                 if worth_checking(s.field, s.value)}  # fmt: skip
        previous = _previous(session, worth) if worth else {}
        _upsert_latest(session, list(latest.values()))
        drained: list[dict[str, Any]] = []
        if worth:
            node = session.get(NodeRow, node_id)
            assert node is not None
            for s in sorted(health, key=lambda s: s.ts):
                key = _device_key(s.gpu_uuid, s.gi_id, s.field)
                if key not in worth:
                    continue
                finding = assess(s.field, s.value, previous.get(key))
                previous[key] = s.value
                if finding is not None:
                    done = gpu_health.drain(tx, node, s.gpu_uuid, finding)
                    if done is not None:
                        drained.append(done)
        return Ingested(name, len(samples), len(raw), dict(ignored or {}), drained)


def _device_key(uuid: str, gi_id: int | None, field_name: str) -> str:
    return f"{uuid}{_SEP}{'' if gi_id is None else gi_id}{_SEP}{field_name}"


_Ident = tuple[Any, ...]  # a series: node, gpu_uuid, gi_id, profile, field, workload, tenant,
# share, simulated
_Row = tuple[_Ident, int, float]


def _attribute(
    devices: NodeDevices, samples: Iterable[Sample], simulated: bool
) -> tuple[list[_Row], dict[str, tuple[Any, ...]], list[Sample]]:
    """Each sample's raw rows (series identity, ms, value), the newest reading per device and
    field (a row of ``telemetry_latest``), and the samples of health fields.
    ``gpu_not_on_node`` for another node's GPU."""
    rows: list[_Row] = []
    append = rows.append
    latest: dict[str, tuple[Any, ...]] = {}
    health: list[Sample] = []
    node = devices.node
    gpus = devices.gpus
    whole, mig, parts = devices.whole, devices.mig, devices.parts
    last: tuple[Any, ...] | None = None
    targets: list[tuple[str | None, str | None, float]] = []
    sole: tuple[str | None, str | None] = (None, None)
    ms = 0
    for s in samples:
        uuid, gi, profile, ts = s.gpu_uuid, s.gi_id, s.profile, s.ts
        device = (uuid, gi, profile, s.mig_start, ts)
        if device != last:  # readings come grouped by device and time: work out who held it
            last = device
            gpu = gpus.get(uuid)
            if gpu is None:
                raise ValidationFailed(
                    f"GPU {uuid} is not a GPU of node {node}: a node posts readings of its own "
                    "GPUs",
                    code="gpu_not_on_node",
                    details={"node": node, "gpu_uuid": uuid},
                )
            ms = to_ms(ts)
            holders: list[Holder]
            if gi is not None:
                start = s.mig_start
                if start is None:  # name the instance by its profile when unambiguous
                    found = [st for st, p in gpu[2].items() if p == profile]
                    start = found[0] if len(found) == 1 else None
                h = mig.get((uuid, start)) if start is not None else None
                holders = [Holder(h.workload, h.tenant, h.since, 1.0)] if h is not None else []
            else:
                w = whole.get(uuid)
                holders = [w] if w is not None else parts.get(uuid, [])
            held = [h for h in holders if h.since <= ts]
            rest = 1.0 - sum(h.share for h in held)
            targets = [(h.workload, h.tenant, round(h.share, 6)) for h in held]
            if rest > 1e-9:
                targets.append((None, None, round(rest, 6)))
            sole = (held[0].workload, held[0].tenant) if len(targets) == 1 and held else (
                None, None)  # fmt: skip
        f, value = s.field, s.value
        for workload, tenant, share in targets:
            append(((node, uuid, gi, profile, f, workload, tenant, share, simulated), ms, value))
        key = f"{uuid}{_SEP}{'' if gi is None else gi}{_SEP}{f}"  # _device_key
        prev = latest.get(key)
        if prev is None or prev[6] <= ms:  # in _LATEST_COLS order
            latest[key] = (key, node, uuid, gi, profile, f, ms, value, sole[0], sole[1],
                           simulated)  # fmt: skip
        if f in HEALTH_FIELDS:
            health.append(s)
    return rows, latest, health


_SERIES_COLS = ("node", "gpu_uuid", "gi_id", "profile", "field", "workload", "tenant", "share",
                "simulated")  # fmt: skip


def _series_ids(session: Session, cache: _DeviceCache, rows: list[_Row]) -> Mapping[_Ident, int]:
    """The series id of each row's identity, creating the series not stored yet."""
    known = cache.series
    missing = {ident for ident, _ms, _v in rows if ident not in known}
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
        values = [{"key": k, **dict(zip(_SERIES_COLS, by_key[k], strict=True))} for k in new]
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


_RAW_SQLITE = (
    "INSERT INTO telemetry_raw (series_id, ts, value) VALUES (?, ?, ?) ON CONFLICT DO NOTHING"
)
_LATEST_COLS = ("key", "node", "gpu_uuid", "gi_id", "profile", "field", "ts", "value", "workload",
                "tenant", "simulated")  # fmt: skip
_LATEST_SQLITE = (
    f"INSERT INTO telemetry_latest ({', '.join(_LATEST_COLS)}) "
    f"VALUES ({', '.join('?' * len(_LATEST_COLS))}) ON CONFLICT (key) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in _LATEST_COLS[1:])
    + " WHERE excluded.ts >= telemetry_latest.ts"
)


def _insert_raw(session: Session, rows: list[tuple[int, int, float]]) -> None:
    if not rows:
        return
    raw = sqlite_connection(session)
    if raw is not None:
        raw.executemany(_RAW_SQLITE, rows)
        return
    stmt = postgresql.insert(TelemetryRawRow).on_conflict_do_nothing()
    session.execute(stmt, [{"series_id": a, "ts": b, "value": c} for a, b, c in rows])


def _upsert_latest(session: Session, rows: list[tuple[Any, ...]]) -> None:
    """Rows in ``_LATEST_COLS`` order; an older reading never replaces a newer one."""
    if not rows:
        return
    raw = sqlite_connection(session)
    if raw is not None:
        raw.executemany(_LATEST_SQLITE, rows)
        return
    stmt = postgresql.insert(TelemetryLatestRow)
    stmt = stmt.on_conflict_do_update(
        index_elements=["key"],
        set_={c: stmt.excluded[c] for c in _LATEST_COLS[1:]},
        where=stmt.excluded.ts >= TelemetryLatestRow.ts,
    )
    session.execute(stmt, [dict(zip(_LATEST_COLS, r, strict=True)) for r in rows])


def _previous(session: Session, keys: set[str]) -> dict[str, float]:
    """The newest stored reading of each device and field ``keys`` names."""
    out: dict[str, float] = {}
    for chunk in _chunks(sorted(keys), 500):
        out.update(session.execute(
            select(TelemetryLatestRow.key, TelemetryLatestRow.value)
            .where(TelemetryLatestRow.key.in_(chunk))
        ).all())  # fmt: skip
    return out


# --- reads -----------------------------------------------------------------------------------

_S = TelemetrySeriesRow
_R = TelemetryRawRow
_H = TelemetryHourlyRow


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
    """Raw points in [start, end) (filtered; ``fields``: only these), and the previous reading
    of each counter device before ``start`` (within ``COUNTER_LOOKBACK``)."""
    cols = (_S.node, _S.gpu_uuid, _S.gi_id, _S.field, _R.ts, _R.value, _S.workload, _S.tenant,
            _S.share, _S.simulated)  # fmt: skip
    q = (
        select(*cols)
        .join(_S, _S.id == _R.series_id)
        .where(_R.ts >= to_ms(start), _R.ts < to_ms(end))
    )
    if tenant is not None:
        q = q.where(_S.tenant == tenant)
    if field_name is not None:
        q = q.where(_S.field == field_name)
    if node is not None:
        q = q.where(_S.node == node)
    if fields is not None:
        q = q.where(_S.field.in_(sorted(fields)))
    points = [
        Point(n, g, gi, f, from_ms(ts), v, w, t, sh, bool(sim))
        for n, g, gi, f, ts, v, w, t, sh, sim in session.execute(q)
    ]
    previous: dict[SeriesKey, float] = {}
    counters = {(p.gpu_uuid, p.gi_id, p.field) for p in points if p.field in COUNTERS}
    if counters:
        fields = sorted({k[2] for k in counters})
        prev_q = (
            select(_S.gpu_uuid, _S.gi_id, _S.field, _R.ts, _R.value)
            .join(_S, _S.id == _R.series_id)
            .where(_R.ts >= to_ms(start - COUNTER_LOOKBACK), _R.ts < to_ms(start),
                   _S.field.in_(fields))
            .order_by(_R.ts)
        )  # fmt: skip
        if node is not None:
            prev_q = prev_q.where(_S.node == node)
        for g, gi, f, _ts, v in session.execute(prev_q):
            if (g, gi, f) in counters:
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
    """The hourly rollups of the raw readings in [start, end): gauges summed up in the
    database (per series and hour), counters' increases in Python (``meter.rollup``) from all
    of each device's readings (a holder's increase needs the readings before it held the
    device), then filtered. Series of the same holder (another share, profile) are merged."""
    lo, hi = to_ms(start), to_ms(end)
    out: dict[tuple[Any, ...], Hourly] = {}
    gauge_fields = [f for f in FIELDS if f not in COUNTERS]
    want = [f for f in gauge_fields if field_name is None or f == field_name]
    if want or field_name not in FIELDS:
        bucket = (_R.ts // HOUR_MS).label("bucket")
        agg = (
            select(_R.series_id, bucket, func.count().label("n"), func.sum(_R.value).label("s"),
                   func.min(_R.value).label("lo"), func.max(_R.value).label("hi"),
                   func.max(_R.ts).label("mt"))
            .join(_S, _S.id == _R.series_id)
            .where(_R.ts >= lo, _R.ts < hi, _S.field.not_in(sorted(COUNTERS)))
            .group_by(_R.series_id, bucket)
        )  # fmt: skip
        if tenant is not None:
            agg = agg.where(_S.tenant == tenant)
        if field_name is not None:
            agg = agg.where(_S.field == field_name)
        if node is not None:
            agg = agg.where(_S.node == node)
        a = agg.subquery()
        last = aliased(TelemetryRawRow)
        q = (
            select(a.c.bucket, _S.node, _S.gpu_uuid, _S.gi_id, _S.field, _S.workload, _S.tenant,
                   a.c.n, a.c.s, a.c.lo, a.c.hi, last.value, _S.simulated, a.c.mt)
            .join(_S, _S.id == a.c.series_id)
            .join(last, and_(last.series_id == a.c.series_id, last.ts == a.c.mt))
            .order_by(a.c.mt)
        )  # fmt: skip
        for b, n_, g, gi, f, w, t, cnt, total, mn, mx, lv, sim, _mt in session.execute(q):
            row = Hourly(from_ms(int(b) * HOUR_MS), n_, g, gi, f, w, t, int(cnt), float(total),
                         float(mn), float(mx), float(lv), bool(sim))  # fmt: skip
            key = (row.hour, n_, g, gi, f, w, t)
            seen = out.get(key)
            out[key] = row if seen is None else merge(seen, row)
    counters = [f for f in COUNTERS if field_name is None or f == field_name]
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
    """The newest reading per (node, gpu_uuid, gi_id, field), by node, GPU and field."""
    L = TelemetryLatestRow
    q = select(L.node, L.gpu_uuid, L.gi_id, L.profile, L.field, L.ts, L.value, L.workload,
               L.tenant, L.simulated)  # fmt: skip
    if node is not None:
        q = q.where(L.node == node)
    names = ("node", "gpu_uuid", "gi_id", "profile", "field", "ts", "value", "workload",
             "tenant", "simulated")  # fmt: skip
    with store.read() as session:
        out = []
        for row in session.execute(q.order_by(L.node, L.gpu_uuid, L.gi_id, L.field)):
            d = dict(zip(names, row, strict=True))
            d["ts"] = from_ms(d["ts"])
            d["simulated"] = bool(d["simulated"])
            out.append(d)
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
    L = TelemetryLatestRow
    names = sorted(set(fields))
    q = (
        select(L.tenant, L.field, func.count(), func.sum(L.value), func.min(L.value),
               func.max(L.value))
        .where(L.field.in_(names), L.ts >= to_ms(_aware(since, "since")))
        .group_by(L.tenant, L.field)
    )  # fmt: skip
    with store.read() as session:
        return [
            {"tenant": t, "field": f, "devices": int(n), "sum": float(s), "min": float(lo),
             "max": float(hi)}
            for t, f, n, s, lo, hi in session.execute(q)
        ]  # fmt: skip


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
    if field_name is not None:
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
    after = decode_cursor("telemetry-raw", cursor, str)
    q = select(
        _R.ts, _R.series_id, _R.value, _S.node, _S.gpu_uuid, _S.gi_id, _S.profile, _S.field,
        _S.workload, _S.tenant, _S.share, _S.simulated,
    ).join(_S, _S.id == _R.series_id)  # fmt: skip
    lo, hi = (None if t is None else to_ms(t) for t in (start, end))
    q = _filtered(q, (_S.tenant, _S.node, _S.field, _R.ts), tenant, visible, node, field_name,
                  lo, hi)  # fmt: skip
    if after is not None:
        try:
            ts_s, sid_s = str(after).split(":")
            ts_after, sid_after = int(ts_s), int(sid_s)
        except ValueError:
            raise ValidationFailed("invalid cursor", code="invalid_cursor") from None
        q = q.where(or_(_R.ts > ts_after, and_(_R.ts == ts_after, _R.series_id > sid_after)))
    q = q.order_by(_R.ts, _R.series_id).limit(limit + 1)
    with store.read() as session:
        rows = session.execute(q).all()
    items = [
        {
            "ts": from_ms(ts), "node": n, "gpu_uuid": g, "gi_id": gi, "profile": prof,
            "field": f, "value": v, "unit": FIELDS[f].unit if f in FIELDS else None,
            "workload": w, "tenant": t, "share": sh, "simulated": bool(sim),
        }
        for ts, _sid, v, n, g, gi, prof, f, w, t, sh, sim in rows
    ]  # fmt: skip
    key = f"{rows[limit - 1][0]}:{rows[limit - 1][1]}" if len(rows) > limit else None
    return paginate("telemetry-raw", items, limit, key)


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
            q = select(func.min(_R.ts))
            if hour is not None:
                q = q.where(_R.ts >= to_ms(hour))
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
    """Delete raw readings older than ``raw_hours`` (never one whose hour is not rolled up
    yet), rollups older than ``hourly_days``, series without readings and stale newest
    readings. Returns the counts deleted."""
    with store.write(actor, now) as tx:
        session = tx.session
        through = rolled_through(session)
        cutoff = now - timedelta(hours=raw_hours)
        raw = 0
        if through is not None:  # nothing rolled up yet: every raw reading still counts
            cutoff = min(cutoff, through)
            raw = session.execute(delete(_R).where(_R.ts < to_ms(cutoff))).rowcount
        hourly_cut = now - timedelta(days=hourly_days)
        hours = session.execute(delete(_H).where(_H.hour < hourly_cut)).rowcount
        latest_cut = to_ms(now - timedelta(hours=raw_hours))
        stale = session.execute(
            delete(TelemetryLatestRow).where(TelemetryLatestRow.ts < latest_cut)
        ).rowcount
        used = select(_R.series_id).where(_R.series_id == _S.id).exists()
        series = session.execute(delete(_S).where(~used)).rowcount
    if series:
        _cache(store.engine).series.clear()
    return {"raw": raw or 0, "hourly": hours or 0, "latest": stale or 0, "series": series or 0}


def utilisation_summary(
    store: Store, since: datetime, until: datetime
) -> dict[tuple[str, str], tuple[datetime, datetime, float, int]]:
    """Per (tenant, workload): the first and last time, the highest value and the count of the
    GR_ENGINE_ACTIVE readings in [since, until] of devices the workload held alone (share 1):
    what idle detection judges (``meter.idle``)."""
    q = (
        select(_S.tenant, _S.workload, func.min(_R.ts), func.max(_R.ts), func.max(_R.value),
               func.count())
        .join(_S, _S.id == _R.series_id)
        .where(_R.ts >= to_ms(since), _R.ts <= to_ms(until), _S.field == GR_ENGINE_ACTIVE,
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
