"""Packed telemetry storage (issue 15): one row per device holder and time
(``telemetry_samples``), one per device (``telemetry_device_latest``); the readers that
unpivot them; rollups against the pure ``meter.rollup``; retention; migration 0018 carrying
per-reading rows over and back. Every test runs on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select, text

import telemetry_cluster as tc
from proofplane.access import SYSTEM
from proofplane.hardware.cluster_file import gpu_uuid
from proofplane.meter import fields as F
from proofplane.meter.rollup import HOUR, Point, hour_of, rollup
from proofplane.service import telemetry as tel
from proofplane.service.context import Store
from proofplane.store import migrate
from proofplane.store.tables import (
    TELEMETRY_COLUMNS,
    TelemetrySeriesRow,
    telemetry_device_latest,
    telemetry_samples,
)

E, P, G, T = F.TOTAL_ENERGY, F.POWER_USAGE, F.GR_ENGINE_ACTIVE, F.GPU_TEMP


@pytest.fixture
def cluster(store: Store) -> Store:
    tc.load(store)
    return store


def _post(store: Store, node: str, entries: list, *, now: datetime | None = None) -> tel.Ingested:
    return tel.ingest(store, tc.agent(node), node, {"samples": entries}, now=now)


def _count(store: Store, table: object) -> int:
    with store.read() as s:
        return int(s.scalar(select(func.count()).select_from(table)))


def test_a_post_is_one_row_per_device_holder_and_time(cluster: Store) -> None:
    now = datetime.now(UTC)
    whole = gpu_uuid("n1", 1)
    out = _post(cluster, "n1", [
        tc.entry(whole, now, {P: 200, G: 0.9, T: 55}),  # acme/whole: one row
        tc.entry(tc.MIG_GPU, now, {P: 300, E: 5e6}),  # shared by beta/slice (3/7) and nobody
        tc.entry(tc.MIG_GPU, now, {G: 0.5}, gi_id=7, profile="3g.40gb"),  # beta/slice alone
    ], now=now)  # fmt: skip
    assert (out.accepted, out.stored) == (6, 3 + 2 * 2 + 1)
    assert _count(cluster, telemetry_samples) == 4  # not 8 rows of one reading
    with cluster.read() as s:
        row = s.execute(
            select(telemetry_samples).join(
                TelemetrySeriesRow, TelemetrySeriesRow.id == telemetry_samples.c.series_id
            ).where(TelemetrySeriesRow.gpu_uuid == whole)
        ).one()._mapping  # fmt: skip
    assert row[TELEMETRY_COLUMNS[P]] == 200 and row[TELEMETRY_COLUMNS[G]] == 0.9
    assert row[TELEMETRY_COLUMNS[F.GPU_UTIL]] is None  # not reported: NULL
    items = tel.list_telemetry(cluster, SYSTEM, limit=500).items
    assert len(items) == out.stored
    assert {(i["gpu_uuid"], i["gi_id"], i["field"], i["value"], i["workload"], i["share"])
            for i in items} == {
        (whole, None, P, 200.0, "whole", 1.0), (whole, None, G, 0.9, "whole", 1.0),
        (whole, None, T, 55.0, "whole", 1.0),
        (tc.MIG_GPU, None, P, 300.0, "slice", round(3 / 7, 6)),
        (tc.MIG_GPU, None, P, 300.0, None, round(4 / 7, 6)),
        (tc.MIG_GPU, None, E, 5e6, "slice", round(3 / 7, 6)),
        (tc.MIG_GPU, None, E, 5e6, None, round(4 / 7, 6)),
        (tc.MIG_GPU, 7, G, 0.5, "slice", 1.0),
    }  # fmt: skip
    assert _count(cluster, telemetry_device_latest) == 3  # one per device


def test_the_raw_listing_pages_reading_by_reading(cluster: Store) -> None:
    now = datetime.now(UTC)
    n2 = gpu_uuid("n2", 0)
    for k in range(4):
        _post(
            cluster,
            "n2",
            [tc.entry(n2, now - timedelta(minutes=k), {P: k, G: 0.1 * k, T: 40 + k})],
            now=now,
        )
    everything = tel.list_telemetry(cluster, SYSTEM, limit=500).items
    assert len(everything) == 12
    assert [i["ts"] for i in everything] == sorted(i["ts"] for i in everything)
    for limit in (1, 2, 5):
        pages, cursor = [], None
        while True:
            page = tel.list_telemetry(cluster, SYSTEM, limit=limit, cursor=cursor)
            pages += page.items
            if page.next is None:
                break
            cursor = page.next
        assert pages == everything
    only = tel.list_telemetry(cluster, SYSTEM, field_name=T, limit=2)
    assert [i["value"] for i in only.items] == [43.0, 42.0]
    rest = tel.list_telemetry(cluster, SYSTEM, field_name=T, limit=2, cursor=only.next).items
    assert [i["value"] for i in rest] == [41.0, 40.0]


def test_a_resent_sample_fills_only_missing_fields_and_latest_keeps_older_fields(
    cluster: Store,
) -> None:
    now = datetime.now(UTC)
    n2 = gpu_uuid("n2", 1)
    _post(cluster, "n2", [tc.entry(n2, now, {P: 100})], now=now)
    _post(cluster, "n2", [tc.entry(n2, now, {P: 999, T: 50})], now=now)  # a retry, one more
    items = tel.list_telemetry(cluster, SYSTEM).items
    assert {(i["field"], i["value"]) for i in items} == {(P, 100.0), (T, 50.0)}
    later = now + timedelta(seconds=15)
    _post(cluster, "n2", [tc.entry(n2, later, {P: 120})], now=later)
    latest = {r["field"]: r for r in tel.latest(cluster, node="n2")}
    assert latest[P]["value"] == 120 and latest[T]["value"] == 50  # kept from the older one
    assert latest[P]["ts"] == latest[T]["ts"]  # the device's newest sample time


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    st.lists(
        st.tuples(st.integers(0, 3599), st.floats(0, 700), st.floats(0, 1), st.floats(0, 1e6)),
        min_size=1,
        max_size=12,
        unique_by=lambda r: r[0],
    )  # fmt: skip
)
def test_hourly_rollups_of_packed_samples_equal_the_pure_rollup(
    cluster: Store, readings: list[tuple[int, float, float, float]]
) -> None:
    """Gauges summed up in SQL per column, counters unpivoted into points: the same rows as
    ``meter.rollup`` over the readings themselves. Each example writes its own device-hour."""
    now = datetime.now(UTC)
    n1 = gpu_uuid("n1", 1)
    hour = hour_of(now) - HOUR * (2 + len(tel.list_telemetry(cluster, SYSTEM, limit=500).items)
                                  % 40)  # fmt: skip
    with cluster.write(SYSTEM) as tx:  # each example starts from an empty table
        tx.session.execute(telemetry_samples.delete())
    energy, points = 1e9, []
    entries = []
    for sec, power, act, inc in sorted(readings):
        at = hour + timedelta(seconds=sec)
        energy += inc
        entries.append(tc.entry(n1, at, {P: power, G: act, E: energy}))
        points += [Point("n1", n1, None, f, at, v) for f, v in ((P, power), (G, act),
                                                                 (E, energy))]  # fmt: skip
    _post(cluster, "n1", entries, now=now)
    with cluster.read() as session:
        got = tel.aggregate(session, hour, hour + HOUR, node="n1")
    want = rollup(points, {})
    key = lambda h: (h.field, h.count, h.min, h.max, h.last)  # noqa: E731
    assert sorted(map(key, got)) == sorted(map(key, want))
    for g, w in zip(sorted(got, key=key), sorted(want, key=key), strict=True):
        assert g.sum == pytest.approx(w.sum)


def test_retention_drops_samples_then_their_series_and_stale_devices(cluster: Store) -> None:
    now = datetime.now(UTC)
    old = now - timedelta(hours=40)
    n2 = gpu_uuid("n2", 0)
    _post(cluster, "n2", [tc.entry(n2, old, {P: 1, T: 40})], now=now)
    assert (_count(cluster, telemetry_samples), _count(cluster, TelemetrySeriesRow)) == (1, 1)
    later = now + timedelta(hours=10)  # the sample is 50 h old
    first = tel.apply_retention(cluster, SYSTEM, later)  # not rolled up yet: samples stay
    assert (first["raw"], first["series"], first["latest"]) == (0, 0, 1)
    tel.rollup_hours(cluster, SYSTEM, later)
    out = tel.apply_retention(cluster, SYSTEM, later)
    assert (out["raw"], out["series"], out["latest"]) == (1, 1, 0)
    assert _count(cluster, telemetry_samples) == 0 and _count(cluster, TelemetrySeriesRow) == 0
    assert tel.latest(cluster) == []
    assert {r.field for r in tel.hourly_rows(cluster, start=old - HOUR, end=later)} == {P, T}
    # a series still written to survives, and a new post after retention is stored again
    _post(cluster, "n2", [tc.entry(n2, later, {P: 2})], now=later)
    assert tel.apply_retention(cluster, SYSTEM, later)["series"] == 0
    assert [i["value"] for i in tel.list_telemetry(cluster, SYSTEM).items] == [2.0]


_OLD_ROWS = {
    "series": [  # id, key, node, gpu, gi, profile, field, workload, tenant, share, simulated
        (1, "a", "n1", "GPU-a", None, None, P, "w", "acme", 1.0, False),
        (2, "b", "n1", "GPU-a", None, None, E, "w", "acme", 1.0, False),
        (3, "c", "n1", "GPU-a", 3, "1g.10gb", G, None, None, 1.0, True),
    ],
    "raw": [(1, 1_000, 100.0), (2, 1_000, 5e6), (1, 16_000, 110.0), (3, 1_000, 0.5)],
    "latest": [  # key, node, gpu, gi, profile, field, ts, value, workload, tenant, simulated
        ("ka", "n1", "GPU-a", None, None, P, 16_000, 110.0, "w", "acme", False),
        ("kb", "n1", "GPU-a", None, None, E, 1_000, 5e6, "w", "acme", False),
        ("kc", "n1", "GPU-a", 3, "1g.10gb", G, 1_000, 0.5, None, None, True),
    ],
}


def test_migration_0018_carries_per_reading_rows_over_and_back(store: Store) -> None:
    migrate.downgrade(store.engine, "0017")
    with store.engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO telemetry_series (id, key, node, gpu_uuid, gi_id, profile, field, "
            "workload, tenant, share, simulated) VALUES (:i, :k, :n, :g, :gi, :p, :f, :w, :t, "
            ":sh, :sim)"
        ), [dict(zip(("i", "k", "n", "g", "gi", "p", "f", "w", "t", "sh", "sim"), r,
                     strict=True)) for r in _OLD_ROWS["series"]])  # fmt: skip
        conn.execute(text("INSERT INTO telemetry_raw (series_id, ts, value) VALUES (:s, :t, :v)"),
                     [{"s": s, "t": t, "v": v} for s, t, v in _OLD_ROWS["raw"]])  # fmt: skip
        conn.execute(text(
            "INSERT INTO telemetry_latest (key, node, gpu_uuid, gi_id, profile, field, ts, value, "
            "workload, tenant, simulated) VALUES (:k, :n, :g, :gi, :p, :f, :ts, :v, :w, :t, :sim)"
        ), [dict(zip(("k", "n", "g", "gi", "p", "f", "ts", "v", "w", "t", "sim"), r,
                     strict=True)) for r in _OLD_ROWS["latest"]])  # fmt: skip
    migrate.upgrade(store.engine)
    assert _count(store, TelemetrySeriesRow) == 2  # GPU-a for w, GPU-a/3 for nobody
    assert _count(store, telemetry_samples) == 3  # (w, 1 s), (w, 16 s), (nobody, 1 s)
    items = tel.list_telemetry(store, SYSTEM, limit=500).items
    assert sorted((i["ts"].timestamp(), i["field"], i["value"], i["workload"], i["simulated"])
                  for i in items) == sorted([
        (1.0, P, 100.0, "w", False), (1.0, E, 5e6, "w", False), (16.0, P, 110.0, "w", False),
        (1.0, G, 0.5, None, True),
    ])  # fmt: skip
    latest = {(r["gi_id"], r["field"]): r["value"] for r in tel.latest(store)}
    assert latest == {(None, P): 110.0, (None, E): 5e6, (3, G): 0.5}
    with store.read() as s:
        assert set(s.scalars(select(TelemetrySeriesRow.seen_ms))) == {0}  # hour 0 of 1970
    # and back: one row per reading again
    migrate.downgrade(store.engine, "0017")
    with store.engine.connect() as conn:
        raw = conn.execute(text(
            "SELECT s.field, r.ts, r.value, s.workload FROM telemetry_raw r "
            "JOIN telemetry_series s ON s.id = r.series_id"
        )).all()  # fmt: skip
        old_latest = conn.execute(text("SELECT field, value FROM telemetry_latest")).all()
    assert sorted(map(tuple, raw)) == sorted([
        (P, 1_000, 100.0, "w"), (E, 1_000, 5e6, "w"), (P, 16_000, 110.0, "w"),
        (G, 1_000, 0.5, None),
    ])  # fmt: skip
    assert sorted(map(tuple, old_latest)) == sorted([(P, 110.0), (E, 5e6), (G, 0.5)])
    migrate.upgrade(store.engine)
    assert migrate.is_current(store.engine)


def test_a_node_decommissioned_after_its_last_post_is_refused(cluster: Store) -> None:
    """The node's id, state and holders are reused between posts while no event was written;
    a decommission writes one, so the next post reads the node again and is refused."""
    from proofplane.errors import InvalidState
    from proofplane.service import decommission

    now = datetime.now(UTC)
    n2 = gpu_uuid("n2", 0)
    _post(cluster, "n2", [tc.entry(n2, now, {P: 1})], now=now)
    _post(cluster, "n2", [tc.entry(n2, now + timedelta(seconds=15), {P: 2})], now=now)
    decommission.decommission_node(cluster, SYSTEM, "n2", "retired")
    with pytest.raises(InvalidState) as err:
        _post(cluster, "n2", [tc.entry(n2, now + timedelta(seconds=30), {P: 3})], now=now)
    assert err.value.code == "decommissioned_node"
