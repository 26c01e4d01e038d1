"""meter.anomaly (issue 15, §8): the rules file, business hours in a tenant's time zone, the
EWMA baseline per hour of the week, off-hours spikes, transfer volume and failing controls."""

from __future__ import annotations

import zoneinfo
from datetime import UTC, datetime, time, timedelta
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from proofplane.errors import ValidationFailed
from proofplane.meter import anomaly as an

# Monday 2026-03-02; judged hours are on the hour
MON = datetime(2026, 3, 2, tzinfo=UTC)
WEEK = timedelta(weeks=1)


def rules(**extra: Any) -> an.AlertRules:
    return an.parse_rules(extra, zoneinfo.ZoneInfo)


def history(
    hour: datetime, weeks: int, value: float, *, util: float | None = 0.1, moved: float = 0.0
) -> dict[datetime, an.TenantHour]:
    """The same hour of the week in each of the ``weeks`` weeks before ``hour``."""
    return {
        hour - k * WEEK: an.TenantHour(value + 0.2 * (k % 2), util, moved + 1e7 * (k % 2))
        for k in range(1, weeks + 1)
    }


# --- the rules file -------------------------------------------------------------------------------


def test_the_shipped_file_parses() -> None:
    from importlib import resources

    text = (resources.files("proofplane") / "data" / "alert-rules.yaml").read_text()
    r = an.parse_rules(yaml.safe_load(text), zoneinfo.ZoneInfo)
    assert r.hours_of("st-marys-hospital").contains(MON.replace(hour=3))  # around the clock
    assert not r.hours_of("someone").contains(MON.replace(hour=3))
    assert r.hours_of("berlin-telco").zone == "Europe/Berlin"


@pytest.mark.parametrize(
    "data",
    [
        [],
        "text",
        {"surprise": 1},
        {"business_hours": {"default": {"days": []}}},
        {"business_hours": {"default": {"days": ["funday"]}}},
        {"business_hours": {"default": {"days": "mon"}}},
        {"business_hours": {"default": {"start": "25:00"}}},
        {"business_hours": {"default": {"start": "24:30"}}},
        {"business_hours": {"default": {"start": "18:00", "end": "08:00"}}},
        {"business_hours": {"default": {"timezone": "Mars/Olympus_Mons"}}},
        {"business_hours": {"default": {"timezone": 5}}},
        {"business_hours": {"default": {"colour": "blue"}}},
        {"business_hours": {"tenants": {"a": {"start": "x"}}}},
        {"business_hours": {"tenants": []}},
        {"offhours_spike": {"z": "high"}},
        {"offhours_spike": {"z": float("nan")}},
        {"offhours_spike": {"z": True}},
        {"offhours_spike": {"alpha": 0}},
        {"offhours_spike": {"lookback_weeks": 53}},
        {"offhours_spike": {"nope": 1}},
        {"transfer_volume": {"min_bytes": -1}},
        {"controls": {"sink_down_after_s": 1e12}},
        {"one_shot_hold_s": 1},
        {"forecast_days": 0},
    ],
)
def test_a_malformed_rules_file_is_refused_clearly(data: Any) -> None:
    with pytest.raises(ValidationFailed) as err:
        an.parse_rules(data, zoneinfo.ZoneInfo)
    assert err.value.code == "invalid_alert_rules"


@settings(max_examples=150, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(["business_hours", "default", "tenants", "days", "start",
                                       "end", "timezone", "offhours_spike", "z", "controls",
                                       "one_shot_hold_s", "x"]), inner, max_size=4),
    max_leaves=12,
))  # fmt: skip
def test_any_document_parses_or_is_refused(data: Any) -> None:
    try:
        an.parse_rules(data, zoneinfo.ZoneInfo)
    except ValidationFailed as exc:
        assert exc.code == "invalid_alert_rules"


