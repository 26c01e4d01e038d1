"""The usage report as a FOCUS 1.x cost and usage dataset (FinOps Open Cost and Usage
Specification, https://focus.finops.org), one CSV row per report line (pure).

Column semantics as the specification defines them:

* ``BilledCost``: the basis of the invoice (list less the rate card's discount), rounded per
  row ROUND_HALF_EVEN to the currency's minor unit; ``EffectiveCost`` equals it (proofplane
  sells no commitments to amortise); ``ListCost`` is ``ListUnitPrice`` × ``PricingQuantity``
  before rounding; ``ContractedCost``/``ContractedUnitPrice`` apply the card's discount.
* ``ChargeCategory`` ``Usage``, ``ChargeFrequency`` ``Usage-Based``, ``ChargeClass`` null
  (no corrections); ``ChargePeriodStart``/``End``: the part of the report window one rate
  period prices (inclusive start, exclusive end, UTC, ``YYYY-MM-DDTHH:mm:ssZ``);
  ``BillingPeriodStart``/``End``: the report window.
* ``ConsumedQuantity`` in ``ConsumedUnit`` ``GPU-Hours``: GPU-equivalent hours (a MIG
  instance weighted by its compute slices over 7, a shared GPU by ``share_milli``/1000).
  ``PricingUnit`` is ``GPU-Hours``, or ``Instance-Hours`` where the card prices a MIG profile
  by the instance-hour.
* ``BillingAccountId``/``SubAccountId``: the tenant; ``ResourceId``: the workload
  (``proofplane:workload/<tenant>/<name>``) when grouped by workload, else the tenant's holding
  of one SKU in one compliance pool; ``SkuId``: ``H100-80GB``, ``H100-80GB/3g.40gb``,
  ``H100-80GB/shared``; ``SkuPriceId``: the SKU and the rate period's start.
* ``Tags`` (JSON object, keys sorted): the workload's compliance tags as they are (user-defined)
  and the provider-defined ``proofplane:tenant`` and ``proofplane:compliance-pool`` (the ``:``
  cannot occur in a user's tag key, so the two never collide).
* Custom columns (``x_`` prefix): ``x_DeviceHours`` (hours of GPUs or MIG instances held),
  ``x_EnergyKwh`` (metered energy, not priced), ``x_RateCardSha256``.
"""

from __future__ import annotations

import json

from proofplane.errors import ValidationFailed
from proofplane.meter.usage import (
    GPU,
    MIG,
    SHARED,
    UsageLine,
    UsageReport,
    csv_cell,
    fmt_time,
    pool_tags,
)

FOCUS_VERSION = "1.2"
PROVIDER = "proofplane"
SERVICE_NAME = "proofplane GPU compute"
TAG_PREFIX = "proofplane:"

COLUMNS = (
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingCurrency",
    "BillingPeriodEnd",
    "BillingPeriodStart",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargeFrequency",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "ConsumedQuantity",
    "ConsumedUnit",
    "ContractedCost",
    "ContractedUnitPrice",
    "EffectiveCost",
    "InvoiceIssuerName",
    "ListCost",
    "ListUnitPrice",
    "PricingCategory",
    "PricingQuantity",
    "PricingUnit",
    "ProviderName",
    "PublisherName",
    "ResourceId",
    "ResourceName",
    "ResourceType",
    "ServiceCategory",
    "ServiceName",
    "SkuId",
    "SkuPriceId",
    "SubAccountId",
    "SubAccountName",
    "Tags",
    "x_DeviceHours",
    "x_EnergyKwh",
    "x_RateCardSha256",
)


def _description(line: UsageLine) -> str:
    pool = line.pool or "no compliance tags"
    if line.kind == MIG:
        what = f"{line.sku} MIG {line.mig_profile} instances"
    elif line.kind == SHARED:
        what = f"{line.sku} shared GPU fractions"
    elif line.kind == GPU:
        what = f"{line.sku} whole GPUs"
    else:  # pragma: no cover - FOCUS rows are per SKU (checked in focus_rows)
        what = "GPU usage"
    return f"{what}, pool {pool}"


