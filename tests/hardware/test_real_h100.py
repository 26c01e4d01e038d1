"""The shipped H100 table against a real H100's NVML readout (captured with
``scripts/nvml_check.py --json`` on an NVIDIA H100 80GB HBM3, driver 580.159.04; read-only):
rule 6, hardware facts come from hardware."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from ci import load_script
from proofplane.hardware import nvml
from proofplane.hardware.skus import SKUS

READOUT = json.loads((Path(__file__).parent / "data" / "h100_80gb_hbm3_nvml.json").read_text())


def _check_module() -> Any:
    return load_script("scripts/nvml_check.py", "nvml_check")


def test_the_h100_table_is_what_a_real_h100_reports() -> None:
    gpu = READOUT["inventory"]["gpus"][0]
    sku = nvml.sku_for(gpu["name"], gpu["memory_mb"])
    assert sku is SKUS["H100-80GB"] and gpu["model"] == "H100-80GB"
    assert _check_module()._compare(sku.mig_profiles, READOUT["profiles"]) == []
    # every profile the GPU has is in the table, and the other way round
    assert {p["id"] for p in READOUT["profiles"]} == {p.profile_id for p in sku.mig_profiles}


def test_a_table_that_disagrees_is_named() -> None:
    sku = SKUS["H100-80GB"]
    wrong = tuple(
        replace(p, starts=(0, 2, 4)) if p.name == "1g.20gb" else p for p in sku.mig_profiles
    )
    problems = _check_module()._compare(wrong, READOUT["profiles"])
    assert problems == [
        "1g.20gb: placements [(0, 2), (2, 2), (4, 2), (6, 2)], table [(0, 2), (2, 2), (4, 2)]"
    ]
