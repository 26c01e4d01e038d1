"""Metering and chargeback (issue 15, §4–§6): the usage report and the cost comparison, read
from the audit log (and telemetry where there is some). Reads only: no transaction writes.

The report streams the usage events (``workload.place`` and the releases, after the
``node.register`` events that state each GPU's model) through the pure ``meter.usage.Meter``,
grouped by workload name, each name's events in log order (all the order the meter needs):
the store extracts the few detail fields the meter reads (tenant, node, tags, MIG profile,
share, device count, first GPU UUID), so no event's JSON is parsed in Python except a gang's
members or the devices on a node with GPUs of several models. Memory stays bounded by one
name's holds and the report's lines. A large SQLite log (``PARALLEL_FROM`` events) is read by
one worker process per CPU, each metering one consecutive range of the log in log order;
``meter.usage.join_ranges`` ends the holds one range hands to the next, so the totals are
exactly the one-process totals.

Rate cards and the cost model are data files: the shipped defaults
(``data/rate-card.yaml``, ``data/cost-model.yaml``), or ``PROOFPLANE_RATE_CARD`` /
``PROOFPLANE_COST_MODEL``, or a path the caller names.
"""

from __future__ import annotations

import gc
import json
import os
import sqlite3
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from datetime import UTC, datetime
from fractions import Fraction
from importlib import resources
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import ColumnElement, case, func, literal, null, select
from sqlalchemy.orm import Session

from proofplane.access import Actor, Permission, authorize
from proofplane.errors import NotFound, ValidationFailed
from proofplane.meter import cost as cost_core
from proofplane.meter.focus import focus_csv
from proofplane.meter.rates import RateCard, parse_rate_card, segments
from proofplane.meter.usage import (
    ACTIVITY_FIELD,
    GROUP_BY,
    PLACE_ACTION,
    USAGE_ACTIONS,
    FirstEvent,
    Meter,
    Metered,
    RangePart,
    UsageReport,
    gpu_fraction,
    join_ranges,
    micros,
    price,
    report_bytes,
    report_csv,
    waste_view,
)
from proofplane.model import NodeState
from proofplane.service import telemetry
from proofplane.service.context import Store
from proofplane.store.audit_log import sqlite_connection
from proofplane.store.tables import EventRow, GpuRow, NodeRow, TenantRow

RATE_CARD_ENV = "PROOFPLANE_RATE_CARD"
COST_MODEL_ENV = "PROOFPLANE_COST_MODEL"
FORMATS = ("json", "csv", "focus")
MEDIA_TYPES = {"json": "application/json", "csv": "text/csv", "focus": "text/csv"}
STREAM_BATCH = 20_000

_E = EventRow.__table__.c


# --- data files ----------------------------------------------------------------------------------


