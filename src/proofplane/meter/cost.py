"""The cost model (issue 15, §6; seed 001): what an *effective* GPU-hour costs on this
bare-metal fleet against a virtualised/cloud alternative (pure: the caller passes the parsed
model file and the facts it measured).

Per SKU, over a window of ``hours``::

    capacity GPU-hours   = GPUs owned × hours
    amortisation         = capex per GPU × GPUs × hours / (amortisation years × 8760)
    power                = metered kWh × PUE × price per kWh
                           (no metered energy: GPUs × hours × assumed W / 1000 × PUE × price)
    operations           = ops per GPU-month × GPUs × hours / 730
    effective GPU-hours  = allocated GPU-hours (the log) × mean activity (telemetry's
                           DCGM_FI_PROF_GR_ENGINE_ACTIVE over the held devices; 1 when unmetered)
    bare metal / eff. h  = (amortisation + power + operations) / effective GPU-hours
    cloud GPU-hour       = instance price per hour / GPUs per instance
    cloud paid GPU-hours = allocated GPU-hours (billing "allocated": elastic, pay for what
                           tenants held) or capacity GPU-hours (billing "capacity": reserve the
                           fleet), divided by (1 - hypervisor overhead)
    cloud / eff. h       = cloud GPU-hour × cloud paid GPU-hours / effective GPU-hours

The model file (the shipped ``data/cost-model.yaml`` holds illustrative numbers to replace)::

    version: 1
    name: my fleet
    currency: USD
    power: {price_per_kwh: "0.12", pue: "1.3"}
    bare_metal:
      H100-80GB: {capex_per_gpu: "30000", amortisation_years: 4, ops_per_gpu_month: "120",
                  assumed_watts: 700}
    cloud:
      hypervisor_overhead: "0.05"
      billing: allocated
      instances:
        H100-80GB: {instance: "8x H100 on-demand", gpus: 8, hourly: "55.04"}
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from fractions import Fraction
from typing import Any

from proofplane.errors import ValidationFailed
from proofplane.hardware.skus import ALIASES, SKUS
from proofplane.meter.rates import parse_price
from proofplane.meter.usage import fmt_time, round_fraction

MODEL_VERSION = 1
HOURS_PER_YEAR = 8760
HOURS_PER_MONTH = 730
MONEY_PER_HOUR_PLACES = 4
_CURRENCY = re.compile(r"[A-Z]{3}")
BILLING = ("allocated", "capacity")


@dataclass(frozen=True, slots=True)
class BareMetal:
    capex_per_gpu: Decimal
    amortisation_years: Decimal
    ops_per_gpu_month: Decimal
    assumed_watts: Decimal


@dataclass(frozen=True, slots=True)
class CloudInstance:
    instance: str
    gpus: int
    hourly: Decimal


@dataclass(frozen=True, slots=True)
class CostModel:
    name: str
    currency: str
    price_per_kwh: Decimal
    pue: Decimal
    bare_metal: Mapping[str, BareMetal]
    hypervisor_overhead: Decimal
    billing: str
    cloud: Mapping[str, CloudInstance]
    digest: str


@dataclass(frozen=True, slots=True)
class SkuFacts:
    """What was measured for one SKU over the window."""

    sku: str
    gpus: int  # GPUs owned (nodes not decommissioned)
    hours: Fraction  # the window's length
    allocated_gpu_hours: Fraction  # GPU-equivalent hours tenants held (the audit log)
    energy_kwh: Fraction | None  # metered; None: no telemetry
    mean_activity: Fraction | None  # metered mean over held device-hours; None: unmetered


def _keys(data: Mapping[Any, Any], allowed: set[str], where: str, problems: list[str]) -> None:
    for k in data:
        if k not in allowed:
            problems.append(f"{where}{k}: unknown key (allowed: {', '.join(sorted(allowed))})")


def _num(
    data: Mapping[Any, Any], key: str, where: str, problems: list[str], *, positive: bool = False
) -> Decimal:
    if key not in data:
        problems.append(f"{where}{key}: missing")
        return Decimal(0)
    value = parse_price(data[key], f"{where}{key}", problems)
    if value is None:
        return Decimal(0)
    if positive and value <= 0:
        problems.append(f"{where}{key}: must be above 0")
    return value


def _sku_name(raw: object, where: str, problems: list[str]) -> str | None:
    name = ALIASES.get(raw, raw) if isinstance(raw, str) else raw
    if not isinstance(name, str) or name not in SKUS:
        problems.append(f"{where}{raw}: unknown GPU SKU (known: {', '.join(sorted(SKUS))})")
        return None
    return name


def parse_cost_model(data: object, *, source: str = "cost model") -> CostModel:
    """Validate a parsed cost model (module docstring); every problem is listed at once in one
    ``ValidationFailed`` (code ``invalid_cost_model``)."""
    problems: list[str] = []
    if not isinstance(data, Mapping):
        data = {}
        problems.append("the model is a mapping (version, currency, power, bare_metal, cloud)")
    _keys(data, {"version", "name", "currency", "power", "bare_metal", "cloud"}, "", problems)
    if data.get("version") != MODEL_VERSION or isinstance(data.get("version"), bool):
        problems.append(f"version: {data.get('version')!r}, this proofplane reads {MODEL_VERSION}")
    name = data.get("name", "")
    if not isinstance(name, str):
        problems.append("name: a string")
        name = ""
    currency = data.get("currency")
    if not isinstance(currency, str) or not _CURRENCY.fullmatch(currency):
        problems.append(f"currency: {currency!r} is not an ISO 4217 code (USD)")
        currency = "XXX"
    power = data.get("power")
    if not isinstance(power, Mapping):
        problems.append("power: a mapping with price_per_kwh and pue")
        power = {}
    _keys(power, {"price_per_kwh", "pue"}, "power.", problems)
    kwh_price = _num(power, "price_per_kwh", "power.", problems)
    pue = _num(power, "pue", "power.", problems)
    if "pue" in power and pue < 1:
        problems.append("power.pue: a power usage effectiveness is at least 1")
    bare: dict[str, BareMetal] = {}
    raw_bare = data.get("bare_metal")
    if not isinstance(raw_bare, Mapping) or not raw_bare:
        problems.append("bare_metal: a non-empty mapping of GPU SKU to its costs")
        raw_bare = {}
    for raw, entry in raw_bare.items():
        sku = _sku_name(raw, "bare_metal.", problems)
        where = f"bare_metal.{raw}."
        if not isinstance(entry, Mapping):
            problems.append(f"{where[:-1]}: a mapping (capex_per_gpu, amortisation_years, …)")
            continue
        allowed = {"capex_per_gpu", "amortisation_years", "ops_per_gpu_month", "assumed_watts"}
        _keys(entry, allowed, where, problems)
        values = BareMetal(
            _num(entry, "capex_per_gpu", where, problems),
            _num(entry, "amortisation_years", where, problems, positive=True),
            _num(entry, "ops_per_gpu_month", where, problems),
            _num(entry, "assumed_watts", where, problems),
        )
        if sku is not None:
            bare[sku] = values
    cloud = data.get("cloud")
    if not isinstance(cloud, Mapping):
        problems.append("cloud: a mapping with hypervisor_overhead, billing and instances")
        cloud = {}
    _keys(cloud, {"hypervisor_overhead", "billing", "instances"}, "cloud.", problems)
    overhead = _num(cloud, "hypervisor_overhead", "cloud.", problems)
    if overhead >= 1:
        problems.append("cloud.hypervisor_overhead: a fraction below 1 (0.05 is 5%)")
    billing = cloud.get("billing", "allocated")
    if billing not in BILLING:
        problems.append(f"cloud.billing: {billing!r}, one of {', '.join(BILLING)}")
        billing = "allocated"
    instances: dict[str, CloudInstance] = {}
    raw_instances = cloud.get("instances") or {}
    if not isinstance(raw_instances, Mapping):
        problems.append("cloud.instances: a mapping of GPU SKU to an instance")
        raw_instances = {}
    for raw, entry in raw_instances.items():
        sku = _sku_name(raw, "cloud.instances.", problems)
        where = f"cloud.instances.{raw}."
        if not isinstance(entry, Mapping):
            problems.append(f"{where[:-1]}: a mapping (instance, gpus, hourly)")
            continue
        _keys(entry, {"instance", "gpus", "hourly"}, where, problems)
        gpus = entry.get("gpus")
        if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= 64:
            problems.append(f"{where}gpus: {gpus!r} is not a number of GPUs from 1 to 64")
            gpus = 1
        label = entry.get("instance", "")
        if not isinstance(label, str):
            problems.append(f"{where}instance: a string naming the instance type")
            label = ""
        hourly = _num(entry, "hourly", where, problems)
        if sku is not None:
            instances[sku] = CloudInstance(label, gpus, hourly)
    if problems:
        head = (
            problems[0] if len(problems) == 1 else f"{len(problems)} problems, first: {problems[0]}"
        )
        raise ValidationFailed(
            f"cost model {source}: {head}",
            code="invalid_cost_model",
            details={"source": source, "problems": problems},
        )
    model = CostModel(
        name, currency, kwh_price, pue, dict(sorted(bare.items())), overhead, billing,
        dict(sorted(instances.items())), "",
    )  # fmt: skip
    digest = hashlib.sha256(
        json.dumps(model_json(model), sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    return CostModel(
        name, currency, kwh_price, pue, model.bare_metal, overhead, billing, model.cloud, digest
    )


def model_json(model: CostModel) -> dict[str, Any]:
    """Every input of the model, as JSON values (decimals as strings)."""
    return {
        "name": model.name,
        "currency": model.currency,
        "power": {"price_per_kwh": str(model.price_per_kwh), "pue": str(model.pue)},
        "bare_metal": {
            sku: {
                "capex_per_gpu": str(b.capex_per_gpu),
                "amortisation_years": str(b.amortisation_years),
                "ops_per_gpu_month": str(b.ops_per_gpu_month),
                "assumed_watts": str(b.assumed_watts),
            }
            for sku, b in model.bare_metal.items()
        },
        "cloud": {
            "hypervisor_overhead": str(model.hypervisor_overhead),
            "billing": model.billing,
            "instances": {
                sku: {"instance": c.instance, "gpus": c.gpus, "hourly": str(c.hourly)}
                for sku, c in model.cloud.items()
            },
        },
    }


FACT_PLACES = 9


def facts_json(facts: SkuFacts) -> dict[str, Any]:
    def q(v: Fraction | None) -> str | None:
        return None if v is None else str(round_fraction(v, FACT_PLACES))

    return {
        "sku": facts.sku,
        "gpus_owned": facts.gpus,
        "hours": q(facts.hours),
        "allocated_gpu_hours": q(facts.allocated_gpu_hours),
        "energy_kwh": q(facts.energy_kwh),
        "mean_activity": q(facts.mean_activity),
    }


def facts_from_json(data: object) -> list[SkuFacts]:
    """The facts a server measured (``compare``'s ``skus[].measured``), to price them with
    another model. Malformed input is a ``ValidationFailed``."""
    try:
        assert isinstance(data, list)
        out = []
        for item in data:

            def f(key: str, item: Mapping[str, Any] = item) -> Fraction | None:
                v = item.get(key)
                return None if v is None else Fraction(str(v))

            out.append(
                SkuFacts(
                    str(item["sku"]),
                    int(item["gpus_owned"]),
                    f("hours") or Fraction(0),
                    f("allocated_gpu_hours") or Fraction(0),
                    f("energy_kwh"),
                    f("mean_activity"),
                )
            )
        return out
    except (AssertionError, KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ValidationFailed(
            f"measured facts are malformed: {exc!r}", code="invalid_facts"
        ) from None


def _money(v: Fraction) -> str:
    return str(round_fraction(v, 2))


def _per_hour(v: Fraction | None) -> str | None:
    return None if v is None else str(round_fraction(v, MONEY_PER_HOUR_PLACES))


def compare(
    model: CostModel, facts: Sequence[SkuFacts], *, start: datetime, end: datetime
) -> dict[str, Any]:
    """The comparison per SKU (module docstring), every input and fact shown beside it."""
    rows: list[dict[str, Any]] = []
    not_compared: list[dict[str, str]] = []
    pue, kwh_price = Fraction(model.pue), Fraction(model.price_per_kwh)
    keep = 1 - Fraction(model.hypervisor_overhead)
    for f in sorted(facts, key=lambda x: x.sku):
        bare = model.bare_metal.get(f.sku)
        if bare is None:
            not_compared.append({"sku": f.sku, "why": "the cost model has no bare_metal entry"})
            continue
        capacity = f.gpus * f.hours
        amortisation = (
            Fraction(bare.capex_per_gpu) * capacity / (Fraction(bare.amortisation_years) * 8760)
        )
        if f.energy_kwh is not None:
            kwh, power_source = f.energy_kwh, "metered"
        else:
            kwh, power_source = capacity * Fraction(bare.assumed_watts) / 1000, "assumed"
        power = kwh * pue * kwh_price
        operations = Fraction(bare.ops_per_gpu_month) * capacity / HOURS_PER_MONTH
        total = amortisation + power + operations
        activity = f.mean_activity if f.mean_activity is not None else Fraction(1)
        effective = f.allocated_gpu_hours * activity
        bare_per_eff = total / effective if effective else None
        cloud: dict[str, Any] | None = None
        ratio = None
        inst = model.cloud.get(f.sku)
        if inst is not None:
            per_gpu_hour = Fraction(inst.hourly) / inst.gpus
            basis = f.allocated_gpu_hours if model.billing == "allocated" else capacity
            paid = basis / keep
            cloud_total = per_gpu_hour * paid
            cloud_per_eff = cloud_total / effective if effective else None
            cloud = {
                "instance": inst.instance,
                "per_gpu_hour": _per_hour(per_gpu_hour),
                "paid_gpu_hours": str(round_fraction(paid, 6)),
                "total": _money(cloud_total),
                "per_effective_gpu_hour": _per_hour(cloud_per_eff),
            }
            if bare_per_eff is not None and cloud_per_eff:
                ratio = str(round_fraction(bare_per_eff / cloud_per_eff, 3))
        rows.append(
            {
                "sku": f.sku,
                "measured": {
                    **facts_json(f),
                    "capacity_gpu_hours": str(round_fraction(capacity, 6)),
                    "allocation": (
                        str(round_fraction(f.allocated_gpu_hours / capacity, 4))
                        if capacity
                        else None
                    ),
                    "activity_source": "metered" if f.mean_activity is not None else "assumed 1",
                    "effective_gpu_hours": str(round_fraction(effective, 6)),
                },
                "bare_metal": {
                    "amortisation": _money(amortisation),
                    "power": _money(power),
                    "power_source": power_source,
                    "energy_kwh_used": str(round_fraction(kwh, 3)),
                    "operations": _money(operations),
                    "total": _money(total),
                    "per_capacity_gpu_hour": _per_hour(total / capacity if capacity else None),
                    "per_effective_gpu_hour": _per_hour(bare_per_eff),
                },
                "cloud": cloud,
                "bare_metal_to_cloud": ratio,
            }
        )
    return {
        "window": {"from": fmt_time(start), "end": fmt_time(end)},
        "currency": model.currency,
        "cost_model": {"sha256": model.digest, **model_json(model)},
        "skus": rows,
        "not_compared": not_compared,
        "facts": [facts_json(f) for f in sorted(facts, key=lambda x: x.sku)],
        "formulas": [
            "capacity GPU-hours = GPUs owned x hours",
            "amortisation = capex_per_gpu x capacity GPU-hours / (amortisation_years x 8760)",
            "power = kWh x pue x price_per_kwh (kWh metered; else GPUs x hours x "
            "assumed_watts / 1000)",
            "operations = ops_per_gpu_month x capacity GPU-hours / 730",
            "effective GPU-hours = allocated GPU-hours x mean GR_ENGINE_ACTIVE (1 if unmetered)",
            "cloud paid GPU-hours = (allocated or capacity GPU-hours, per billing) / "
            "(1 - hypervisor_overhead)",
            "per effective GPU-hour = total / effective GPU-hours",
        ],
        "rounding": "ROUND_HALF_EVEN: totals to 0.01, per-hour costs to 0.0001",
    }
