"""Rate cards: what a GPU-hour costs, per SKU and MIG profile, in one currency, over validity
periods (pure: the caller reads the file and passes its parsed YAML/JSON).

A rate card is data the operator edits (the shipped default is ``data/rate-card.yaml``)::

    version: 1
    name: example list prices
    currency: USD          # ISO 4217
    minor_unit: 2          # digits after the decimal point of the currency (JPY: 0)
    periods:
      - valid_from: "2026-01-01T00:00:00Z"
        valid_to: "2026-07-01T00:00:00Z"   # exclusive; null: open-ended
        discount: "0.10"                    # optional negotiated discount off list, 0 <= d < 1
        skus:
          H100-80GB:
            gpu_hour: "2.50"                # per whole-GPU hour (and per GPU-equivalent hour)
            mig: {3g.40gb: "1.10"}          # optional: per MIG instance-hour of a profile

Prices are decimals (write them as strings: ``"2.50"``; a YAML number is read through its text,
so ``2.5`` is 2.5 exactly too). A MIG profile without its own price costs the GPU-hour price
times its compute-slice fraction (``3g.40gb`` on an H100: 3/7). Periods may not overlap; a
report must fall inside the periods (a gap is an error, never a silent zero).

Every problem is reported at once, each with its place in the file (``periods[0].skus.H100``),
as one ``ValidationFailed`` with code ``invalid_rate_card``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from proofplane.errors import ValidationFailed
from proofplane.hardware.skus import ALIASES, SKUS

CARD_VERSION = 1
MAX_PRICE_DECIMALS = 10
_CURRENCY = re.compile(r"[A-Z]{3}")
_TOP_KEYS = frozenset({"version", "name", "currency", "minor_unit", "periods"})
_PERIOD_KEYS = frozenset({"valid_from", "valid_to", "discount", "skus"})
_SKU_KEYS = frozenset({"gpu_hour", "mig"})


@dataclass(frozen=True, slots=True)
class SkuRate:
    """The list prices of one SKU: a whole-GPU hour, and optionally a MIG instance-hour per
    profile."""

    gpu_hour: Decimal
    mig: Mapping[str, Decimal]


@dataclass(frozen=True, slots=True)
class RatePeriod:
    valid_from: datetime
    valid_to: datetime | None  # exclusive; None: open-ended
    discount: Decimal
    skus: Mapping[str, SkuRate]

    def covers(self, ts: datetime) -> bool:
        return self.valid_from <= ts and (self.valid_to is None or ts < self.valid_to)


@dataclass(frozen=True, slots=True)
class RateCard:
    name: str
    currency: str
    minor_unit: int
    periods: tuple[RatePeriod, ...]  # sorted by valid_from, not overlapping
    digest: str  # sha256 of the card's canonical JSON: names the prices a report used

    @property
    def quantum(self) -> Decimal:
        """The smallest amount of the currency (0.01 for USD): costs are rounded to it."""
        return Decimal(1).scaleb(-self.minor_unit)


def _invalid(problems: list[str], source: str) -> ValidationFailed:
    head = problems[0] if len(problems) == 1 else f"{len(problems)} problems, first: {problems[0]}"
    return ValidationFailed(
        f"rate card {source}: {head}",
        code="invalid_rate_card",
        details={"source": source, "problems": problems},
    )


def parse_price(value: object, where: str, problems: list[str]) -> Decimal | None:
    """A non-negative decimal from a string or a YAML/JSON number (read through its text)."""
    if isinstance(value, bool) or not isinstance(value, str | int | float | Decimal):
        problems.append(f'{where}: a price is a decimal string such as "2.50", not {value!r}')
        return None
    try:
        price = Decimal(str(value).strip())
    except InvalidOperation:
        problems.append(f"{where}: {value!r} is not a decimal number")
        return None
    if not price.is_finite() or price < 0:
        problems.append(f"{where}: {value!r} must be a finite number >= 0")
        return None
    exponent = price.as_tuple().exponent
    if isinstance(exponent, int) and -exponent > MAX_PRICE_DECIMALS:
        problems.append(f"{where}: {value!r} has more than {MAX_PRICE_DECIMALS} decimals")
        return None
    return price


def parse_time(value: object, where: str, problems: list[str]) -> datetime | None:
    """An ISO 8601 time with its zone (YAML may hand a datetime already)."""
    if isinstance(value, datetime):
        ts = value
    elif isinstance(value, str):
        try:
            ts = datetime.fromisoformat(value.strip())
        except ValueError:
            problems.append(f"{where}: {value!r} is not an ISO 8601 time (2026-01-01T00:00:00Z)")
            return None
    else:
        problems.append(f"{where}: a time is an ISO 8601 string, not {value!r}")
        return None
    if ts.tzinfo is None:
        problems.append(f"{where}: {value!r} has no time zone (add Z for UTC)")
        return None
    return ts.astimezone(UTC)


def _unknown_keys(data: Mapping[Any, Any], allowed: frozenset[str], where: str) -> list[str]:
    return [
        f"{where}{'.' if where else ''}{k}: unknown key (allowed: {', '.join(sorted(allowed))})"
        for k in data
        if k not in allowed
    ]


def _parse_sku(name: str, data: object, where: str, problems: list[str]) -> SkuRate | None:
    if not isinstance(data, Mapping):
        problems.append(f"{where}: a mapping with gpu_hour (and optional mig), not {data!r}")
        return None
    problems.extend(_unknown_keys(data, _SKU_KEYS, where))
    if "gpu_hour" not in data:
        problems.append(f"{where}.gpu_hour: missing")
        return None
    gpu_hour = parse_price(data["gpu_hour"], f"{where}.gpu_hour", problems)
    mig: dict[str, Decimal] = {}
    raw_mig = data.get("mig") or {}
    if not isinstance(raw_mig, Mapping):
        problems.append(f"{where}.mig: a mapping of MIG profile to price, not {raw_mig!r}")
        raw_mig = {}
    sku = SKUS[name]
    for profile, value in raw_mig.items():
        if not isinstance(profile, str) or sku.profile(profile) is None:
            known = ", ".join(p.name for p in sku.mig_profiles)
            problems.append(f"{where}.mig.{profile}: not a MIG profile of {name} ({known})")
            continue
        price = parse_price(value, f"{where}.mig.{profile}", problems)
        if price is not None:
            mig[profile] = price
    if gpu_hour is None:
        return None
    return SkuRate(gpu_hour, dict(sorted(mig.items())))


def _parse_period(data: object, where: str, problems: list[str]) -> RatePeriod | None:
    if not isinstance(data, Mapping):
        problems.append(f"{where}: a mapping with valid_from, valid_to and skus, not {data!r}")
        return None
    problems.extend(_unknown_keys(data, _PERIOD_KEYS, where))
    start = None
    if "valid_from" in data:
        start = parse_time(data["valid_from"], f"{where}.valid_from", problems)
    else:
        problems.append(f"{where}.valid_from: missing")
    end = None
    if data.get("valid_to") is not None:
        end = parse_time(data["valid_to"], f"{where}.valid_to", problems)
    discount = Decimal(0)
    if data.get("discount") is not None:
        d = parse_price(data["discount"], f"{where}.discount", problems)
        if d is not None and d >= 1:
            problems.append(f"{where}.discount: {d} must be below 1 (a fraction: 0.10 is 10%)")
        elif d is not None:
            discount = d
    raw_skus = data.get("skus")
    skus: dict[str, SkuRate] = {}
    if not isinstance(raw_skus, Mapping) or not raw_skus:
        problems.append(f"{where}.skus: a non-empty mapping of GPU SKU to prices")
    else:
        for raw_name, value in raw_skus.items():
            name = ALIASES.get(raw_name, raw_name) if isinstance(raw_name, str) else raw_name
            if name not in SKUS:
                problems.append(
                    f"{where}.skus.{raw_name}: unknown GPU SKU (known: {', '.join(sorted(SKUS))})"
                )
                continue
            if name in skus:
                problems.append(f"{where}.skus.{raw_name}: {name} is priced twice")
                continue
            rate = _parse_sku(name, value, f"{where}.skus.{raw_name}", problems)
            if rate is not None:
                skus[name] = rate
    if start is None:
        return None
    if end is not None and end <= start:
        problems.append(f"{where}: valid_to {end.isoformat()} is not after valid_from")
        return None
    return RatePeriod(start, end, discount, dict(sorted(skus.items())))


def parse_rate_card(data: object, *, source: str = "rate card") -> RateCard:
    """Validate a parsed rate card (see the module docstring). ``source`` names the file in
    the error messages. Raises ``ValidationFailed`` (code ``invalid_rate_card``) listing every
    problem."""
    problems: list[str] = []
    if not isinstance(data, Mapping):
        problem = f"the card is a mapping (version, currency, periods), not {data!r}"
        raise _invalid([problem], source)
    problems.extend(_unknown_keys(data, _TOP_KEYS, ""))
    version = data.get("version")
    if version != CARD_VERSION or isinstance(version, bool):
        problems.append(f"version: {version!r}, this proofplane reads version {CARD_VERSION}")
    name = data.get("name", "")
    if not isinstance(name, str) or len(name) > 200:
        problems.append("name: a string of at most 200 characters")
        name = ""
    currency = data.get("currency")
    if not isinstance(currency, str) or not _CURRENCY.fullmatch(currency):
        problems.append(f"currency: {currency!r} is not an ISO 4217 code (three capitals: USD)")
        currency = "XXX"
    minor_unit = data.get("minor_unit", 2)
    if isinstance(minor_unit, bool) or not isinstance(minor_unit, int) or not 0 <= minor_unit <= 4:
        problems.append(f"minor_unit: {minor_unit!r} is not a number of decimals from 0 to 4")
        minor_unit = 2
    raw_periods = data.get("periods")
    periods: list[RatePeriod] = []
    if not isinstance(raw_periods, list) or not raw_periods:
        problems.append("periods: a non-empty list of validity periods")
    else:
        for i, raw in enumerate(raw_periods):
            p = _parse_period(raw, f"periods[{i}]", problems)
            if p is not None:
                periods.append(p)
    periods.sort(key=lambda p: p.valid_from)
    for a, b in zip(periods, periods[1:], strict=False):
        if a.valid_to is None or a.valid_to > b.valid_from:
            problems.append(
                f"periods: the period from {a.valid_from.isoformat()} overlaps the one from "
                f"{b.valid_from.isoformat()}"
            )
    if problems:
        raise _invalid(problems, source)
    card = RateCard(name, currency, minor_unit, tuple(periods), "")
    return RateCard(name, currency, minor_unit, tuple(periods), card_digest(card))


def card_json(card: RateCard) -> dict[str, Any]:
    """The card as plain JSON values (prices as strings): what its digest is taken over."""
    return {
        "version": CARD_VERSION,
        "name": card.name,
        "currency": card.currency,
        "minor_unit": card.minor_unit,
        "periods": [
            {
                "valid_from": p.valid_from.isoformat(),
                "valid_to": p.valid_to.isoformat() if p.valid_to else None,
                "discount": str(p.discount),
                "skus": {
                    name: {
                        "gpu_hour": str(r.gpu_hour),
                        "mig": {k: str(v) for k, v in r.mig.items()},
                    }
                    for name, r in p.skus.items()
                },
            }
            for p in card.periods
        ],
    }


def card_digest(card: RateCard) -> str:
    text = json.dumps(card_json(card), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Segment:
    """The part [start, end) of a report window one rate period prices."""

    period: RatePeriod
    start: datetime
    end: datetime


def segments(card: RateCard, start: datetime, end: datetime) -> list[Segment]:
    """The rate periods that price [start, end), cut to it, in order. A moment of the window
    no period covers is an error (``rate_card_gap``): usage is never priced at zero silently."""
    out: list[Segment] = []
    cursor = start
    for p in card.periods:
        if cursor >= end:
            break
        if p.valid_to is not None and p.valid_to <= cursor:
            continue
        if p.valid_from > cursor:
            break
        seg_end = end if p.valid_to is None else min(end, p.valid_to)
        out.append(Segment(p, cursor, seg_end))
        cursor = seg_end
    if cursor < end:
        raise ValidationFailed(
            f"rate card {card.name or card.digest[:12]!r} prices nothing from "
            f"{cursor.isoformat()}: its periods must cover the whole report window",
            code="rate_card_gap",
            details={"uncovered_from": cursor.isoformat(), "window_end": end.isoformat()},
        )
    return out
