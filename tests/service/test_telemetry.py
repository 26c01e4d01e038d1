"""service.telemetry: ingest keyed to placements, the read functions, rollup and retention."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

import telemetry_cluster as tc
from proofplane.access import SYSTEM, Actor, Role
from proofplane.errors import NotFound, ValidationFailed
from proofplane.hardware.cluster_file import gpu_uuid
from proofplane.meter import fields as F
from proofplane.service import telemetry as tel
from proofplane.service import workloads as wl_svc
from proofplane.service.context import Store
from proofplane.store.tables import EventRow, TelemetrySeriesRow, telemetry_samples

E, P, G = F.TOTAL_ENERGY, F.POWER_USAGE, F.GR_ENGINE_ACTIVE


@pytest.fixture
def cluster(store: Store) -> Store:
    tc.load(store)
    return store


def _placed_at(store: Store) -> datetime:
    return max(w.updated_at for w in wl_svc.list_workloads(store, SYSTEM).items)


def _post(store, node, entries, *, now=None, simulated=False, actor=None):
    body = {"simulated": simulated, "samples": entries}
    return tel.ingest(store, actor or tc.agent(node), node, body, now=now)


def test_readings_are_keyed_to_the_placement_holding_the_device(cluster: Store) -> None:
    now = datetime.now(UTC)
    before = _placed_at(cluster) - timedelta(seconds=1)
    whole = gpu_uuid("n1", 1)
    out = _post(cluster, "n1", [
        tc.entry(whole, before, {P: 100}),  # before the placement: nobody held it then
        tc.entry(whole, now, {P: 200, G: 0.9}),
        tc.entry(tc.MIG_GPU, now, {G: 0.5}, gi_id=7, profile="3g.40gb"),  # 3g@0: beta/slice
        tc.entry(tc.MIG_GPU, now, {G: 0.0}, gi_id=8, profile="1g.10gb", mig_start=4),  # free
        tc.entry(tc.MIG_GPU, now, {P: 300}),  # the MIG GPU: 3/7 beta, 4/7 nobody
    ], now=now)  # fmt: skip
    assert out.accepted == 6 and out.stored == 7 and out.ignored == {} and out.drained == []
    rows = tel.list_telemetry(cluster, SYSTEM, limit=100).items
    got = {(r["gpu_uuid"], r["gi_id"], r["field"], r["value"], r["workload"], r["tenant"],
            r["share"]) for r in rows}  # fmt: skip
    assert got == {
        (whole, None, P, 100.0, None, None, 1.0),
        (whole, None, P, 200.0, "whole", "acme", 1.0),
        (whole, None, G, 0.9, "whole", "acme", 1.0),
        (tc.MIG_GPU, 7, G, 0.5, "slice", "beta", 1.0),
        (tc.MIG_GPU, 8, G, 0.0, None, None, 1.0),
        (tc.MIG_GPU, None, P, 300.0, "slice", "beta", round(3 / 7, 6)),
        (tc.MIG_GPU, None, P, 300.0, None, None, round(4 / 7, 6)),
    }
    assert all(r["simulated"] is False for r in rows)
    latest = {(r["gpu_uuid"], r["gi_id"], r["field"]): r for r in tel.latest(cluster, node="n1")}
    assert latest[(whole, None, P)]["value"] == 200 and latest[(whole, None, P)]["tenant"] == "acme"
    assert latest[(tc.MIG_GPU, None, P)]["tenant"] is None  # shared: no single holder
    assert latest[(tc.MIG_GPU, 7, G)]["workload"] == "slice"
    assert tel.latest(cluster, node="n2") == []
    # no audit event for measurements
    with cluster.read() as s:
        assert s.scalar(select(func.count()).where(EventRow.action.like("telemetry%"))) == 0


def test_a_retried_batch_is_stored_once_and_simulated_is_kept(cluster: Store) -> None:
    now = datetime.now(UTC)
    entries = [tc.entry(gpu_uuid("n2", 0), now, {P: 50, F.GPU_TEMP: 40})]
    _post(cluster, "n2", entries, now=now, simulated=True)
    _post(cluster, "n2", entries, now=now, simulated=True)
    with cluster.read() as s:  # one device, one holder (nobody), one time: one packed row
        assert s.scalar(select(func.count()).select_from(telemetry_samples)) == 1
        assert s.scalar(select(func.count()).select_from(TelemetrySeriesRow)) == 1
    assert len(tel.list_telemetry(cluster, SYSTEM).items) == 2  # its two readings
    rows = tel.list_telemetry(cluster, SYSTEM).items
    assert {r["simulated"] for r in rows} == {True}
    assert {r["simulated"] for r in tel.latest(cluster)} == {True}


def test_energy_splits_by_share_and_adds_up(cluster: Store) -> None:
    start = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
    _ = _placed_at(cluster)
    # three hours ago nothing was placed (the workloads were placed now): every joule is
    # nobody's; the readings from now on split 3/7 to beta/slice
    now = datetime.now(UTC)
    entries = [
        tc.entry(tc.MIG_GPU, start + timedelta(minutes=10), {E: 1_000_000}),
        tc.entry(tc.MIG_GPU, start + timedelta(minutes=70), {E: 3_600_000 * 1000 + 1_000_000}),
        tc.entry(tc.MIG_GPU, now, {E: 3_600_000 * 1000 * 2 + 1_000_000}),
    ]
    _post(cluster, "n1", entries, now=now)
    kwh = tel.energy_kwh(cluster, start=start, end=now + timedelta(hours=1))
    assert sum(kwh.values()) == pytest.approx(2.0)
    assert kwh[("beta", "slice")] == pytest.approx(3 / 7, rel=1e-5)
    assert kwh[(None, None)] == pytest.approx(1 + 4 / 7, rel=1e-5)
    # hours starting in [start+1h, …): the first hour's reading only serves as the previous
    kwh2 = tel.energy_kwh(cluster, start=start + timedelta(hours=1), end=now + timedelta(hours=1))
    assert sum(kwh2.values()) == pytest.approx(2.0)


def test_rollup_stores_complete_hours_and_reads_agree(cluster: Store) -> None:
    now = datetime.now(UTC)
    base = now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
    n2 = gpu_uuid("n2", 0)
    minutes = [m for m in range(0, 200, 15) if base + timedelta(minutes=m) <= now]
    entries = [tc.entry(n2, base + timedelta(minutes=m), {E: 1000.0 * m, P: 100 + m})
               for m in minutes]  # fmt: skip
    _post(cluster, "n2", entries, now=now)
    live = tel.hourly(cluster, start=base, end=now + timedelta(seconds=1))
    done = tel.rollup_hours(cluster, SYSTEM, now)
    assert done == [base, base + timedelta(hours=1), base + timedelta(hours=2)][: len(done)]
    assert len(done) >= 2
    assert tel.rollup_hours(cluster, SYSTEM, now) == []  # nothing new
    stored = tel.hourly(cluster, start=base, end=now + timedelta(seconds=1))

    def key(rows):
        return sorted((r["hour"], r["field"], r["count"], round(r["sum"], 6), r["last"])
                      for r in rows)  # fmt: skip

    assert key(stored) == key(live)
    energy = [r for r in stored if r["field"] == E]
    assert sum(r["sum"] for r in energy) == pytest.approx(1000.0 * max(minutes))
    hourly_page = tel.list_telemetry(cluster, SYSTEM, resolution="hour", limit=2)
    assert len(hourly_page.items) == 2 and hourly_page.next is not None
    rest = tel.list_telemetry(cluster, SYSTEM, resolution="hour", cursor=hourly_page.next)
    assert len(hourly_page.items) + len(rest.items) == 2 * len(done)


def test_retention_keeps_what_is_not_rolled_up(cluster: Store) -> None:
    now = datetime.now(UTC)
    old = now - timedelta(hours=47)
    n2 = gpu_uuid("n2", 0)
    _post(cluster, "n2", [tc.entry(n2, old, {P: 1}), tc.entry(n2, now, {P: 2})], now=now)
    later = now + timedelta(hours=3)
    # not rolled up yet: nothing raw goes, whatever its age
    assert tel.apply_retention(cluster, SYSTEM, later)["raw"] == 0
    tel.rollup_hours(cluster, SYSTEM, later)
    out = tel.apply_retention(cluster, SYSTEM, later)
    assert out["raw"] == 1
    rows = tel.list_telemetry(cluster, SYSTEM).items
    assert [r["value"] for r in rows] == [2.0]
    # the rollup of the deleted reading stays
    assert any(r["last"] == 1.0 for r in tel.hourly(cluster, start=old - timedelta(hours=1),
                                                    end=later))  # fmt: skip
    much_later = now + timedelta(days=401)
    tel.rollup_hours(cluster, SYSTEM, much_later)
    out = tel.apply_retention(cluster, SYSTEM, much_later)
    assert out["hourly"] >= 2 and out["series"] >= 1 and out["latest"] >= 1


def test_bad_input_is_refused_never_a_crash(cluster: Store) -> None:
    now = datetime.now(UTC)
    with pytest.raises(ValidationFailed) as err:  # another node's GPU
        _post(cluster, "n1", [tc.entry(gpu_uuid("n2", 0), now, {P: 1})], now=now)
    assert err.value.code == "gpu_not_on_node"
    with pytest.raises(ValidationFailed) as err:  # a GPU nobody has
        _post(cluster, "n1", [tc.entry("GPU-nope", now, {P: 1})], now=now)
    assert err.value.code == "gpu_not_on_node"
    with pytest.raises(NotFound):  # an agent posting as another node
        _post(cluster, "n1", [], now=now, actor=tc.agent("n2"))
    with pytest.raises(NotFound):
        _post(cluster, "ghost", [], now=now, actor=SYSTEM)
    with pytest.raises(ValidationFailed) as err:
        tel.ingest(cluster, tc.agent("n1"), "n1", {"samples": "x"}, now=now)
    assert err.value.code == "invalid_telemetry"
    with pytest.raises(ValidationFailed) as err:
        tel.ingest(cluster, tc.agent("n1"), "n1",
                   {"samples": [tc.entry(tc.MIG_GPU, now, {P: 1, E: 1})] * 6},
                   now=now, max_samples=10)  # fmt: skip
    assert err.value.code == "too_many_samples"
    out = _post(cluster, "n1", [tc.entry(tc.MIG_GPU, now, {"DCGM_FI_DEV_NEW": 1, P: -5})],
                now=now)  # fmt: skip
    assert out.ignored == {"unknown_field": 1, "out_of_range": 1} and out.stored == 0
    # a reader without nodes:write cannot post for a node
    dev = Actor("dev", frozenset({Role.DEVELOPER}), frozenset({"acme"}))
    with pytest.raises(Exception) as err:
        _post(cluster, "n1", [], now=now, actor=dev)
    assert getattr(err.value, "code", None) == "forbidden"


def test_reads_are_scoped_to_the_readers_tenants(cluster: Store) -> None:
    now = datetime.now(UTC)
    _post(cluster, "n1", [
        tc.entry(gpu_uuid("n1", 1), now, {P: 200}),
        tc.entry(tc.MIG_GPU, now, {G: 0.5}, gi_id=7, profile="3g.40gb"),
    ], now=now)  # fmt: skip
    dev = Actor("dev", frozenset({Role.DEVELOPER}), frozenset({"acme"}))
    rows = tel.list_telemetry(cluster, dev).items
    assert {r["tenant"] for r in rows} == {"acme"}
    assert {r["tenant"] for r in tel.list_latest(cluster, dev)} == {"acme"}
    with pytest.raises(NotFound):
        tel.list_telemetry(cluster, dev, tenant="beta")
    with pytest.raises(ValidationFailed):
        tel.list_telemetry(cluster, SYSTEM, field_name="DCGM_FI_NOPE")
    with pytest.raises(ValidationFailed):
        tel.list_telemetry(cluster, SYSTEM, resolution="day")
    with pytest.raises(ValidationFailed) as err:
        tel.list_telemetry(cluster, SYSTEM, cursor="eyJrIjoidGVsZW1ldHJ5LXJhdyIsImFmdGVyIjoieCJ9")
    assert err.value.code == "invalid_cursor"
    page = tel.list_telemetry(cluster, SYSTEM, limit=1)
    second = tel.list_telemetry(cluster, SYSTEM, limit=1, cursor=page.next)
    assert page.items[0] != second.items[0]
    assert tel.list_telemetry(cluster, SYSTEM, node="n1", field_name=G, tenant="beta").items
    assert not tel.list_telemetry(cluster, SYSTEM, start=now + timedelta(seconds=1)).items


def test_the_database_sums_agree_with_the_pure_rollup(cluster: Store) -> None:
    """``aggregate`` (gauges summed up in SQL, counters in Python) equals ``meter.rollup`` over
    the same raw points, for a GPU several holders share and a GPU one holder has."""
    from proofplane.meter.rollup import hour_of, rollup

    placed = _placed_at(cluster)
    entries = []
    for k in range(-3, 12):  # before and after the placements
        ts = placed + timedelta(minutes=5 * k, seconds=1)
        entries.append(tc.entry(tc.MIG_GPU, ts, {P: 100 + 7 * k, E: 1000.0 * k * k,
                                                  F.GPU_TEMP: 40 + k}))  # fmt: skip
        entries.append(tc.entry(gpu_uuid("n1", 1), ts, {P: 300 - k, G: 0.1 * (k % 3)}))
    now = placed + timedelta(hours=1)
    _post(cluster, "n1", entries, now=now)
    base, end = hour_of(placed - timedelta(minutes=20)), now
    with cluster.read() as session:
        got = tel.aggregate(session, base, end)
        points, previous = tel._points(session, base, end)
    want = rollup(points, previous)

    def key(rows):
        return sorted((r.hour, r.gpu_uuid, r.field, r.workload or "", r.count,
                       round(r.sum, 6), r.min, r.max, r.last) for r in rows)  # fmt: skip

    assert key(got) == key(want)
    assert {r.workload for r in got} == {None, "slice", "whole"}
    with cluster.read() as session:
        only = tel.aggregate(session, base, end, tenant="beta", field_name=E)
    assert {(r.tenant, r.field) for r in only} == {("beta", E)}
    # the tenant's increase is the same whether or not the others' readings are asked for
    beta = [r for r in got if r.tenant == "beta" and r.field == E]
    assert sum(r.sum for r in only) == pytest.approx(sum(r.sum for r in beta))
