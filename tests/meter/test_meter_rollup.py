"""meter.rollup, meter.health, meter.idle."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proofplane.meter import fields as F
from proofplane.meter.health import assess
from proofplane.meter.idle import judge
from proofplane.meter.rollup import Hourly, Point, hour_of, increases, merge, rollup

T0 = datetime(2026, 5, 1, 10, 0, tzinfo=UTC)
S = timedelta(seconds=15)


def test_gauges_roll_up_per_hour_and_holder():
    pts = [
        Point("n", "G", None, F.POWER_USAGE, T0 + k * S, v, "w", "t")
        for k, v in enumerate([100.0, 300.0, 200.0])
    ] + [Point("n", "G", None, F.POWER_USAGE, T0 + timedelta(hours=1), 50.0, None, None)]
    rows = rollup(pts)
    assert rows == [
        Hourly(T0, "n", "G", None, F.POWER_USAGE, "w", "t", 3, 600.0, 100.0, 300.0, 200.0, False),
        Hourly(T0 + timedelta(hours=1), "n", "G", None, F.POWER_USAGE, None, None, 1, 50.0, 50.0,
               50.0, 50.0, False),
    ]  # fmt: skip


def test_counters_roll_up_by_increase_split_by_share_and_across_resets():
    e = F.TOTAL_ENERGY
    pts = [
        # a MIG GPU: two holders (3/7 and 1/7) and the unheld 3/7, one reading each time
        *(Point("n", "G", None, e, T0, 1000.0, w, t, sh, True)
          for w, t, sh in (("a", "ta", 3 / 7), ("b", "tb", 1 / 7), (None, None, 3 / 7))),
        *(Point("n", "G", None, e, T0 + S, 1700.0, w, t, sh)
          for w, t, sh in (("a", "ta", 3 / 7), ("b", "tb", 1 / 7), (None, None, 3 / 7))),
        Point("n", "G", None, e, T0 + 2 * S, 200.0, "a", "ta", 1.0),  # driver reloaded
    ]  # fmt: skip
    rows = {(r.workload): r for r in rollup(pts, {("G", None, e): 300.0})}
    # increases: 700 at T0 (from the previous 300), 700 at T0+S, 200 after the reset
    assert rows["a"].sum == pytest.approx(1400 * 3 / 7 + 200)
    assert rows["b"].sum == pytest.approx(1400 / 7)
    assert rows[None].sum == pytest.approx(1400 * 3 / 7)
    assert sum(r.sum for r in rows.values()) == pytest.approx(1600)
    assert (rows["a"].min, rows["a"].max, rows["a"].last, rows["a"].count) == (200, 1700, 200, 3)
    assert rows["a"].simulated and rows[None].simulated  # any simulated reading marks the row
    # without a previous reading the first one adds nothing
    assert sum(r.sum for r in rollup(pts)) == pytest.approx(900)


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=30), st.integers(1, 29))
def test_rollup_splits_like_one_pass(values, cut):
    """Rolling up two halves and merging equals rolling up the whole (the worker rolls hour
    by hour; the readers add the live hour)."""
    pts = [Point("n", "G", None, F.TOTAL_ENERGY, T0 + k * S, v) for k, v in enumerate(values)]
    whole = rollup(pts)
    cut = min(cut, len(pts) - 1) or 1
    first = rollup(pts[:cut])
    second = rollup(pts[cut:], {("G", None, F.TOTAL_ENERGY): pts[cut - 1].value})
    if not second:
        assert first == whole
        return
    merged = merge(first[0], second[0])
    assert merged.count == whole[0].count and merged.last == whole[0].last
    assert merged.sum == pytest.approx(whole[0].sum)


def test_increases_skip_gauges_and_hour_of():
    assert increases([Point("n", "G", None, F.GPU_TEMP, T0, 1.0)]) == []
    assert hour_of(T0 + timedelta(minutes=59, seconds=59)) == T0


@pytest.mark.parametrize(
    ("field", "value", "previous", "cause", "scope", "lost"),
    [
        (F.XID_ERRORS, 79, None, "xid", "node", True),
        (F.XID_ERRORS, 48, 0, "xid", "device", True),
        (F.XID_ERRORS, 63, 13, "xid", "device", False),
        (F.XID_ERRORS, 48, 48, None, None, None),  # the exporter repeats the last XID
        (F.XID_ERRORS, 13, 0, None, None, None),  # an application's fault
        (F.XID_ERRORS, 0, 48, None, None, None),
        (F.XID_ERRORS, 9999, 0, None, None, None),  # unknown: not in the table, not fatal
        (F.ECC_DBE_VOL_TOTAL, 1, 0, "ecc_dbe", "device", True),
        (F.ECC_DBE_VOL_TOTAL, 2, None, "ecc_dbe", "device", True),
        (F.ECC_DBE_VOL_TOTAL, 2, 2, None, None, None),
        (F.ECC_DBE_VOL_TOTAL, 0, None, None, None, None),
        (F.ROW_REMAP_FAILURE, 1, 0, "row_remap_failure", "device", False),
        (F.ROW_REMAP_FAILURE, 1, 1, None, None, None),
        (F.GPU_TEMP, 91, 80, "thermal", "device", False),
        (F.GPU_TEMP, 92, 91, None, None, None),
        (F.GPU_TEMP, 60, None, None, None, None),
        (F.POWER_USAGE, 700, None, None, None, None),
    ],
)
def test_health_assess(field, value, previous, cause, scope, lost):
    f = assess(field, value, previous)
    if cause is None:
        assert f is None
        return
    assert f is not None and (f.cause, f.scope, f.device_lost) == (cause, scope, lost)
    assert f.message
    if cause == "xid":
        assert f.xid == value and f"XID {value}" in f.message


def test_idle_judge():
    now = T0 + timedelta(hours=2)
    held = T0
    low = [(now - timedelta(minutes=m), 0.01) for m in range(0, 31)]
    v = judge(low, now=now, held_since=held)
    assert v.idle and v.peak == 0.01 and v.readings == 31
    assert not judge([*low, (now - timedelta(minutes=5), 0.2)], now=now, held_since=held).idle
    assert not judge(low, now=now, held_since=now - timedelta(minutes=10)).idle  # too recent
    assert judge([], now=now, held_since=held).why == "no readings in the window"
    # a silent agent for the first half of the window is no idleness
    late = [(ts, v) for ts, v in low if ts > now - timedelta(minutes=15)]
    assert not judge(late, now=now, held_since=held).idle
    stale = [(ts, v) for ts, v in low if ts < now - timedelta(minutes=10)]
    assert not judge(stale, now=now, held_since=held).idle
    # custom window and threshold
    assert judge(low, now=now, held_since=held, threshold=0.005).idle is False
    assert judge(low, now=now, held_since=held, window=timedelta(minutes=10)).idle
