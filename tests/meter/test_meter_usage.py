"""The usage meter and its pricing (meter.usage), on event tuples as the service streams them,
and the FOCUS rows (meter.focus)."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proofplane.errors import ValidationFailed
from proofplane.meter.focus import COLUMNS, focus_csv, focus_rows
from proofplane.meter.rates import parse_rate_card, segments
from proofplane.meter.usage import (
    Meter,
    UsageKey,
    micros,
    pool_name,
    price,
    report_bytes,
    report_csv,
    round_fraction,
    waste_view,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
T1 = datetime(2026, 2, 1, tzinfo=UTC)
H = timedelta(hours=1)
MODELS = {f"GPU-n1-{i}": "H100-80GB" for i in range(8)} | {
    f"GPU-n2-{i}": "A100-40GB" for i in range(8)
}
MIXED = {"GPU-n3-0": "H100-80GB", "GPU-n3-1": "A100-40GB"}


def card(**period: Any) -> Any:
    p: dict[str, Any] = {
        "valid_from": "2025-01-01T00:00:00Z",
        "skus": {
            "H100-80GB": {"gpu_hour": "2.40", "mig": {"1g.10gb": "0.50"}},
            "A100-40GB": {"gpu_hour": "1.10"},
        },
    }
    p.update(period)
    return parse_rate_card({"version": 1, "name": "t", "currency": "USD", "periods": [p]})


def place(
    ts: datetime,
    name: str,
    tenant: str = "acme",
    *,
    node: str = "n1",
    tags: dict[str, str] | None = None,
    profile: str | None = None,
    share: int | None = None,
    count: int = 1,
    uuid: str = "GPU-n1-0",
    devices: list[dict[str, Any]] | None = None,
    members: list[dict[str, Any]] | None = None,
) -> tuple[Any, ...]:
    return (
        "workload.place",
        ts,
        name,
        tenant,
        node,
        json.dumps(tags or {}),
        profile,
        share,
        count,
        uuid,
        json.dumps(devices) if devices is not None else None,
        json.dumps(members) if members is not None else None,
    )


def release(
    action: str, ts: datetime, name: str, tenant: str | None = "acme", node: str | None = None
) -> tuple[Any, ...]:
    return (f"workload.{action}", ts, name, tenant, node, None, None, None, None, None, None, None)


def run(
    rows: list[tuple[Any, ...]],
    start: datetime = T0,
    end: datetime = T1,
    **kw: Any,
) -> dict[UsageKey, int]:
    meter = Meter(start, end, MODELS | MIXED, **kw)
    meter.feed(rows)
    return {key: units for (_seg, key), units in meter.finish().usage.items()}


def key(sku: str = "H100-80GB", kind: str = "gpu", profile: str = "", **kw: Any) -> UsageKey:
    return UsageKey(
        kw.get("tenant", "acme"), kw.get("pool", ""), sku, kind, profile, kw.get("w", "")
    )


US_H = 3_600_000_000


def test_micros_reads_datetimes_and_the_stored_text() -> None:
    ts = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    assert micros(ts) == micros(ts.replace(tzinfo=None)) == micros("2026-01-02 03:04:05.678901")
    assert micros("2026-01-02T03:04:05.678901+00:00") == micros(ts)
    assert micros(datetime(1970, 1, 1, 0, 0, 1, tzinfo=UTC)) == 1_000_000


def test_place_then_each_release_closes_the_interval() -> None:
    for action in ("evict", "cancel", "succeeded", "failed", "cancelled"):
        got = run([place(T0 + H, "w"), release(action, T0 + 3 * H, "w")])
        assert got == {key(): 2 * US_H}, action


def test_an_open_interval_is_cut_at_the_end_and_an_earlier_one_at_the_start() -> None:
    rows = [place(T0 - 5 * H, "before"), place(T1 - H, "open", uuid="GPU-n1-1")]
    assert run(rows) == {key(): US_H + (T1 - T0) // H * US_H}
    # closed before the window: nothing; opened after it: nothing
    assert run([place(T0 - 5 * H, "w"), release("evict", T0 - H, "w")]) == {}
    assert run([place(T1 + H, "w")]) == {}


def test_whole_gpus_mig_and_shares_are_weighted_in_units() -> None:
    rows = [
        place(T0, "whole", count=4),
        place(T0, "mig", profile="3g.40gb", count=2),
        place(T0, "shared", share=250),
    ]
    rows += [release("succeeded", T0 + H, n) for n in ("whole", "mig", "shared")]
    got = run(rows)
    assert got == {
        key(): 4 * US_H,
        key(kind="mig", profile="3g.40gb"): 2 * US_H,
        key(kind="shared"): 250 * US_H,
    }


def test_the_sku_comes_from_the_gpu_uuid_and_the_pool_from_the_tags() -> None:
    rows = [
        place(T0, "w", node="n2", uuid="GPU-n2-3", tags={"hipaa": "true", "b": "x"}),
        place(T0, "u", uuid="GPU-unknown"),
    ]
    got = run(rows, end=T0 + H)
    assert got == {
        key("A100-40GB", pool="b=x,hipaa=true"): US_H,
        key("unknown"): US_H,
    }


def test_a_gang_counts_every_members_devices() -> None:
    members = [
        {"node": "n1", "devices": [{"gpu_uuid": "GPU-n1-0"}, {"gpu_uuid": "GPU-n1-1"}]},
        {"node": "n2", "devices": [{"gpu_uuid": "GPU-n2-0"}, {"gpu_uuid": "GPU-n2-1"}]},
    ]
    got = run([place(T0, "g", count=2, members=members)], end=T0 + H)
    assert got == {key(): 2 * US_H, key("A100-40GB"): 2 * US_H}


def test_a_node_with_mixed_models_uses_each_devices_model() -> None:
    devices = [{"gpu_uuid": "GPU-n3-0"}, {"gpu_uuid": "GPU-n3-1"}]
    got = run([place(T0, "m", node="n3", count=2, devices=devices)], end=T0 + H)
    assert got == {key(): US_H, key("A100-40GB"): US_H}


def test_tenants_with_the_same_workload_name_are_kept_apart() -> None:
    rows = [
        place(T0, "train", "a"),
        place(T0, "train", "b", uuid="GPU-n1-1"),
        release("evict", T0 + H, "train", "a"),
        release("evict", T0 + 2 * H, "train", "b"),
    ]
    assert run(rows) == {key(tenant="a"): US_H, key(tenant="b"): 2 * US_H}


def test_a_cancel_without_a_tenant_is_matched_by_name_and_node() -> None:
    rows = [
        place(T0, "train", "a", node="n1"),
        place(T0, "train", "b", node="n2", uuid="GPU-n2-0"),
        release("cancel", T0 + H, "train", None, node="n2"),
        release("cancel", T0 + 2 * H, "train", None, node="n1"),
        release("cancel", T0 + 3 * H, "ghost", None, node="n1"),  # nothing held: nothing
    ]
    meter = Meter(T0, T1, MODELS)
    meter.feed(rows)
    metered = meter.finish()
    assert metered.releases_matched_by_name == 2
    assert {k: v for (_s, k), v in metered.usage.items()} == {
        key(tenant="a"): 2 * US_H,
        key("A100-40GB", tenant="b"): US_H,
    }


def test_a_placement_without_a_release_is_ended_by_the_next_one() -> None:
    rows = [
        place(T0, "w", uuid="GPU-n1-0"),
        place(T0 + H, "w", node="n2", uuid="GPU-n2-0"),
        release("evict", T0 + 3 * H, "w"),
        release("evict", T0 + 4 * H, "w"),  # a second release: nothing is open any more
    ]
    assert run(rows) == {key(): US_H, key("A100-40GB"): 2 * US_H}


def test_a_release_before_its_placement_in_time_counts_nothing() -> None:
    # clocks of two writers may disagree: log order decides, negative time is none
    assert run([place(T0 + 2 * H, "w"), release("evict", T0 + H, "w")]) == {}


def test_by_workload_and_tracked_workloads() -> None:
    meter = Meter(T0, T0 + 2 * H, MODELS, by_workload=True, tracked=[("acme", "a")])
    meter.feed([place(T0, "a"), place(T0, "b", uuid="GPU-n1-1")])
    m = meter.finish()
    assert {k.workload for (_s, k) in m.usage} == {"a", "b"}
    assert list(m.tracked) == [("acme", "a")]


def test_rate_periods_split_the_time() -> None:
    cut = T0 + 10 * H
    meter = Meter(T0, T1, MODELS, cuts=[cut])
    meter.feed([place(T0 + 8 * H, "w"), release("evict", T0 + 12 * H, "w")])
    usage = meter.finish().usage
    assert usage == {(0, key()): 2 * US_H, (1, key()): 2 * US_H}


# --- pricing -------------------------------------------------------------------------------------


def priced(rows: list[tuple[Any, ...]], rc: Any = None, group_by: str = "sku", **kw: Any) -> Any:
    rc = rc or card()
    end = kw.pop("end", T1)
    segs = segments(rc, T0, end)
    meter_kw = {"by_workload": group_by == "workload", **kw.pop("meter", {})}
    meter = Meter(T0, end, MODELS, cuts=[s.start for s in segs[1:]], **meter_kw)
    meter.feed(rows)
    return price(
        meter.finish(), rc, segs, start=T0, end=end, requested_end=end, group_by=group_by, **kw
    )


def test_round_fraction_is_half_even_and_exact() -> None:
    assert round_fraction(Fraction(5, 1000), 2) == Decimal("0.00")  # 0.005 -> 0.00 (even)
    assert round_fraction(Fraction(15, 1000), 2) == Decimal("0.02")  # 0.015 -> 0.02 (even)
    assert round_fraction(Fraction(25, 1000), 2) == Decimal("0.02")
    assert round_fraction(Fraction(2501, 100000), 2) == Decimal("0.03")
    assert round_fraction(Fraction(1, 3), 6) == Decimal("0.333333")
    assert round_fraction(Fraction(-15, 1000), 2) == Decimal("-0.02")
    assert str(round_fraction(Fraction(7), 2)) == "7.00"


def test_lines_are_priced_and_rounded_once_each() -> None:
    rows = [
        place(T0, "w", count=2),  # 2 GPUs x 1 h 20 min x 2.40 = 6.40
        release("succeeded", T0 + timedelta(minutes=80), "w"),
        place(T0, "m", profile="3g.40gb", uuid="GPU-n1-3"),  # 3/7 GPU x 1 h x 2.40
        release("succeeded", T0 + H, "m"),
        place(T0, "s", node="n2", uuid="GPU-n2-0", share=333),  # 0.333 x 2 h x 1.10
        release("succeeded", T0 + 2 * H, "s"),
        place(T0, "p", profile="1g.10gb", count=3, uuid="GPU-n1-4"),  # own price per instance
        release("succeeded", T0 + H, "p"),
    ]
    report = priced(rows)
    lines = {(x.sku_id): x for x in report.lines}
    assert lines["H100-80GB"].list_cost == Decimal("6.40")
    assert lines["H100-80GB"].gpu_hours == Decimal("2.666667")
    mig = lines["H100-80GB/3g.40gb"]
    assert mig.gpu_hours == Decimal("0.428571") and mig.device_hours == Decimal("1.000000")
    assert mig.list_cost == round_fraction(Fraction(3, 7) * Fraction(240, 100), 2)  # 1.03
    assert mig.pricing_unit == "GPU-Hours" and mig.list_unit_price == Decimal("2.40")
    own = lines["H100-80GB/1g.10gb"]
    assert own.pricing_unit == "Instance-Hours" and own.pricing_quantity == Decimal("3.000000")
    assert own.list_cost == Decimal("1.50") and own.gpu_hours == Decimal("0.428571")
    shared = lines["A100-40GB/shared"]
    assert shared.device_hours is None and shared.gpu_hours == Decimal("0.666000")
    assert shared.list_cost == Decimal("0.73")  # 0.7326
    assert report.total_billed_cost == sum((x.billed_cost for x in report.lines), Decimal(0))
    assert report.tenants[0].billed_cost == report.total_billed_cost
    assert str(report.total_billed_cost) == "9.66"


def test_a_discount_makes_billed_below_list() -> None:
    report = priced([place(T0, "w"), release("evict", T0 + 10 * H, "w")], card(discount="0.25"))
    (line,) = report.lines
    assert line.list_cost == Decimal("24.00") and line.billed_cost == Decimal("18.00")
    assert line.contracted_unit_price == Decimal("1.8000")


def test_group_by_changes_the_lines_not_the_time() -> None:
    rows = [
        place(T0, "a", tags={"hipaa": "true"}),
        place(T0, "b", node="n2", uuid="GPU-n2-0"),
        place(T0, "c", "other", uuid="GPU-n1-5"),
    ]
    end = T0 + 3 * H
    by = {g: priced(rows, group_by=g, end=end) for g in ("tenant", "pool", "sku", "workload")}
    assert [(x.tenant, x.sku) for x in by["tenant"].lines] == [("acme", None), ("other", None)]
    assert [x.pool for x in by["pool"].lines] == ["", "hipaa=true", ""]
    assert len(by["sku"].lines) == 3 and len(by["workload"].lines) == 3
    assert {x.workload for x in by["workload"].lines} == {"a", "b", "c"}
    totals = {g: r.total_billed_cost for g, r in by.items()}
    assert len(set(totals.values())) == 1, totals  # these lines round to whole cents anyway
    with pytest.raises(ValidationFailed) as info:
        priced(rows, group_by="node", end=end)
    assert info.value.code == "invalid_group_by"


def test_the_tenant_filter() -> None:
    rows = [place(T0, "a"), place(T0, "c", "other", uuid="GPU-n1-5")]
    report = priced(rows, tenants={"other"}, end=T0 + H)
    assert {x.tenant for x in report.lines} == {"other"}


def test_a_sku_the_card_does_not_price_is_an_error() -> None:
    rc = card(skus={"A100-40GB": {"gpu_hour": "1"}})
    with pytest.raises(ValidationFailed) as info:
        priced([place(T0, "w")], rc, end=T0 + H)
    assert info.value.code == "rate_missing" and info.value.details["skus"] == ["H100-80GB"]


def test_an_unknown_mig_profile_cannot_be_weighted() -> None:
    with pytest.raises(ValidationFailed) as info:
        priced([place(T0, "w", profile="9g.99gb")], end=T0 + H)
    assert info.value.code == "usage_unweighable"


def test_energy_is_shared_among_a_workloads_lines() -> None:
    rows = [
        place(T0, "w"),
        place(T0 + H, "w", node="n2", uuid="GPU-n2-0"),
        place(T0, "idle", uuid="GPU-n1-2"),
    ]
    energy = {("acme", "w"): 3.0, ("acme", "gone"): 0.5}
    report = priced(rows, end=T0 + 3 * H, energy=energy, meter={"tracked": [("acme", "w")]})
    by_sku = {x.sku_id: x.energy_kwh for x in report.lines}
    assert by_sku == {"H100-80GB": Decimal("1.000"), "A100-40GB": Decimal("2.000")}
    assert report.tenants[0].energy_kwh == Decimal("3.500")  # with the workload held nowhere


def test_reports_render_the_same_bytes_and_parse_back() -> None:
    rows = [place(T0, "w", tags={"gdpr-zone": "paris"}), place(T0, "x", share=500)]
    a, b = priced(rows, end=T0 + H), priced(list(rows), end=T0 + H)
    assert report_bytes(a) == report_bytes(b) and focus_csv(a) == focus_csv(b)
    data = json.loads(report_bytes(a))
    assert data["total"]["billed_cost"] == "3.60" and data["currency"] == "USD"
    assert [line["tags"] for line in data["lines"]] == [{}, {"gdpr-zone": "paris"}]
    table = list(csv.DictReader(io.StringIO(report_csv(a))))
    assert [r["sku_id"] for r in table] == ["H100-80GB/shared", "H100-80GB"]


def test_focus_rows() -> None:
    rows = [place(T0, "w", tags={"hipaa": "true"}), release("evict", T0 + H, "w")]
    report = priced(rows, group_by="workload", end=T0 + 2 * H)
    parsed = list(csv.DictReader(io.StringIO(focus_csv(report))))
    assert list(parsed[0]) == list(COLUMNS)
    (row,) = parsed
    assert row["BilledCost"] == row["EffectiveCost"] == row["ListCost"] == "2.40"
    assert row["ChargeCategory"] == "Usage" and row["ChargeClass"] == ""
    assert row["ChargePeriodStart"] == "2026-01-01T00:00:00Z"
    assert row["ChargePeriodEnd"] == "2026-01-01T02:00:00Z"
    assert row["ConsumedQuantity"] == "1.000000" and row["ConsumedUnit"] == "GPU-Hours"
    assert row["ResourceId"] == "proofplane:workload/acme/w" and row["SkuId"] == "H100-80GB"
    assert json.loads(row["Tags"]) == {
        "hipaa": "true",
        "proofplane:compliance-pool": "hipaa=true",
        "proofplane:tenant": "acme",
    }
    assert Decimal(row["ListUnitPrice"]) * Decimal(row["PricingQuantity"]) == Decimal("2.4")
    with pytest.raises(ValidationFailed):
        focus_rows(priced(rows, group_by="tenant", end=T0 + 2 * H))


def test_the_waste_view() -> None:
    f = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
    rows = [
        {"field": f, "tenant": "a", "workload": "w", "count": 4, "sum": 0.08, "max": 0.03},
        {"field": f, "tenant": "a", "workload": "w", "count": 4, "sum": 2.0, "max": 0.9},
        {"field": f, "tenant": "a", "workload": None, "count": 4, "sum": 0.0, "max": 0.0},
        {"field": "DCGM_FI_DEV_GPU_TEMP", "tenant": "a", "workload": "w", "count": 1, "sum": 60,
         "max": 60},
        {"field": f, "tenant": "b", "workload": "v", "count": 0, "sum": 0, "max": 0},
    ]  # fmt: skip
    (w,) = waste_view(rows)
    assert (w.tenant, w.allocated_device_hours, w.idle_device_hours) == ("a", 2, 1)
    assert w.utilisation_adjusted_idle_hours == Decimal("1.480000")  # (1-0.02) + (1-0.5)
    assert w.mean_activity == Decimal("0.2600")
    assert waste_view(rows, tenants={"b"}) == []


def test_pool_name() -> None:
    assert pool_name({"b": "2", "a": "1"}) == "a=1,b=2" and pool_name({}) == ""


# --- a property: the meter against a brute-force count ------------------------------------------

EVENT = st.tuples(
    st.integers(0, 40),  # hour
    st.sampled_from(["place", "evict", "cancel", "succeeded"]),
    st.sampled_from(["w1", "w2", "w3"]),
    st.sampled_from(["a", "b"]),
    st.integers(1, 3),  # GPUs
)


@settings(max_examples=200, deadline=None)
@given(st.lists(EVENT, max_size=30), st.integers(0, 20), st.integers(1, 40))
def test_the_meter_matches_a_brute_force_count(events: list[Any], lo: int, span: int) -> None:
    events = sorted(events, key=lambda e: e[0])  # log order follows time here
    start, end = T0 + lo * H, T0 + (lo + span) * H
    rows = []
    for hour, action, name, tenant, n in events:
        ts = T0 + hour * H
        rows.append(
            place(ts, name, tenant, count=n)
            if action == "place"
            else release(action, ts, name, tenant)
        )
    got = run(rows, start, end)
    # brute force: walk each hour slot, who holds how many GPUs
    expected: dict[str, int] = {}
    for slot in range(lo, lo + span):
        held: dict[tuple[str, str], int] = {}
        for hour, action, name, tenant, n in events:
            if hour > slot:
                break
            if action == "place":
                held[(tenant, name)] = n
            else:
                held.pop((tenant, name), None)
        for (tenant, _name), n in held.items():
            expected[tenant] = expected.get(tenant, 0) + n * US_H
    assert {k.tenant: v for k, v in got.items()} == expected