def test_business_hours_in_the_tenants_zone() -> None:
    r = rules(business_hours={"tenants": {"b": {"start": "09:00", "end": "17:00",
                                                "timezone": "Europe/Berlin"}}})  # fmt: skip
    berlin = r.hours_of("b")
    # 08:30 UTC on a Monday in March is 09:30 in Berlin (UTC+1): business hours there
    assert berlin.contains(MON.replace(hour=8, minute=30))
    assert not berlin.contains(MON.replace(hour=16, minute=30))  # 17:30 Berlin
    assert not berlin.contains(MON + timedelta(days=5, hours=10))  # Saturday
    assert (
        an.hour_of_week(MON.replace(hour=23, minute=30), zoneinfo.ZoneInfo("Europe/Berlin")) == 24
    )
    all_day = rules(business_hours={"default": {"start": "00:00", "end": "24:00"}})
    assert all_day.business_hours.end == time(0) and all_day.business_hours.contains(MON)


def test_ewma() -> None:
    assert an.ewma([], 0.3) == an.Baseline(0.0, 0.0, 0)
    b = an.ewma([2.0, 2.0, 2.0], 0.5)
    assert (b.mean, b.std, b.samples) == (2.0, 0.0, 3)
    b = an.ewma([0.0, 10.0], 0.5)  # mean 5, var (1-0.5)(0 + 10·5) = 25
    assert b.mean == 5.0 and b.std == pytest.approx(5.0)
    assert an.zscore(15.0, b, floor=1.0) == pytest.approx(2.0)
    assert an.zscore(3.0, an.Baseline(2.0, 0.0, 3), floor=0.5) == 2.0


# --- off-hours spikes -----------------------------------------------------------------------------


def test_an_off_hours_spike_against_the_same_hour_of_past_weeks() -> None:
    hour = MON.replace(hour=3)  # Monday 03:00 UTC: off-hours by default
    figures = {"acme": {**history(hour, 4, 1.0), hour: an.TenantHour(9.0, 0.9)}}
    found = an.offhours_spikes(figures, hour, rules())
    assert {f.labels for f in found} == {
        (("tenant", "acme"), ("metric", "allocation")),
        (("tenant", "acme"), ("metric", "utilisation")),
    }
    alloc = next(f for f in found if ("metric", "allocation") in f.labels)
    assert alloc.rule == "offhours_spike" and alloc.subject == "acme"
    assert alloc.evidence["baseline"] == "hour_of_week" and alloc.evidence["z"] >= 3
    assert alloc.evidence["baseline_samples"] == 4 and alloc.evidence["value"] == 9.0
    # the same figures in business hours: nothing
    noon = MON.replace(hour=12)
    figures_noon = {"acme": {**history(noon, 4, 1.0), noon: an.TenantHour(9.0, 0.9)}}
    assert an.offhours_spikes(figures_noon, noon, rules()) == []


def test_usual_night_work_is_no_spike() -> None:
    hour = MON.replace(hour=3)
    figures = {"acme": {**history(hour, 4, 8.0, util=0.8), hour: an.TenantHour(8.2, 0.8)}}
    assert an.offhours_spikes(figures, hour, rules()) == []


def test_below_the_absolute_floors_is_no_spike() -> None:
    hour = MON.replace(hour=3)
    figures = {"acme": {**history(hour, 4, 0.0, util=None), hour: an.TenantHour(0.9, 0.1)}}
    assert an.offhours_spikes(figures, hour, rules()) == []  # < 1 GPU, < 0.2 activity


def test_a_young_tenant_is_judged_on_its_pooled_off_hours_then_not_at_all() -> None:
    hour = MON.replace(hour=3) + 3 * WEEK
    pooled = {hour - timedelta(hours=h): an.TenantHour(0.0, None) for h in range(1, 40)}
    figures = {"young": {**pooled, hour: an.TenantHour(6.0, None)}}
    found = an.offhours_spikes(figures, hour, rules())
    assert len(found) == 1 and found[0].evidence["baseline"] == "pooled"
    # fewer samples than min_samples even pooled: no verdict
    strict = rules(offhours_spike={"min_samples": 1000})
    assert an.offhours_spikes(figures, hour, strict) == []
    # a brand-new tenant (its first figures are this hour) has no past to be unusual against
    assert an.offhours_spikes({"new": {hour: an.TenantHour(6.0, 0.9)}}, hour, rules()) == []


