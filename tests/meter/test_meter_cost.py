"""The cost model (meter.cost): parsing with clear errors, and the comparison's arithmetic on a
case worked by hand."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from fractions import Fraction
from typing import Any

import pytest

from proofplane.errors import ValidationFailed
from proofplane.meter.cost import SkuFacts, compare, facts_from_json, facts_json, parse_cost_model

MODEL: dict[str, Any] = {
    "version": 1,
    "name": "hand",
    "currency": "USD",
    "power": {"price_per_kwh": "0.12", "pue": "1.3"},
    "bare_metal": {
        "H100": {
            "capex_per_gpu": "30000",
            "amortisation_years": 4,
            "ops_per_gpu_month": "120",
            "assumed_watts": 600,
        }
    },
    "cloud": {
        "hypervisor_overhead": "0.05",
        "billing": "allocated",
        "instances": {"H100-80GB": {"instance": "8x H100", "gpus": 8, "hourly": "60"}},
    },
}
T0 = datetime(2026, 1, 1, tzinfo=UTC)
T1 = datetime(2026, 1, 31, 10, tzinfo=UTC)  # 730 hours
MONTH = SkuFacts("H100-80GB", 8, Fraction(730), Fraction(2920), None, Fraction(1, 2))


def model_with(**changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(MODEL)
    for path, value in changes.items():
        node = data
        *parents, last = path.split("__")
        for p in parents:
            node = node[p]
        node[last] = value
    return data


def test_a_month_worked_by_hand() -> None:
    result = compare(parse_cost_model(MODEL), [MONTH], start=T0, end=T1)
    (row,) = result["skus"]
    m, b, c = row["measured"], row["bare_metal"], row["cloud"]
    assert m["capacity_gpu_hours"] == "5840.000000" and m["allocation"] == "0.5000"
    assert m["effective_gpu_hours"] == "1460.000000" and m["activity_source"] == "metered"
    assert b["amortisation"] == "5000.00"  # 30000 x 5840 / (4 x 8760)
    assert b["power_source"] == "assumed" and b["energy_kwh_used"] == "3504.000"
    assert b["power"] == "546.62"  # 3504 kWh x 1.3 x 0.12
    assert b["operations"] == "960.00"  # 120 x 5840 / 730
    assert b["total"] == "6506.62"
    assert b["per_capacity_gpu_hour"] == "1.1141"  # 6506.624 / 5840
    assert b["per_effective_gpu_hour"] == "4.4566"  # 6506.624 / 1460
    assert c["per_gpu_hour"] == "7.5000" and c["paid_gpu_hours"] == "3073.684211"
    assert c["per_effective_gpu_hour"] == "15.7895"  # 7.5 / 0.95 / 0.5
    assert row["bare_metal_to_cloud"] == "0.282"
    assert result["cost_model"]["bare_metal"]["H100-80GB"]["capex_per_gpu"] == "30000"
    assert result["facts"] == [facts_json(MONTH)]
    assert len(result["formulas"]) >= 6


def test_metered_energy_and_capacity_billing() -> None:
    facts = SkuFacts("H100-80GB", 8, Fraction(730), Fraction(2920), Fraction(2000), None)
    model = parse_cost_model(model_with(cloud__billing="capacity"))
    (row,) = compare(model, [facts], start=T0, end=T1)["skus"]
    assert row["bare_metal"]["power_source"] == "metered"
    assert row["bare_metal"]["power"] == "312.00"  # 2000 x 1.3 x 0.12
    assert row["measured"]["activity_source"] == "assumed 1"
    assert row["cloud"]["paid_gpu_hours"] == "6147.368421"  # 5840 / 0.95


def test_skus_the_model_lacks_are_listed_not_compared() -> None:
    facts = [MONTH, SkuFacts("A100-40GB", 4, Fraction(730), Fraction(0), None, None)]
    result = compare(parse_cost_model(MODEL), facts, start=T0, end=T1)
    assert [r["sku"] for r in result["skus"]] == ["H100-80GB"]
    assert result["not_compared"][0]["sku"] == "A100-40GB"
    idle = SkuFacts("H100-80GB", 8, Fraction(730), Fraction(0), None, None)
    (row,) = compare(parse_cost_model(MODEL), [idle], start=T0, end=T1)["skus"]
    assert row["bare_metal"]["per_effective_gpu_hour"] is None  # nothing effective: no ratio
    assert row["bare_metal_to_cloud"] is None


def test_facts_round_trip_and_malformed_facts() -> None:
    again = facts_from_json([facts_json(MONTH)])
    assert again == [MONTH]
    for bad in (None, [{"sku": "x"}], [{"sku": "x", "gpus_owned": "many"}], "facts"):
        with pytest.raises(ValidationFailed) as info:
            facts_from_json(bad)
        assert info.value.code == "invalid_facts"


def test_the_shipped_model_is_valid() -> None:
    from proofplane.service.usage import load_cost_model

    model = load_cost_model()
    assert "H100-80GB" in model.bare_metal and "H100-80GB" in model.cloud


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ([], "the model is a mapping"),
        (model_with(version=3), "version: 3"),
        (model_with(currency="$"), "currency"),
        (model_with(power="cheap"), "power: a mapping"),
        (model_with(power__pue="0.9"), "at least 1"),
        (model_with(power__price_per_kwh="free"), "'free' is not a decimal"),
        (model_with(bare_metal={}), "bare_metal: a non-empty mapping"),
        (model_with(bare_metal__GTX={"capex_per_gpu": "1"}), "GTX: unknown GPU SKU"),
        (model_with(bare_metal__H100__amortisation_years=0), "must be above 0"),
        (model_with(bare_metal__H100__capex_per_gpu="-5"), "capex_per_gpu"),
        (model_with(bare_metal__H100__colour="red"), "colour: unknown key"),
        (model_with(bare_metal__H100="x"), "a mapping (capex_per_gpu"),
        (model_with(cloud__hypervisor_overhead="1.5"), "a fraction below 1"),
        (model_with(cloud__billing="spot"), "cloud.billing: 'spot'"),
        (model_with(cloud__instances__H100_80GB={"gpus": 8, "hourly": "1"}), "unknown GPU"),
        (model_with(cloud__instances__A100={"gpus": 0, "hourly": "1"}), "gpus: 0"),
        (model_with(cloud__instances__A100={"gpus": 8}), "hourly: missing"),
        (model_with(cloud__instances="none"), "cloud.instances: a mapping"),
        (model_with(cloud="none"), "cloud: a mapping"),
    ],
)
def test_malformed_models(data: Any, expected: str) -> None:
    with pytest.raises(ValidationFailed) as info:
        parse_cost_model(data, source="model.yaml")
    assert info.value.code == "invalid_cost_model"
    assert info.value.message.startswith("cost model model.yaml: ")
    found = info.value.details["problems"]
    assert any(expected in p for p in found), found
