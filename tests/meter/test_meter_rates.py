"""Rate cards (meter.rates): a valid card, every kind of malformed one, and the segments of a
report window."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

from proofplane.errors import ValidationFailed
from proofplane.meter.rates import parse_rate_card, segments

T0 = datetime(2026, 1, 1, tzinfo=UTC)
T1 = datetime(2026, 2, 1, tzinfo=UTC)
T2 = datetime(2026, 3, 1, tzinfo=UTC)

CARD: dict[str, Any] = {
    "version": 1,
    "name": "test",
    "currency": "EUR",
    "periods": [
        {
            "valid_from": "2026-01-01T00:00:00Z",
            "valid_to": "2026-02-01T00:00:00Z",
            "skus": {"H100": {"gpu_hour": "2.40", "mig": {"3g.40gb": "1.10"}}},
        },
        {
            "valid_from": "2026-02-01T00:00:00+00:00",
            "valid_to": None,
            "discount": "0.10",
            "skus": {"H100-80GB": {"gpu_hour": 3}, "A100-40GB": {"gpu_hour": 1.1}},
        },
    ],
}


def card_with(**changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(CARD)
    data.update(changes)
    return data


def problems(data: Any) -> list[str]:
    with pytest.raises(ValidationFailed) as info:
        parse_rate_card(data, source="card.yaml")
    assert info.value.code == "invalid_rate_card"
    assert info.value.message.startswith("rate card card.yaml: ")
    return info.value.details["problems"]


def test_a_valid_card() -> None:
    card = parse_rate_card(CARD)
    assert card.currency == "EUR" and card.minor_unit == 2 and card.quantum == Decimal("0.01")
    first, second = card.periods
    assert first.valid_from == T0 and first.valid_to == T1 and first.discount == 0
    # an alias is the canonical SKU; prices are exact decimals, numbers read through their text
    assert first.skus["H100-80GB"].gpu_hour == Decimal("2.40")
    assert first.skus["H100-80GB"].mig == {"3g.40gb": Decimal("1.10")}
    assert second.valid_to is None and second.discount == Decimal("0.10")
    assert second.skus["A100-40GB"].gpu_hour == Decimal("1.1")
    assert len(card.digest) == 64
    assert parse_rate_card(copy.deepcopy(CARD)).digest == card.digest
    changed = card_with(name="other")
    assert parse_rate_card(changed).digest != card.digest


def test_the_shipped_card_is_valid() -> None:
    from proofplane.service.usage import load_rate_card

    card = load_rate_card()
    assert card.currency == "USD"
    assert {"H100-80GB", "A100-40GB", "B200-180GB"} <= set(card.periods[0].skus)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ("not a mapping", "the card is a mapping"),
        (card_with(version=2), "version: 2"),
        (card_with(version=True), "version: True"),
        (card_with(currency="usd"), "currency: 'usd' is not an ISO 4217 code"),
        (card_with(minor_unit=7), "minor_unit: 7"),
        (card_with(periods=[]), "periods: a non-empty list"),
        (card_with(extra=1), "extra: unknown key"),
        (card_with(name=5), "name: a string"),
    ],
)
def test_top_level_problems(data: Any, expected: str) -> None:
    assert any(expected in p for p in problems(data)), problems(data)


def period(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "valid_from": "2026-01-01T00:00:00Z",
        "skus": {"H100-80GB": {"gpu_hour": "2.40"}},
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v != "DROP"}


@pytest.mark.parametrize(
    ("p", "expected"),
    [
        (period(valid_from="DROP"), "periods[0].valid_from: missing"),
        (period(valid_from="yesterday"), "is not an ISO 8601 time"),
        (period(valid_from="2026-01-01T00:00:00"), "has no time zone"),
        (period(valid_to="2025-01-01T00:00:00Z"), "is not after valid_from"),
        (period(discount="1"), "must be below 1"),
        (period(discount="-0.1"), "must be a finite number >= 0"),
        (period(skus={}), "skus: a non-empty mapping"),
        (period(skus={"GTX1080": {"gpu_hour": "1"}}), "GTX1080: unknown GPU SKU"),
        (period(skus={"H100-80GB": {}}), "gpu_hour: missing"),
        (period(skus={"H100-80GB": "2.40"}), "a mapping with gpu_hour"),
        (period(skus={"H100-80GB": {"gpu_hour": "two"}}), "'two' is not a decimal number"),
        (period(skus={"H100-80GB": {"gpu_hour": "NaN"}}), "must be a finite number"),
        (period(skus={"H100-80GB": {"gpu_hour": "-1"}}), "must be a finite number >= 0"),
        (period(skus={"H100-80GB": {"gpu_hour": True}}), "a price is a decimal string"),
        (period(skus={"H100-80GB": {"gpu_hour": [1]}}), "a price is a decimal string"),
        (period(skus={"H100-80GB": {"gpu_hour": "0.00000000001"}}), "more than 10 decimals"),
        (period(skus={"H100-80GB": {"gpu_hour": "1", "mig": {"9g.99gb": "1"}}}), "9g.99gb"),
        (period(skus={"H100-80GB": {"gpu_hour": "1", "mig": "cheap"}}), "mig: a mapping"),
        (period(skus={"H100-80GB": {"gpu_hour": "1", "gpu_minute": "1"}}), "unknown key"),
        (period(skus={"H100": {"gpu_hour": "1"}, "H100-80GB": {"gpu_hour": "2"}}), "twice"),
        ("a period", "periods[0]: a mapping"),
    ],
)
def test_period_problems(p: Any, expected: str) -> None:
    found = problems(card_with(periods=[p]))
    assert any(expected in x for x in found), found


def test_every_problem_is_listed_at_once() -> None:
    found = problems(
        card_with(currency="dollars", periods=[period(valid_from="soon", discount="2")])
    )
    assert len(found) == 3, found


def test_overlapping_periods_are_refused() -> None:
    found = problems(
        card_with(
            periods=[
                period(valid_to="2026-03-01T00:00:00Z"),
                period(valid_from="2026-02-01T00:00:00Z"),
            ]
        )
    )
    assert any("overlaps" in x for x in found)
    found = problems(card_with(periods=[period(), period(valid_from="2026-02-01T00:00:00Z")]))
    assert any("overlaps" in x for x in found)  # an open-ended period overlaps what follows


def test_segments_cut_the_window_at_period_boundaries() -> None:
    card = parse_rate_card(CARD)
    segs = segments(card, datetime(2026, 1, 15, tzinfo=UTC), datetime(2026, 2, 15, tzinfo=UTC))
    assert [(s.start.day, s.end.day, s.period.discount) for s in segs] == [
        (15, 1, Decimal(0)),
        (1, 15, Decimal("0.10")),
    ]
    assert segments(card, T0, T1)[0].end == T1 and len(segments(card, T0, T1)) == 1


def test_a_window_the_card_does_not_cover_is_an_error() -> None:
    card = parse_rate_card(card_with(periods=[period(valid_to="2026-02-01T00:00:00Z")]))
    with pytest.raises(ValidationFailed) as info:
        segments(card, T0, T2)
    assert info.value.code == "rate_card_gap"
    assert info.value.details["uncovered_from"].startswith("2026-02-01")
    with pytest.raises(ValidationFailed):
        segments(card, datetime(2025, 12, 1, tzinfo=UTC), T1)  # before the first period
    gap = parse_rate_card(
        card_with(
            periods=[
                period(valid_to="2026-01-10T00:00:00Z"),
                period(valid_from="2026-01-20T00:00:00Z"),
            ]
        )
    )
    with pytest.raises(ValidationFailed) as info:
        segments(gap, T0, T1)
    assert info.value.details["uncovered_from"].startswith("2026-01-10")