def tags_json(line: UsageLine) -> str:
    tags: dict[str, str] = dict(pool_tags(line.pool or ""))
    tags[f"{TAG_PREFIX}tenant"] = line.tenant
    tags[f"{TAG_PREFIX}compliance-pool"] = line.pool or ""
    return json.dumps(dict(sorted(tags.items())), separators=(",", ":"))


def focus_rows(report: UsageReport) -> list[dict[str, str | None]]:
    """One FOCUS row per line. Needs lines per SKU (``group_by`` sku or workload): a FOCUS
    row names one SKU and its unit price."""
    if report.group_by not in ("sku", "workload"):
        raise ValidationFailed(
            f"FOCUS rows are per SKU: group by sku or workload, not {report.group_by!r}",
            code="invalid_group_by",
            details={"group_by": report.group_by, "allowed": ["sku", "workload"]},
        )
    out: list[dict[str, str | None]] = []
    for line in report.lines:
        assert line.sku_id is not None
        if line.workload is not None:
            resource_id = f"{PROVIDER}:workload/{line.tenant}/{line.workload}"
            resource_name, resource_type = line.workload, "Workload"
        else:
            pool = line.pool or "-"
            resource_id = f"{PROVIDER}:allocation/{line.tenant}/{pool}/{line.sku_id}"
            resource_name = f"{line.tenant} {line.sku_id} ({pool})"
            resource_type = "GPU Allocation"
        contracted = (
            None
            if line.contracted_unit_price is None
            else str(line.billed_cost)  # list less the discount, rounded like BilledCost
        )
        out.append(
            {
                "BilledCost": str(line.billed_cost),
                "BillingAccountId": line.tenant,
                "BillingAccountName": line.tenant,
                "BillingCurrency": report.currency,
                "BillingPeriodEnd": fmt_time(report.requested_end),
                "BillingPeriodStart": fmt_time(report.start),
                "ChargeCategory": "Usage",
                "ChargeClass": None,
                "ChargeDescription": _description(line),
                "ChargeFrequency": "Usage-Based",
                "ChargePeriodEnd": fmt_time(line.period_end),
                "ChargePeriodStart": fmt_time(line.period_start),
                "ConsumedQuantity": str(line.gpu_hours),
                "ConsumedUnit": "GPU-Hours",
                "ContractedCost": contracted,
                "ContractedUnitPrice": _s(line.contracted_unit_price),
                "EffectiveCost": str(line.billed_cost),
                "InvoiceIssuerName": PROVIDER,
                "ListCost": str(line.list_cost),
                "ListUnitPrice": _s(line.list_unit_price),
                "PricingCategory": "Standard",
                "PricingQuantity": _s(line.pricing_quantity),
                "PricingUnit": line.pricing_unit,
                "ProviderName": PROVIDER,
                "PublisherName": PROVIDER,
                "ResourceId": resource_id,
                "ResourceName": resource_name,
                "ResourceType": resource_type,
                "ServiceCategory": "Compute",
                "ServiceName": SERVICE_NAME,
                "SkuId": line.sku_id,
                "SkuPriceId": f"{line.sku_id}@{fmt_time(line.period_start)}",
                "SubAccountId": line.tenant,
                "SubAccountName": line.tenant,
                "Tags": tags_json(line),
                "x_DeviceHours": _s(line.device_hours),
                "x_EnergyKwh": _s(line.energy_kwh),
                "x_RateCardSha256": report.rate_card_digest,
            }
        )
    return out


def _s(value: object) -> str | None:
    return None if value is None else str(value)


def focus_csv(report: UsageReport) -> str:
    """The FOCUS dataset as CSV: a header of the column ids, ``\\n`` line ends, null as an
    empty cell."""
    rows = [",".join(COLUMNS)]
    for row in focus_rows(report):
        rows.append(",".join(csv_cell(row[c]) for c in COLUMNS))
    return "\n".join(rows) + "\n"
