"""Segment pools: lowest free, cool-down, exhaustion, manual assignment, pool syntax."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proofplane.network.segments import (
    DEFAULT_COOLDOWN,
    DEFAULT_PKEY,
    PKEY_POOL,
    VNI_POOL,
    InvalidSegment,
    Pool,
    SegmentInUse,
    SegmentPoolExhausted,
    check_manual,
    format_pkey,
    next_free,
    parse_pool,
)

NOW = datetime(2025, 6, 1, tzinfo=UTC)


def test_pools_by_default() -> None:
    assert VNI_POOL == (10_000, 16_000_000)
    assert PKEY_POOL == (0x0001, 0x7FFE)
    assert DEFAULT_PKEY not in PKEY_POOL
    assert timedelta(days=30) == DEFAULT_COOLDOWN
    assert format_pkey(0x12) == "0x0012"


@pytest.mark.parametrize(
    ("text", "kind", "want"),
    [
        ("10000-16000000", "vni", (10_000, 16_000_000)),
        (" 1 - 16777215 ", "vni", (1, 16_777_215)),
        ("0x0001-0x7ffe", "pkey", (1, 0x7FFE)),
        ("5-5", "vni", (5, 5)),
    ],
)
def test_parse_pool(text: str, kind: str, want: tuple[int, int]) -> None:
    pool = parse_pool(text, kind=kind)  # type: ignore[arg-type]
    assert pool == want and isinstance(pool, Pool)
    lo, hi = pool
    assert pool.size == hi - lo + 1 and lo in pool and hi + 1 not in pool


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("10000", "vni"),  # no range
        ("a-b", "vni"),
        ("0-100", "vni"),  # VNI 0 is not used
        ("1-16777216", "vni"),  # beyond 24 bits
        ("200-100", "vni"),  # LO > HI
        ("1-0x7fff", "pkey"),  # the default partition is never in a pool
        ("0-10", "pkey"),
        ("", "vni"),
    ],
)
def test_parse_pool_refuses(text: str, kind: str) -> None:
    with pytest.raises(InvalidSegment) as err:
        parse_pool(text, kind=kind)  # type: ignore[arg-type]
    assert err.value.code == "invalid_segment"


def test_next_free_lowest_skipping_used_and_cooling() -> None:
    cooling = {12: NOW - timedelta(days=1), 14: NOW - timedelta(days=31)}
    assert next_free(10, 20, {10, 11, 13}, cooling, NOW) == 14  # 12 cools, 14 has cooled
    assert next_free(10, 20, set(), {}, NOW) == 10
    # the cool-down boundary: released exactly `cooldown` ago is free again
    assert next_free(10, 20, set(), {10: NOW - DEFAULT_COOLDOWN}, NOW) == 10
    assert next_free(10, 20, set(), {10: NOW - DEFAULT_COOLDOWN + timedelta(seconds=1)}, NOW) == 11
    # ids outside the pool do not matter
    assert next_free(10, 20, {1, 2, 30}, {5: NOW}, NOW) == 10
    assert next_free(10, 20, set(), {10: NOW}, NOW, timedelta(0)) == 10


def test_next_free_exhausted_is_a_409() -> None:
    with pytest.raises(SegmentPoolExhausted) as err:
        next_free(1, 3, {1, 3}, {2: NOW - timedelta(hours=1)}, NOW, kind="pkey")
    assert err.value.code == "segment_pool_exhausted"
    assert err.value.details["blocked"] == 3


def test_next_free_is_fast_on_a_huge_pool() -> None:
    in_use = set(range(10_000, 60_000))
    assert next_free(*VNI_POOL, in_use, {}, NOW) == 60_000


@given(
    st.integers(0, 40),
    st.integers(0, 40),
    st.sets(st.integers(0, 50)),
    st.dictionaries(st.integers(0, 50), st.integers(0, 60)),
)
def test_next_free_is_the_minimum_allowed(
    lo: int, span: int, in_use: set[int], released_days_ago: dict[int, int]
) -> None:
    hi = lo + span
    cooling = {i: NOW - timedelta(days=d) for i, d in released_days_ago.items()}
    allowed = [
        i
        for i in range(lo, hi + 1)
        if i not in in_use and (i not in cooling or NOW - cooling[i] >= DEFAULT_COOLDOWN)
    ]
    if allowed:
        assert next_free(lo, hi, in_use, cooling, NOW) == allowed[0]
    else:
        with pytest.raises(SegmentPoolExhausted):
            next_free(lo, hi, in_use, cooling, NOW)


def test_check_manual() -> None:
    assert check_manual(12_345, *VNI_POOL, {10_000}, {}, NOW) == 12_345
    cases = [
        (9_999, set(), {}, InvalidSegment, "invalid_segment", 422),  # below the pool
        (16_000_001, set(), {}, InvalidSegment, "invalid_segment", 422),  # above it
        (True, set(), {}, InvalidSegment, "invalid_segment", 422),  # not a number
        (12_345, {12_345}, {}, SegmentInUse, "segment_in_use", 409),  # overlapping
        (12_345, set(), {12_345: NOW - timedelta(days=3)}, SegmentInUse, "segment_in_use", 409),
    ]
    for value, in_use, cooling, cls, code, _status in cases:
        with pytest.raises(cls) as err:
            check_manual(value, *VNI_POOL, in_use, cooling, NOW)  # type: ignore[arg-type]
        assert err.value.code == code, value
    # cooled down long enough: fine
    assert check_manual(12_345, *VNI_POOL, set(), {12_345: NOW - timedelta(days=30)}, NOW)
    with pytest.raises(InvalidSegment):
        check_manual(0x7FFF, 1, 0x7FFF, set(), {}, NOW, kind="pkey")


def test_negative_cooldown_is_refused() -> None:
    with pytest.raises(InvalidSegment):
        next_free(1, 5, set(), {}, NOW, timedelta(days=-1))