def _read_data_file(path: str | None, env: str, shipped: str, what: str) -> tuple[Any, str]:
    """The parsed YAML (or JSON) of ``path``, else of the file ``env`` names, else the shipped
    one; and the name to quote in errors. A missing or unreadable file is a clear error."""
    chosen = path or os.environ.get(env) or None
    if chosen is None:
        text = (resources.files("proofplane") / "data" / shipped).read_text("utf-8")
        source = f"(shipped) {shipped}"
    else:
        source = chosen
        try:
            text = Path(chosen).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValidationFailed(
                f"{what} {chosen}: cannot be read ({exc.__class__.__name__}: "
                f"{getattr(exc, 'strerror', None) or exc})",
                code=f"invalid_{what.replace(' ', '_')}",
                details={"source": chosen},
            ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ValidationFailed(
            f"{what} {source}: not valid YAML or JSON{where}: "
            f"{getattr(exc, 'problem', None) or exc}",
            code=f"invalid_{what.replace(' ', '_')}",
            details={"source": source},
        ) from None
    return data, source


def load_rate_card(path: str | None = None) -> RateCard:
    """The rate card at ``path``, else ``$PROOFPLANE_RATE_CARD``, else the shipped default."""
    data, source = _read_data_file(path, RATE_CARD_ENV, "rate-card.yaml", "rate card")
    return parse_rate_card(data, source=source)


def load_cost_model(path: str | None = None) -> cost_core.CostModel:
    """The cost model at ``path``, else ``$PROOFPLANE_COST_MODEL``, else the shipped one."""
    data, source = _read_data_file(path, COST_MODEL_ENV, "cost-model.yaml", "cost model")
    return cost_core.parse_cost_model(data, source=source)


# --- reading the log -----------------------------------------------------------------------------


def _window(start: datetime, end: datetime, now: datetime) -> tuple[datetime, datetime]:
    for name, ts in (("from", start), ("to", end)):
        if ts.tzinfo is None:
            raise ValidationFailed(f"{name}: a time with its zone", code="invalid_period")
    start, end = start.astimezone(UTC), end.astimezone(UTC)
    if start >= end:
        raise ValidationFailed(
            f"the window is empty: from ({start.isoformat()}) must be before to "
            f"({end.isoformat()})",
            code="invalid_period",
            details={"from": start.isoformat(), "to": end.isoformat()},
        )
    # Usage is known up to now: an interval still open is cut at min(to, now).
    return start, max(start, min(end, now.astimezone(UTC)))


@dataclass(frozen=True)
class GpuModels:
    by_uuid: dict[str, str]  # GPU UUID -> SKU, from every node.register event
    mixed_nodes: frozenset[str]  # nodes registered with GPUs of more than one model


def gpu_models(session: Session, end: datetime) -> GpuModels:
    """What the ``node.register`` events before ``end`` say each GPU is."""
    by_uuid: dict[str, str] = {}
    models: dict[str, set[str]] = {}
    query = (
        select(_E.target_id, _E.details)
        .where(_E.action == "node.register", _E.ts < end)
        .order_by(_E.seq)
    )
    for node, details in session.execute(query):
        for gpu in (details or {}).get("gpus") or ():
            uuid, model = gpu.get("uuid"), gpu.get("model")
            if isinstance(uuid, str) and isinstance(model, str):
                by_uuid[uuid] = model
                models.setdefault(node, set()).add(model)
    return GpuModels(by_uuid, frozenset(n for n, m in models.items() if len(m) > 1))


def _usage_query(session: Session, end: datetime, mixed: frozenset[str]) -> Any:
    """The usage events before ``end``, grouped by name in log order, as the meter's tuples (see
    ``meter.usage.EventTuple``): the detail fields extracted by the database (PostgreSQL's
    JSON operators; SQLite reads ``_SQLITE_USAGE`` through its DB-API cursor)."""
    d = _E.details
    ts = _E.ts
    tenant, node = d["tenant"].as_string(), d["node"].as_string()
    tags = d["tags"].as_string()
    profile = d[("gpus", "mig_profile")].as_string()
    share = d[("gpus", "share_milli")].as_integer()
    count = func.jsonb_array_length(d["devices"])
    first = d[("devices", 0, "gpu_uuid")].as_string()
    devices, members = d["devices"].as_string(), d["members"].as_string()
    devices_if_mixed: ColumnElement[Any] = (
        case((node.in_(sorted(mixed)), devices), else_=null()) if mixed else literal(None)
    )
    return (
        select(
            _E.action,
            ts,
            _E.target_id,
            tenant,
            node,
            tags,
            profile,
            share,
            count,
            first,
            devices_if_mixed,
            members,
        )
        .where(_E.target_type == "workload", _E.action.in_(USAGE_ACTIONS), _E.ts < end)
        .order_by(_E.target_id, _E.seq)
    )


def _stream(session: Session, query: Any) -> Iterator[Any]:
    result = session.execute(query, execution_options={"yield_per": STREAM_BATCH})
    for partition in result.partitions():
        yield from partition


# SQLite's hot path: the same rows through the DB-API cursor (plain tuples, no result-row
# objects), the detail fields extracted only where the meter reads them (a release needs its
# tenant; a cancel, which may name none, its node). Grouped by workload name, each name's
# events in log order: the meter needs no more order than that (meter.usage.Meter), and it
# keeps only the holds of one name at a time then, instead of the whole fleet's.
_PLACE_ONLY = "CASE WHEN action = 'workload.place' THEN {} END"
_SQLITE_USAGE = (
    "SELECT action, ts, target_id, json_extract(details, '$.tenant'), "
    "CASE WHEN action IN ('workload.place', 'workload.cancel') "
    "THEN json_extract(details, '$.node') END, "
    + ", ".join(
        _PLACE_ONLY.format(x)
        for x in (
            "json_extract(details, '$.tags')",
            "json_extract(details, '$.gpus.mig_profile')",
            "json_extract(details, '$.gpus.share_milli')",
            "json_array_length(details, '$.devices')",
            "json_extract(details, '$.devices[0].gpu_uuid')",
            "{devices}",
            "json_extract(details, '$.members')",
        )
    )
    + " FROM events WHERE target_type = 'workload' AND action IN ({actions}) AND ts < ?"
    + "{part}"
)
MAX_MIXED_PARAMS = 500  # more nodes of mixed models than this: read every placement's devices


# The worker processes split the log into consecutive ranges of seq, one each (SQLite walks
# the table's own order through the range: each page is read by one process only), each
# range grouped by name (a meter over the whole fleet's open holds at once runs ~50 % slower
# than over one name's, in this loop); meter.usage.join_ranges joins the ranges' holds.
_BY_NAME = " ORDER BY target_id, seq"
_RANGE = " AND seq >= ? AND seq < ?" + _BY_NAME
# The first usage event of one (tenant, name) in a range: a hold handed over ends there.
_FIRST_EVENT = (
    "SELECT ts FROM events WHERE target_type = 'workload' AND target_id = ? "
    "AND seq >= ? AND seq < ? AND action IN ({actions}) AND ts < ? "
    "AND json_extract(details, '$.tenant') = ? ORDER BY seq LIMIT 1"
)
PARALLEL_FROM = 1_000_000  # events in the log: below this, starting processes costs more
MMAP_BYTES = 1 << 32  # a worker maps the file (SQLite caps it at its compile-time maximum)


def _sqlite_sql(
    end_text: str, mixed: frozenset[str], seqs: tuple[int, int] | None
) -> tuple[str, list[Any]]:
    params: list[Any] = []
    if not mixed:
        devices = "NULL"
    elif len(mixed) > MAX_MIXED_PARAMS:
        devices = "json_extract(details, '$.devices')"
    else:
        marks = ", ".join("?" * len(mixed))
        devices = (
            f"CASE WHEN json_extract(details, '$.node') IN ({marks}) "
            "THEN json_extract(details, '$.devices') END"
        )
        params.extend(sorted(mixed))
    sql = _SQLITE_USAGE.replace("{devices}", devices).replace(
        "{actions}", ", ".join("?" * len(USAGE_ACTIONS))
    )
    params.extend(USAGE_ACTIONS)
    params.append(end_text)
    if seqs is not None:
        params.extend(seqs)
    return sql.replace("{part}", _RANGE if seqs is not None else _BY_NAME), params


def _sqlite_rows(
    raw: Any, end_text: str, mixed: frozenset[str], seqs: tuple[int, int] | None = None
) -> Iterator[Any]:
    sql, params = _sqlite_sql(end_text, mixed, seqs)
    cursor = raw.execute(sql, params)
    try:
        while rows := cursor.fetchmany(STREAM_BATCH):
            yield from rows
    finally:
        cursor.close()


def stored_time(session: Session, ts: datetime) -> str:
    """``ts`` as the ``events.ts`` column stores it on SQLite (its type's own processing:
    naive UTC text with microseconds), to compare stored times with in plain SQL."""
    dialect = session.get_bind().dialect
    process = _E.ts.type.dialect_impl(dialect).bind_processor(dialect)
    value = process(ts) if process else ts
    if not isinstance(value, str):  # pragma: no cover - SQLite's DATETIME is text
        raise TypeError(f"expected the stored text of a time, got {value!r}")
    return value


@dataclass(frozen=True)
class _Job:
    """What one worker process meters: the events with ``lo <= seq < hi``."""

    path: str
    end_text: str
    start: datetime
    end: datetime
    cuts: tuple[datetime, ...]
    by_workload: bool
    tracked: frozenset[tuple[str, str]]
    models: dict[str, str]
    mixed: frozenset[str]
    lo: int
    hi: int


def _meter_part(job: _Job) -> RangePart:
    """One worker process's range of the log (its own connection to the SQLite file). The
    cyclic garbage collector is off: the meter makes no cycles, and with millions of small
    tuples alive it would only walk them."""
    gc.disable()
    conn = sqlite3.connect(job.path, timeout=30)
    try:
        conn.execute("PRAGMA query_only = 1")
        conn.execute(f"PRAGMA mmap_size = {MMAP_BYTES}")  # pages read in place, not copied
        meter = Meter(
            job.start,
            job.end,
            job.models,
            cuts=job.cuts,
            by_workload=job.by_workload,
            tracked=job.tracked,
            ranged=True,
        )
        conn.execute("BEGIN")  # one snapshot of the log
        meter.feed(_sqlite_rows(conn, job.end_text, job.mixed, (job.lo, job.hi)))
        conn.rollback()
        return meter.hand_over()
    finally:
        conn.close()


def _workers(session: Session, path: str | None) -> int:
    """Processes to meter a SQLite log with: one per CPU for a large log, else none."""
    cpus = os.cpu_count() or 1
    if path is None or cpus < 2:
        return 0
    size = session.scalar(select(func.max(_E.seq))) or 0
    return min(cpus, 8) if size >= PARALLEL_FROM else 0


def _ranges(session: Session, count: int) -> list[tuple[int, int]]:
    """``count`` consecutive ranges of seq, [lo, hi), covering the whole log."""
    # two queries: SQLite answers a lone min() or max() from the b-tree's edge, but scans the
    # whole table for both in one SELECT
    lo = session.scalar(select(func.min(_E.seq)))
    hi = session.scalar(select(func.max(_E.seq)))
    lo, hi = int(lo or 0), int(hi or 0) + 1
    edges = [lo + (hi - lo) * k // count for k in range(count)] + [hi]
    return list(zip(edges, edges[1:], strict=False))


def _parallel(jobs: list[_Job]) -> list[RangePart] | None:
    # fork is cheap but unsafe in a threaded process (a server): spawn there
    ctx = get_context("fork" if threading.active_count() == 1 else "spawn")
    try:
        with ProcessPoolExecutor(len(jobs), mp_context=ctx) as pool:
            return list(pool.map(_meter_part, jobs))
    except (BrokenProcessPool, OSError):  # no processes to be had: do it here
        return None


def _first_event(raw: Any, jobs: list[_Job]) -> FirstEvent:
    """Looks up the first usage event of (tenant, name) in a job's range (the name index)."""
    sql = _FIRST_EVENT.replace("{actions}", ", ".join("?" * len(USAGE_ACTIONS)))

    def first(j: int, tenant: str, name: str) -> int | None:
        job = jobs[j]
        row = raw.execute(sql, (name, job.lo, job.hi, *USAGE_ACTIONS, job.end_text, tenant))
        found = row.fetchone()
        return None if found is None else micros(found[0])

    return first


def meter_log(
    store: Store,
    start: datetime,
    end: datetime,
    *,
    cuts: tuple[datetime, ...] = (),
    by_workload: bool = False,
    tracked: frozenset[tuple[str, str]] = frozenset(),
    workers: int | None = None,
) -> tuple[Metered, GpuModels]:
    """Run the meter over the log for [start, end) (see the module docstring). A large
    SQLite log is read by ``workers`` processes (default: one per CPU from
    ``PARALLEL_FROM`` events), each metering the workloads whose names fall to it."""
    with store.read(streaming=True) as session:  # the events stream (``_stream``)
        models = gpu_models(session, end)
        raw = sqlite_connection(session)
        if raw is not None:
            end_text = stored_time(session, end)
            path = store.engine.url.database
            count = _workers(session, path) if workers is None else workers
            if count > 1 and path:
                jobs = [
                    _Job(path, end_text, start, end, cuts, by_workload, tracked,
                         models.by_uuid, models.mixed_nodes, lo, hi)
                    for lo, hi in _ranges(session, count)
                ]  # fmt: skip
                parts = _parallel(jobs)
                if parts is not None:
                    joiner = Meter(
                        start, end, models.by_uuid, cuts=cuts, by_workload=by_workload,
                        tracked=tracked,
                    )  # fmt: skip
                    metered = join_ranges(joiner, parts, _first_event(raw, jobs))
                    if metered is not None:
                        return metered, models
        meter = Meter(
            start, end, models.by_uuid, cuts=cuts, by_workload=by_workload, tracked=tracked
        )
        if raw is not None:
            meter.feed(_sqlite_rows(raw, end_text, models.mixed_nodes))
        else:
            meter.feed(_stream(session, _usage_query(session, end, models.mixed_nodes)))
    return meter.finish(), models


def _tenants(store: Store, actor: Actor, tenant: str | None) -> frozenset[str] | None:
    """The tenants the report covers: ``tenant`` (404 when unknown or not the caller's), or
    every tenant the caller sees (None: all)."""
    authorize(actor, Permission.WORKLOADS_READ)
    visible = actor.visible_tenants(Permission.WORKLOADS_READ)
    if tenant is None:
        return visible
    authorize(actor, Permission.WORKLOADS_READ, tenant=tenant)
    with store.read() as session:
        if session.scalar(select(TenantRow.id).where(TenantRow.name == tenant)) is None:
            raise NotFound(f"tenant {tenant!r} not found", details={"tenant": tenant})
    return frozenset({tenant})


def usage_report(
    store: Store,
    actor: Actor,
    *,
    start: datetime,
    end: datetime,
    now: datetime,
    tenant: str | None = None,
    group_by: str = "sku",
    rate_card: RateCard | None = None,
    waste: bool = False,
) -> UsageReport:
    """GPU-hours, energy and cost per tenant for [start, end) from the audit log, priced with
    ``rate_card`` (default: ``load_rate_card()``). Tenant-scoped callers see their tenants
    only; ``tenant`` another's (or an unknown one) is a 404. ``waste`` adds the
    allocated-but-idle view from telemetry (never the invoice basis)."""
    if group_by not in GROUP_BY:
        raise ValidationFailed(
            f"group_by {group_by!r}: one of {', '.join(GROUP_BY)}",
            code="invalid_group_by",
            details={"group_by": group_by, "allowed": list(GROUP_BY)},
        )
    tenants = _tenants(store, actor, tenant)
    start, cut_at = _window(start, end, now)
    card = rate_card or load_rate_card()
    segs = segments(card, start, cut_at) if cut_at > start else []
    energy_all = telemetry.energy_kwh(store, start=start, end=cut_at) if cut_at > start else {}
    energy = {
        (t, w): kwh
        for (t, w), kwh in energy_all.items()
        if t is not None and w is not None and (tenants is None or t in tenants)
    }
    unallocated = energy_all.get((None, None)) if tenants is None else None
    metered, _models = meter_log(
        store,
        start,
        cut_at,
        cuts=tuple(s.start for s in segs[1:]),
        by_workload=group_by == "workload",
        tracked=frozenset(energy),
    )
    notes = [
        "usage: allocation intervals from the audit log (workload.place until the workload's "
        "next workload.evict, workload.cancel, workload.succeeded, workload.failed or "
        "workload.cancelled); intervals open at the end are cut there",
        "weights: a MIG instance counts its compute slices / 7 of a GPU, a shared GPU its "
        "share_milli / 1000",
    ]
    if cut_at < end.astimezone(UTC):
        notes.append(
            "partial: the window ends after now; usage is counted up to "
            f"{cut_at:%Y-%m-%dT%H:%M:%SZ}"
        )
    if not energy_all:
        notes.append("energy: no metered energy in the window (no telemetry): 0 kWh")
    else:
        notes.append("energy: metered (DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION), shown, not priced")
    if metered.releases_matched_by_name:
        notes.append(
            f"{metered.releases_matched_by_name} workload.cancel event(s) without a tenant "
            "were matched to their workload by name and node"
        )
    waste_rows = None
    if waste:
        rows = (
            telemetry.hourly(store, start=start, end=cut_at, tenant=tenant, field=ACTIVITY_FIELD)
            if cut_at > start
            else []
        )
        waste_rows = waste_view(rows, tenants=tenants)
        if any(r.get("simulated") for r in rows):
            notes.append("waste: includes simulated telemetry")
        notes.append(
            "waste: allocated device-hours whose max DCGM_FI_PROF_GR_ENGINE_ACTIVE stayed "
            "below 0.05, and the sum of (1 - mean activity); a view, never the invoice basis"
        )
    return price(
        metered,
        card,
        segs,
        start=start,
        end=cut_at,
        requested_end=end.astimezone(UTC),
        group_by=group_by,
        tenants=tenants,
        energy=energy,
        unallocated_energy=unallocated,
        notes=notes,
        waste=waste_rows,
    )


def render(report: UsageReport, fmt: str) -> bytes:
    """The report in ``fmt`` (json | csv | focus) as bytes: the same report, the same bytes."""
    if fmt == "json":
        return report_bytes(report)
    if fmt == "csv":
        return report_csv(report).encode()
    if fmt == "focus":
        return focus_csv(report).encode()
    raise ValidationFailed(
        f"format {fmt!r}: one of {', '.join(FORMATS)}",
        code="invalid_format",
        details={"format": fmt, "allowed": list(FORMATS)},
    )


# --- cost comparison ----------------------------------------------------------------------------


def fleet_facts(
    store: Store, actor: Actor, *, start: datetime, end: datetime, now: datetime
) -> list[cost_core.SkuFacts]:
    """What the cost comparison measures per SKU over [start, end): the GPUs owned (every node
    not decommissioned, as the inventory stands), the GPU-hours tenants held (the log), the
    metered energy (telemetry) and the mean activity of the held devices (telemetry)."""
    authorize(actor, Permission.EVENTS_READ)
    start, cut_at = _window(start, end, now)
    with store.read() as session:
        owned: dict[str, int] = {}
        query = (
            select(GpuRow.model, func.count())
            .join(NodeRow, GpuRow.node_id == NodeRow.id)
            .where(NodeRow.state != NodeState.DECOMMISSIONED.value)
            .group_by(GpuRow.model)
        )
        for model, n in session.execute(query):
            owned[model] = int(n)
    energy_all = telemetry.energy_kwh(store, start=start, end=cut_at) if cut_at > start else {}
    workload_energy = {
        (t, w): kwh for (t, w), kwh in energy_all.items() if t is not None and w is not None
    }
    metered, models = meter_log(store, start, cut_at, tracked=frozenset(workload_energy))
    allocated: dict[str, Fraction] = {}
    for (_seg, key), units in metered.usage.items():
        hours = Fraction(units, 3_600_000_000) * gpu_fraction(key.sku, key.kind, key.profile)
        allocated[key.sku] = allocated.get(key.sku, Fraction(0)) + hours
    energy: dict[str, Fraction] = {}
    for name, kwh in workload_energy.items():
        used = metered.tracked.get(name) or {}
        weights: dict[str, Fraction] = {}
        for (_s, k), u in used.items():
            weights[k.sku] = weights.get(k.sku, Fraction(0)) + u * gpu_fraction(
                k.sku, k.kind, k.profile
            )
        total = sum(weights.values(), Fraction(0))
        for sku, w in weights.items() if total else ():
            energy[sku] = energy.get(sku, Fraction(0)) + Fraction(repr(kwh)) * w / total
    idle_energy = energy_all.get((None, None))
    capacity = sum(owned.values())
    if idle_energy and capacity:  # energy no placement held: shared by GPUs owned
        for sku, n in owned.items():
            energy[sku] = energy.get(sku, Fraction(0)) + Fraction(repr(idle_energy)) * n / capacity
    activity: dict[str, list[Fraction]] = {}
    if cut_at > start:
        for row in telemetry.hourly(store, start=start, end=cut_at, field=ACTIVITY_FIELD):
            held = models.by_uuid.get(row.get("gpu_uuid") or "")
            count = int(row.get("count") or 0)
            if held is None or row.get("workload") is None or count <= 0:
                continue
            a = activity.setdefault(held, [Fraction(0), Fraction(0)])
            a[0] += Fraction(repr(float(row["sum"]))) / count
            a[1] += 1
    hours = Fraction(micros(cut_at) - micros(start), 3_600_000_000)
    skus = sorted(set(owned) | set(allocated))
    return [
        cost_core.SkuFacts(
            sku=sku,
            gpus=owned.get(sku, 0),
            hours=hours,
            allocated_gpu_hours=allocated.get(sku, Fraction(0)),
            energy_kwh=energy.get(sku) if energy_all else None,
            mean_activity=(
                activity[sku][0] / activity[sku][1]
                if sku in activity and activity[sku][1]
                else None
            ),
        )
        for sku in skus
    ]


def cost_compare(
    store: Store,
    actor: Actor,
    *,
    start: datetime,
    end: datetime,
    now: datetime,
    model: cost_core.CostModel | None = None,
) -> dict[str, Any]:
    """Cost per effective GPU-hour on this fleet against the cloud alternative the model
    describes, with every input and measured fact shown (``meter.cost.compare``)."""
    facts = fleet_facts(store, actor, start=start, end=end, now=now)
    start_utc, cut_at = _window(start, end, now)
    return cost_core.compare(model or load_cost_model(), facts, start=start_utc, end=cut_at)


def dumps(value: Mapping[str, Any]) -> bytes:
    return (json.dumps(value, separators=(",", ":")) + "\n").encode()


__all__ = [
    "FORMATS",
    "MEDIA_TYPES",
    "PLACE_ACTION",
    "cost_compare",
    "fleet_facts",
    "load_cost_model",
    "load_rate_card",
    "meter_log",
    "render",
    "usage_report",
]