# --- transfer volume ------------------------------------------------------------------------------


def test_transfer_volume_against_the_baseline_any_time_of_day() -> None:
    hour = MON.replace(hour=12)
    normal = history(hour, 4, 1.0, moved=2e9)
    figures = {"acme": {**normal, hour: an.TenantHour(1.0, 0.5, 2e11)}}
    (f,) = an.transfer_spikes(figures, hour, rules())
    assert (f.rule, f.severity, f.subject) == ("transfer_volume", "high", "acme")
    assert f.evidence["bytes"] == 2e11
    quiet = {"acme": {**normal, hour: an.TenantHour(1.0, 0.5, 2.1e9)}}
    assert an.transfer_spikes(quiet, hour, rules()) == []
    small = {"acme": {hour: an.TenantHour(1.0, 0.5, 5e8)}}  # below min_bytes
    assert an.transfer_spikes(small, hour, rules()) == []


# --- critical controls ----------------------------------------------------------------------------


NOW = MON.replace(hour=12)


def sink(name: str = "soc", **kw: Any) -> an.SinkFacts:
    base: dict[str, Any] = {"enabled": True, "consecutive_failures": 3, "lag": 40,
                            "last_error": "connection refused",
                            "last_success_at": NOW - timedelta(minutes=10),
                            "created_at": NOW - timedelta(days=3)}  # fmt: skip
    return an.SinkFacts(name, **{**base, **kw})


def test_a_siem_sink_down_long_enough() -> None:
    (f,) = an.control_failures(an.ControlFacts(sinks=[sink()]), rules(), NOW)
    assert (f.rule, f.severity, f.subject_type, f.subject) == (
        "control_failing", "critical", "sink", "soc",
    )  # fmt: skip
    assert ("control", "siem_sink") in f.labels and f.evidence["lag_events"] == 40
    fine = [
        sink(consecutive_failures=0),
        sink(enabled=False),
        sink(last_success_at=NOW - timedelta(seconds=30)),
    ]
    assert an.control_failures(an.ControlFacts(sinks=fine), rules(), NOW) == []
    never = sink(last_success_at=None, created_at=NOW - timedelta(hours=1))
    assert len(an.control_failures(an.ControlFacts(sinks=[never]), rules(), NOW)) == 1


def test_a_stalled_checkpoint_signer() -> None:
    stalled = an.ControlFacts(log_head=120, checkpoint_size=100,
                              checkpoint_at=NOW - timedelta(hours=2),
                              oldest_unsigned_at=NOW - timedelta(minutes=20))  # fmt: skip
    (f,) = an.control_failures(stalled, rules(), NOW)
    assert f.subject == "audit-checkpoint" and f.evidence["unsigned_for_s"] == 1200
    fresh = an.ControlFacts(log_head=120, checkpoint_size=100,
                            checkpoint_at=NOW - timedelta(hours=2),
                            oldest_unsigned_at=NOW - timedelta(seconds=30))  # fmt: skip
    assert an.control_failures(fresh, rules(), NOW) == []
    signed = an.ControlFacts(log_head=100, checkpoint_size=100,
                             checkpoint_at=NOW - timedelta(days=9))  # fmt: skip
    assert an.control_failures(signed, rules(), NOW) == []  # nothing new to sign


def test_stale_attestation_in_service() -> None:
    facts = an.ControlFacts(
        stale_nodes=[("n1", NOW - timedelta(hours=2)), ("n2", None),
                     ("n3", NOW - timedelta(minutes=16))],
        attest_grace_s=900,
    )  # fmt: skip
    (f,) = an.control_failures(facts, rules(), NOW)
    assert f.subject == "attestation" and f.evidence["nodes"] == 2  # n3 is within the slack
    assert [e["node"] for e in f.evidence["examples"]] == ["n1", "n2"]
